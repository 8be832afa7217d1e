#!/bin/bash
# Device call (one H100 or H200, < 560 s), 2026-11-28 third session:
#   1. hdla_tiny's training step at 512 px, the recurrence's training limit at 512 (now) against 1024 (before)
#      tokens, alternating in one process (benchmarks.launch_configs --models-ab)
#   2. F2's state columns per program (fwd.f2_block_v: 16 at the LM and high-res shapes) at 32 / 64 / 128
# Usage on the device, repository root, carrying .whl:  COMMIT=<sha> bash tools/device_f2_routing.sh
# Writes under $OUT: summary.txt, timeline.txt and results.tgz (models_ab.json, f2_bv.json and their stdout)
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 230 python3 -m benchmarks.launch_configs --models-ab hdla_tiny --resolutions 512 \
  --variants base recurrence_train_1024 --rounds 2 --rep-ms 150 --out "$OUT/models_ab.json" > "$OUT/models_ab.txt" 2>&1
stamp "models A/B done (rc $?)"
timeout 250 python3 -m benchmarks.launch_configs --shapes lm hires b1024 --variants base f2_bv32 f2_bv64 f2_bv128 \
  --rep-ms 100 --out "$OUT/f2_bv.json" > "$OUT/f2_bv.txt" 2>&1
stamp "F2 variants done (rc $?)"
{ cat "$OUT/timeline.txt"
  python3 -m benchmarks.launch_configs --summarize "$OUT/models_ab.json" "$OUT/f2_bv.json" \
    --summary-kernels chunk_state_kernel,group_compose_kernel,group_walk_kernel,group_expand_kernel,_bwd_state_kernel
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
