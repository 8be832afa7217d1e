# Device call (H100, <= 580 s): HDLA's token recurrence in training (kernels/README.md §11) as it stands:
# its GPU tests, one block's bidirectional op fwd+bwd at hdla_tiny's 224 / 512 px batches on both paths
# (the backward in batch slices under the scratch budget, and without a budget), and hdla_tiny against
# deit_tiny in training at 224 / 512 px, eager and CUDA-graphed, with peak memory.
# Usage on the device, repository root (carry .whl; set COMMIT to the commit that holds the code):
#   bash tools/device_recurrence_train.sh
# Writes under $OUT: gpu_tests.txt, bidir_train.txt (budget 1024 MiB, the default), bidir_train_nobudget.txt
# (HDLA_VISION_B2_SCRATCH_MIB=0: one launch), models.json / models.txt, timeline.txt.
source tools/device_setup.sh
stamp "start"
timeout 120 python3 -m pytest -q -m gpu tests/ops/test_recurrent_hdla.py > "$OUT/gpu_tests.txt" 2>&1
stamp "gpu tests done (rc $?)"
timeout 120 python3 -m benchmarks.recurrent --bidir-train b224,b512 > "$OUT/bidir_train.txt" 2>&1
stamp "bidir train done (rc $?)"
HDLA_VISION_B2_SCRATCH_MIB=0 timeout 60 python3 -m benchmarks.recurrent --bidir-train b224,b512 --no-parity \
  > "$OUT/bidir_train_nobudget.txt" 2>&1
stamp "bidir train without a budget done (rc $?)"
timeout 220 python3 -m benchmarks.models --models hdla_tiny deit_tiny_patch16_224 --modes train \
  --resolutions 224 512 --rep-ms 300 --compile reduce-overhead --out "$OUT" > "$OUT/models.txt" 2>&1
stamp "models done (rc $?)"
cat "$OUT/timeline.txt"
