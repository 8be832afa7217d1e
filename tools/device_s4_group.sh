#!/bin/bash
# Device call (one H100 or H200, < 580 s): S4's products grouped per launch (bwd_chunk.S4_LAUNCHES, the default since
# f07b23b) against one launch per product (launch_configs variant s4_single), per kernel and for the whole op in one
# process, then the backward's bf16 parity with the grouping (tests.gpu_bwd_sweep, every case), the CUDA tests of the
# chunk ops and of log-linear inference (both ways across chunks), and log-linear's forward by the doubling and by
# F2's chains (benchmarks.loglinear --parts ours; its stdout keeps the shapes done if the timeout cuts it).
# Usage on the device, repository root, carrying .whl (timm, fla: benchmarks/README.md):
#   COMMIT=<sha> bash tools/device_s4_group.sh
# Writes under $OUT: summary.txt (the timing summary, the sweep's and the tests' last lines), timeline.txt,
# results.tgz (s4_group.json / .txt, bwd_sweep.json / .txt, gpu_tests.txt, loglinear/ and loglinear.txt).
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 200 python3 -m benchmarks.launch_configs --shapes lm hires b1024 --variants base s4_single --rep-ms 100 \
  --out "$OUT/s4_group.json" > "$OUT/s4_group.txt" 2>&1
stamp "timing done (rc $?)"
timeout 130 python3 -m tests.gpu_bwd_sweep "$OUT/bwd_sweep.json" > "$OUT/bwd_sweep.txt" 2>&1
stamp "sweep done (rc $?)"
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_chunk_hdla.py tests/ops/test_chunk_generalized.py \
  tests/ops/test_chunk_loglinear.py > "$OUT/gpu_tests.txt" 2>&1
stamp "gpu tests done (rc $?)"
mkdir -p "$OUT/loglinear"
timeout 120 python3 -m benchmarks.loglinear --parts ours --out "$OUT/loglinear" > "$OUT/loglinear.txt" 2>&1
stamp "loglinear done (rc $?)"
{ cat "$OUT/timeline.txt"
  python3 -m benchmarks.launch_configs --summarize "$OUT/s4_group.json" --summary-kernels _gemm_group_kernel
  tail -n 8 "$OUT/bwd_sweep.txt"; tail -n 3 "$OUT/gpu_tests.txt"; grep "^ours" "$OUT/loglinear.txt"; } \
  > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
