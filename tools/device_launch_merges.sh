#!/bin/bash
# Device call (one H100 or H200, < 580 s): the launch merges of 2026-11-28's seventh session on the GPU.
# S7 inside S6's launch (bwd_chunk._reduce_kernel) and the token recurrence's epilogue in one launch
# (fused_recurrent.sum_parts_grouped): parity first (the recurrence's and the bidirectional op's CUDA tests,
# the chunk backward's bf16 sweep on the cases S6 runs in: HDLA, decay per head, both directions via
# benchmarks.bidirectional), then the op at the benchmark shapes and hdla_tiny against deit_tiny at 224 and 2048 px.
# Usage on the device, repository root, carrying .whl:   COMMIT=<sha> bash tools/device_launch_merges.sh
# Writes under $OUT: summary.txt, timeline.txt, results.tgz (gpu_tests.txt, bwd_sweep.json/.txt, bidir_parity/,
# ops.json/.txt, models.json/.txt).
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
(timeout 150 nice -n 10 python3 -m benchmarks.models --models hdla_tiny --resolutions 224 2048 --warmup-ms 1 \
   --rep-ms 1 --out "$OUT/warm" > "$OUT/warm.txt" 2>&1; stamp "warm-up done (rc $?)") &
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_recurrent_hdla.py > "$OUT/gpu_tests.txt" 2>&1
stamp "recurrence tests done (rc $?)"
timeout 120 python3 -m tests.gpu_bwd_sweep "$OUT/bwd_sweep.json" \
  --cases hdla_k64_v128,hdla_k128_gates20_rev,rab1_rkv3_scalar_k128,rab2_rkv2_scalar_k64,hdla_k64_fp32,rab1_k128_v128 \
  > "$OUT/bwd_sweep.txt" 2>&1
stamp "sweep done (rc $?)"
mkdir -p "$OUT/bidir_parity"
timeout 90 python3 -m benchmarks.bidirectional --part parity --kinds hdla,kda --out "$OUT/bidir_parity" \
  > "$OUT/bidir_parity.txt" 2>&1
stamp "bidirectional parity done (rc $?)"
wait
timeout 90 python3 -m benchmarks.launch_configs --shapes lm hires b1024 --variants base --rep-ms 100 \
  --out "$OUT/ops.json" > "$OUT/ops.txt" 2>&1
stamp "op timing done (rc $?)"
timeout 100 python3 -m benchmarks.models --models hdla_tiny deit_tiny_patch16_224 --resolutions 224 2048 \
  --warmup-ms 30 --rep-ms 150 --out "$OUT" > "$OUT/models.txt" 2>&1
stamp "models done (rc $?)"
rm -rf "$OUT/warm" "$OUT/warm.txt"
{ cat "$OUT/timeline.txt"; tail -n 2 "$OUT/gpu_tests.txt"; grep -c "^ok" "$OUT/bwd_sweep.txt"
  grep "^FAIL" "$OUT/bwd_sweep.txt" | cut -c1-300; tail -n 6 "$OUT/bidir_parity.txt"
  python3 -m benchmarks.launch_configs --summarize "$OUT/ops.json" --summary-kernels _reduce_kernel
  tail -n 8 "$OUT/models.txt"; } > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
