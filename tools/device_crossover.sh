#!/bin/bash
# Device call (one H100 or H200, < 560 s): where HDLA's token recurrence still beats the chunk kernels, after
# the chunk kernels' speed-ups of 2026-11-25..28 (utils.RECURRENT_MAX_TOKENS = 4096 and
# RECURRENT_TRAIN_MAX_TOKENS = 1024 were set from 2026-11-24/25 timings), and the forward's per-kernel time.
#   1. benchmarks.recurrent: chunk against recurrence, forward (both ops, one and two directions) and fwd+bwd, at
#      the vision and high-res shapes and hdla_tiny's 224 / 512 / 1024 px batches (m224, m512, m1024)
#   2. benchmarks.recurrent --bidir-train: one training step's bidirectional op at the 224 / 512 px batches
#   3. benchmarks.kernels --profile-fwd: the chunk forward per kernel at the high-res and LM shapes
# Usage on the device, repository root, carrying .whl:  bash tools/device_crossover.sh
# Writes under $OUT: summary.txt, timeline.txt and results.tgz (recurrent.json, kernels.json and their stdout)
source tools/device_setup.sh
stamp "start"
timeout 200 python3 -m benchmarks.recurrent --shapes vision,hires,m224,m512,m1024 --baselines "" --no-parity \
  --out "$OUT/times" > "$OUT/recurrent.txt" 2>&1
stamp "recurrent times done (rc $?)"
timeout 120 python3 -m benchmarks.recurrent --bidir-train b224,b512 --no-parity --out "$OUT/bidir_train" \
  > "$OUT/bidir_train.txt" 2>&1
stamp "bidirectional training done (rc $?)"
timeout 120 python3 -m benchmarks.kernels --ops ours --shapes hires --fast-gates "" --no-check \
  --profile-fwd hires,lm --out "$OUT" > "$OUT/kernels.txt" 2>&1
stamp "forward profile done (rc $?)"
{ cat "$OUT/timeline.txt"; grep -h "^m\|^vision\|^hires\|^bidir" "$OUT/recurrent.txt" "$OUT/bidir_train.txt"
  grep -h -A14 "^profile forward" "$OUT/kernels.txt" | cut -c1-140; } > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
