#!/bin/bash
# One call on a 4-GPU machine (nvidia-h200-x4): the MQAR queue benchmarks/runs/mqar_queue_2.txt on
# GPUs 0-2, two workers per GPU (a run of these 1.6M-parameter models leaves the GPU idle much of
# the time), and on GPU 3 the GPU tests and the fla comparison of DeltaNet and Gated DeltaNet (fla's
# refused gated backward timed anyway). Results come back as one archive.
#   bash benchmarks/runs/mqar_seed_4gpu.sh      (on the device; $OUT/results.tgz)
source benchmarks/device_setup.sh
res=/tmp/res
mkdir -p $res "$OUT"
nvidia-smi -L > $res/gpus.txt
export WARM_S=${WARM_S:-170} SEED_S=${SEED_S:-300}
(
  CUDA_VISIBLE_DEVICES=3 TRITON_CACHE_DIR=/tmp/tcache_tests timeout 170 python -m pytest -q -rs tests \
    -k "(cuda or gpu or device_mismatch) and not fla" > $res/pytest_gpu.txt 2>&1 &
  bash benchmarks/runs/seed_on_gpu.sh 3 $res/seed_deltanet_gdn 3 deltanet gated_deltanet -- --fla-gated-bwd-anyway
  wait
) &
bash benchmarks/runs/mqar_queue.sh benchmarks/runs/mqar_queue_2.txt $res/mqar "${MQAR_DEADLINE_S:-500}" 0 0 1 1 2 2 \
  > $res/mqar_queue.log 2>&1 &
wait
echo "all done at $SECONDS s"
source benchmarks/runs/collect_results.sh
