#!/bin/bash
# One call on a 4-GPU machine (nvidia-h200-x4): longer MQAR runs at L = 256 (13000 steps; the
# 4000-step runs of mqar_queue_2.txt stayed at chance) for the two middle learning rates of the
# paper's sweep, two workers per GPU on GPUs 0-2, and every CUDA test on GPU 3 (LM tests first).
#   bash benchmarks/runs/mqar_long_4gpu.sh      (on the device; $OUT/results.tgz)
source benchmarks/device_setup.sh
res=/tmp/res
mkdir -p $res "$OUT"
nvidia-smi -L > $res/gpus.txt
(CUDA_VISIBLE_DEVICES=3 TRITON_CACHE_DIR=/tmp/tcache_tests timeout "${TESTS_S:-400}" python -m pytest -q -rs \
  tests/test_lm.py tests/test_backbone.py tests/test_fused_recurrent.py tests/test_chunk_generalized.py \
  tests/test_gpu_kernels.py -k "(cuda or gpu or device_mismatch) and not fla" > $res/pytest_gpu.txt 2>&1) &
bash benchmarks/runs/mqar_queue.sh benchmarks/runs/mqar_queue_3.txt $res/mqar "${MQAR_DEADLINE_S:-400}" 0 0 1 1 2 2 \
  > $res/mqar_queue.log 2>&1 &
wait
echo "all done at $SECONDS s"
source benchmarks/runs/collect_results.sh
