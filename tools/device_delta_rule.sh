#!/bin/bash
# Device call (one H100 or H200, <= 560 s): the delta rule's kernels (kernels/delta_rule, kernels/README.md §12:
# KDA's structure, HDLA over two steps per token), forward and backward, on a GPU for the first time.
# 1. pytest -m gpu tests/ops/test_chunk_delta_rule.py (against the float64 loop at d = 64 and 128: output, final
#    state and every gradient; HDLA's steps).
# 2. python -m benchmarks.delta_rule --cuda-graphs: fwd and fwd+bwd ms of HDLA through the delta rule (per tl.dot
#    precision), the delta rule at KDA's shape, today's chunk_hdla and fla's chunk_kda, at the LM, high-res and
#    1024 px shapes, eager and as CUDA graphs; and the bf16 errors against float64.
# Usage on the device, repository root (carry .whl):   COMMIT=<sha> bash tools/device_delta_rule.sh
# Writes under $OUT: gpu_tests.txt, delta_rule.json, delta_rule.txt, timeline.txt.
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_chunk_delta_rule.py > "$OUT/gpu_tests.txt" 2>&1
stamp "gpu tests done (rc $?)"
timeout 330 python3 -m benchmarks.delta_rule --cuda-graphs --autotune-rep-ms 5 --out "$OUT" > "$OUT/delta_rule.txt" 2>&1
stamp "benchmark done (rc $?)"
cat "$OUT/timeline.txt"
tail -n 3 "$OUT/gpu_tests.txt"
cat "$OUT/delta_rule.txt"
