#!/bin/bash
# One call on a 4-GPU machine (nvidia-h200-x4): the seed-mixer comparison with fla, one mixer group
# per GPU (benchmarks/runs/seed_on_gpu.sh). While fla compiles (CPU-bound), the GPUs run the MQAR
# queue benchmarks/runs/mqar_queue_1.txt (benchmarks/runs/mqar_queue.sh, stopped at its deadline)
# and the GPU tests; the fla measurements start only once that has stopped. Everything ends inside
# the 10-minute command limit; results come back as one archive. (At 6fcc2b3 it also packed the
# four GPUs' fla caches: 1.3 GB of autotune variants, too large to come back, so that step is gone.)
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
source benchmarks/runs/collect_results.sh
