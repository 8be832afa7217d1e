#!/bin/bash
# One call on a 4-GPU machine (nvidia-h200-x4): the seed-mixer comparison with fla, one mixer group
# per GPU (benchmarks/runs/seed_on_gpu.sh). While fla compiles (CPU-bound), the GPUs run the MQAR
# queue benchmarks/runs/mqar_queue_1.txt (benchmarks/runs/mqar_queue.sh, stopped at its deadline)
# and the GPU tests; the fla measurements start only once that has stopped. Everything ends inside
# the 10-minute command limit; results come back as one archive, plus fla's merged Triton cache.
#   bash benchmarks/runs/seed_mqar_4gpu.sh      (on the device; $OUT/results.tgz)
source benchmarks/device_setup.sh
res=/tmp/res
mkdir -p $res "$OUT"
nvidia-smi -L > $res/gpus.txt
forced=(-- --fla-gated-bwd-anyway)
export WARM_S=${WARM_S:-170} SEED_S=${SEED_S:-270} GPU_FREE_FLAG=/tmp/gpus_free
rm -f $GPU_FREE_FLAG
bash benchmarks/runs/seed_on_gpu.sh 0 $res/seed_gla 6 gla &
bash benchmarks/runs/seed_on_gpu.sh 1 $res/seed_kda 6 kda &
bash benchmarks/runs/seed_on_gpu.sh 2 $res/seed_rwkv7_gdn 3 rwkv7 gated_deltanet "${forced[@]}" &
bash benchmarks/runs/seed_on_gpu.sh 3 $res/seed_gdp 3 gated_deltaproduct_2 gated_deltaproduct_3 "${forced[@]}" &
(
  CUDA_VISIBLE_DEVICES=3 TRITON_CACHE_DIR=/tmp/tcache_tests timeout "${MQAR_DEADLINE_S:-170}" python -m pytest -q -rs \
    tests -k "cuda or gpu or device_mismatch" > $res/pytest_gpu.txt 2>&1 &
  MIN_JOB_S=80 bash benchmarks/runs/mqar_queue.sh benchmarks/runs/mqar_queue_1.txt $res/mqar "${MQAR_DEADLINE_S:-170}" 0 1 2 3 \
    > $res/mqar_queue.log 2>&1
  wait
  touch $GPU_FREE_FLAG
  echo "GPUs free for the fla measurements at $SECONDS s"
) &
wait
echo "all done at $SECONDS s"
python -m benchmarks.fla_seed --merge-from $res/seed_*/ --out $res > $res/seed_merge.log 2>&1
runs=$(for d in $res/mqar/run_*; do [ -f "$d/mqar_runs.json" ] && echo "$d"; done)
[ -n "$runs" ] && python benchmarks/mqar.py --merge-from $runs --out-dir $res/mqar_merged > $res/mqar_merge.log 2>&1
tar czf "$OUT/results.tgz" -C $res --exclude='*/run_*/*.png' . || true
mkdir -p /tmp/tcache_all && for d in /tmp/tcache_[0-9]*; do cp -rn "$d"/. /tmp/tcache_all/; done
TRITON_CACHE_DIR=/tmp/tcache_all timeout 30 python benchmarks/triton_cache.py pack /tmp/fla_cache.tar \
  && timeout 30 xz -T0 -6 /tmp/fla_cache.tar && cp /tmp/fla_cache.tar.xz "$OUT/fla_triton_cache.tar.xz"
echo "packed at $SECONDS s"
