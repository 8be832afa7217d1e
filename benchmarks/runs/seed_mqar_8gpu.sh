#!/bin/bash
# One call on an 8-GPU machine (nvidia-h200-x8): the seed-mixer comparison with fla, one mixer
# group per GPU 0-5 (benchmarks/runs/seed_on_gpu.sh), and the MQAR queue
# benchmarks/runs/mqar_queue_1.txt on GPUs 6-7 (benchmarks/runs/mqar_queue.sh), with the GPU
# tests beside the MQAR worker on GPU 7. Everything ends inside the 10-minute command limit;
# results come back as one archive, plus fla's merged Triton cache for a later call.
#   bash benchmarks/runs/seed_mqar_8gpu.sh      (on the device; $OUT/results.tgz)
source benchmarks/device_setup.sh
res=/tmp/res
mkdir -p $res "$OUT"
nvidia-smi -L > $res/gpus.txt
forced=(-- --fla-gated-bwd-anyway)
export WARM_S=${WARM_S:-170} SEED_S=${SEED_S:-260}
bash benchmarks/runs/seed_on_gpu.sh 0 $res/seed_gla 4 gla &
bash benchmarks/runs/seed_on_gpu.sh 1 $res/seed_kda 4 kda &
bash benchmarks/runs/seed_on_gpu.sh 2 $res/seed_rwkv7 3 rwkv7 &
bash benchmarks/runs/seed_on_gpu.sh 3 $res/seed_gdp2 3 gated_deltaproduct_2 "${forced[@]}" &
bash benchmarks/runs/seed_on_gpu.sh 4 $res/seed_gdp3 3 gated_deltaproduct_3 "${forced[@]}" &
bash benchmarks/runs/seed_on_gpu.sh 5 $res/seed_deltanet 2 deltanet gated_deltanet "${forced[@]}" &
(CUDA_VISIBLE_DEVICES=7 TRITON_CACHE_DIR=/tmp/tcache_tests timeout 300 python -m pytest -q -rs tests \
  -k "cuda or gpu or device_mismatch" > $res/pytest_gpu.txt 2>&1) &
bash benchmarks/runs/mqar_queue.sh benchmarks/runs/mqar_queue_1.txt $res/mqar "${MQAR_DEADLINE_S:-470}" 6 7 \
  > $res/mqar_queue.log 2>&1 &
wait
echo "all done at $SECONDS s"
python -m benchmarks.fla_seed --merge-from $res/seed_*/ --out $res > /dev/null 2>&1
runs=$(for d in $res/mqar/run_*; do [ -f "$d/mqar_runs.json" ] && echo "$d"; done)
[ -n "$runs" ] && python benchmarks/mqar.py --merge-from $runs --out-dir $res/mqar_merged > $res/mqar_merge.log 2>&1
tar czf "$OUT/results.tgz" -C $res --exclude='*/run_*/*.png' . || true
mkdir -p /tmp/tcache_all && for d in /tmp/tcache_[0-9]*; do cp -rn "$d"/. /tmp/tcache_all/; done
TRITON_CACHE_DIR=/tmp/tcache_all timeout 30 python benchmarks/triton_cache.py pack /tmp/fla_cache.tar \
  && timeout 30 xz -T0 -6 /tmp/fla_cache.tar && cp /tmp/fla_cache.tar.xz "$OUT/fla_triton_cache.tar.xz"
echo "packed at $SECONDS s"
