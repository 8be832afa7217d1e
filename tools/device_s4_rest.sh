#!/bin/bash
# Device call (one H100 or H200, < 580 s), after tools/device_s4_group.sh ran out of time on 2026-11-28: the
# backward's bf16 parity cases that call did not reach (tests.gpu_bwd_sweep --cases ..., S4 grouped as by
# default), log-linear's CUDA tests alone (the doubling and F2's chains across chunks), then hdla_tiny against
# deit_tiny at 1024 and 2048 px (benchmarks.models, train and infer, eager) with the grouped S4.
# Usage on the device, repository root, carrying .whl:
#   COMMIT=<sha> CASES=<comma-separated sweep cases> bash tools/device_s4_rest.sh
# Writes under $OUT: summary.txt, timeline.txt, results.tgz (bwd_sweep.json/.txt, loglinear_tests.txt, models.json/.txt).
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
(timeout 200 nice -n 10 python3 -m benchmarks.models --models hdla_tiny --resolutions 1024 2048 \
   --warmup-ms 1 --rep-ms 1 --out "$OUT/warm" > "$OUT/warm.txt" 2>&1; stamp "warm-up done (rc $?)") &
timeout 200 python3 -m tests.gpu_bwd_sweep "$OUT/bwd_sweep.json" --cases "$CASES" > "$OUT/bwd_sweep.txt" 2>&1
stamp "sweep done (rc $?)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_chunk_loglinear.py \
  > "$OUT/loglinear_tests.txt" 2>&1
stamp "log-linear tests done (rc $?)"
wait
timeout 180 python3 -m benchmarks.models --models hdla_tiny deit_tiny_patch16_224 --resolutions 1024 2048 \
  --warmup-ms 30 --rep-ms 150 --out "$OUT" > "$OUT/models.txt" 2>&1
stamp "models done (rc $?)"
rm -rf "$OUT/warm" "$OUT/warm.txt"
{ cat "$OUT/timeline.txt"; grep -c "^ok" "$OUT/bwd_sweep.txt"; grep "^FAIL" "$OUT/bwd_sweep.txt" | cut -c1-400
  tail -n 3 "$OUT/loglinear_tests.txt"; tail -n 12 "$OUT/models.txt"; } > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
