#!/bin/bash
# Device call (one H100 or H200, < 560 s) for the CPU-side work of 2026-11-28 (second session):
#   1. benchmarks.loglinear --parts paths: chunk_loglinear_hdla through the one PyTorch chunk form and through the
#      per-level calls, each against chunk_hdla, at the high-res, T = 4096 and LM shapes (issue 14's target: <= 2x)
#   2. benchmarks.kernels --ops ours,sdpa at the high-res and vision shapes: the op's host time after the plain-int
#      cdiv / next_power_of_2 (it is host-bound at high-res); fla_kda left out (measured earlier on 2026-11-28, its
#      autotune costs ~200 s of device time)
# Usage on the device, repository root, carrying .whl (timm 1.0.31, fla_core 0.6.0, einops):
#   bash tools/device_host_and_loglinear.sh
# Writes under $OUT: summary.txt, timeline.txt and results.tgz (loglinear.json, kernels.json and their stdout)
source tools/device_setup.sh
stamp "start"
timeout 260 python3 -m benchmarks.loglinear --parts paths --paths-shapes hires,T4096,lm --out "$OUT" \
  > "$OUT/loglinear.txt" 2>&1
stamp "loglinear paths done (rc $?)"
timeout 150 python3 -m benchmarks.kernels --ops ours,sdpa --shapes hires,vision --fast-gates "" --no-check \
  --autotune-rep-ms 10 --out "$OUT" > "$OUT/kernels.txt" 2>&1
stamp "kernels done (rc $?)"
{ cat "$OUT/timeline.txt"; grep -h "^paths\|fwd+bwd" "$OUT/loglinear.txt" "$OUT/kernels.txt"; } > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
