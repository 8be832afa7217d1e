#!/bin/bash
# Device call (one H100 or H200, < 580 s) after 4f3045d (the recurrence's routing by sequences and the training
# limit at 512 tokens; log-linear's one chunk form on CUDA by default):
#   1. the CUDA tests of those two: the chunk form against the float64 loop in bf16 and fp32, which op chunk_hdla
#      runs under the new limits
#   2. benchmarks.kernels at the high-res shape, ours against fla's chunk_kda and SDPA in one process (issue 11)
#   3. benchmarks.loglinear --parts paths at the high-res shape with the peak memory of each path
#   4. benchmarks.models: hdla_tiny against deit_tiny at 512 and 1024 px, training and inference (issue 12)
# Usage on the device, repository root, carrying .whl:  COMMIT=<sha> bash tools/device_routing_check.sh
# Writes under $OUT: summary.txt, timeline.txt and results.tgz
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_chunk_loglinear.py -k "on_cuda" \
  tests/ops/test_recurrent_hdla.py::test_which_op_chunk_hdla_runs > "$OUT/gpu_tests.txt" 2>&1
stamp "gpu tests done (rc $?)"
timeout 170 python3 -m benchmarks.kernels --ops ours,fla_kda,sdpa --shapes hires --fast-gates "" --no-check \
  --autotune-rep-ms 10 --out "$OUT" > "$OUT/kernels.txt" 2>&1
stamp "kernels done (rc $?)"
timeout 60 python3 -m benchmarks.loglinear --parts paths --paths-shapes hires --out "$OUT" > "$OUT/loglinear.txt" 2>&1
stamp "loglinear paths done (rc $?)"
timeout 150 python3 -m benchmarks.models --models hdla_tiny deit_tiny_patch16_224 --resolutions 512 1024 \
  --warmup-ms 30 --rep-ms 150 --out "$OUT" > "$OUT/models.txt" 2>&1
stamp "models done (rc $?)"
{ cat "$OUT/timeline.txt"; tail -n 3 "$OUT/gpu_tests.txt"; grep -h "fwd+bwd" "$OUT/kernels.txt" "$OUT/loglinear.txt"
  tail -n 12 "$OUT/models.txt"; } > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
