#!/bin/bash
# Device call (one H100 or H200, <= 360 s): log-linear attention's chunk form compiled by inductor
# ($HDLA_VISION_LOGLINEAR_COMPILE, kernels/loglinear/chunk.py) on the GPU, against the eager chunk form (8.5-14.4x the
# linear op's fwd+bwd on the H200, 2026-11-28) and the linear op.
# 1. pytest -m gpu tests/ops/test_chunk_loglinear.py -k compiled (inductor's graph against the float64 loop, bf16 and
#    fp32, gates to -20).
# 2. python -m benchmarks.loglinear --parts paths at the high-res shape and T = 4096 (the paths part: chunk form,
#    linear op, per-level calls, compiled chunk form; fwd+bwd and peak memory).
# (results/loglinear_compiled_h200/, 2026-11-29: 2.1x faster than eager, now the default on CUDA; issue 14's target
# is 2x the linear op at T = 4096, the compiled form 3.6-4.6x.)
# Usage on the device, repository root (carry .whl):   COMMIT=<sha> bash tools/device_loglinear_compiled.sh
# Writes under $OUT: gpu_tests.txt, loglinear.json, paths.txt, timeline.txt.
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_chunk_loglinear.py -k compiled \
  > "$OUT/gpu_tests.txt" 2>&1
stamp "gpu tests done (rc $?)"
timeout 180 python3 -m benchmarks.loglinear --parts paths --paths-shapes hires,T4096 --out "$OUT" > "$OUT/paths.txt" 2>&1
stamp "paths done (rc $?)"
cat "$OUT/timeline.txt"
tail -n 2 "$OUT/gpu_tests.txt"
grep "^paths" "$OUT/paths.txt"
