#!/bin/bash
# Device call (H100, one call, < 540 s): HDLA's lean S1 (bwd_chunk.b2_config's hdla_lean: no A, B stacks, no
# fp32 At, Bh in 16 bits) against every stack written (variant full_stacks), timed per kernel in one process, and
# its parity with the levels (S2b, S5b write the rows of the blocks they take).
# Usage on the device, repository root, carrying .whl with the timm wheel the package imports (the device's own timm
# lacks timm.models._input; here: pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl timm==1.0.31):
#   bash tools/device_lean_stacks.sh
# On 2026-11-28 the session's device budget allowed one call of 243 s: the parity parts and the timing of the LM rows
# (benchmarks/results/lean_stacks_h200/README.md).
# Writes under $OUT:
#   lean_stacks.json / .txt          launch_configs base vs full_stacks at the LM, 1024 px batch and high-res shapes
#   lean_stacks_every8.json / .txt   the 1024 px batch with log lambda = -20 on every eighth channel (S2b, S5b take blocks)
#   parity.json / parity.txt         tests.gpu_bwd_sweep's HDLA cases (bf16 and fp32 against float64, < 5e-3)
#   bidir_parity_*.json / .txt       the bidirectional op with -20 on every eighth channel, against float64
#   timeline.txt
source tools/device_setup.sh
stamp "start"
hdla_cases=$(python3 -c "from tests.gpu_bwd_sweep import CASES; print(','.join(n for n, c in CASES.items() if c['kind'] == 'hdla'))")
timeout 240 python3 -m tests.gpu_bwd_sweep "$OUT/parity.json" --cases "$hdla_cases" > "$OUT/parity.txt" 2>&1 &
sweep=$!
mkdir -p "$OUT/bidir"
HDLA_VISION_KERNELS=chunk64 timeout 240 python3 -m benchmarks.bidirectional --part parity \
  --cases hdla_every8_m20,hdla_gates20_beta_ends,hdla_mild --out "$OUT/bidir" > "$OUT/bidir_parity.txt" 2>&1 &
bidir=$!
wait "$sweep" "$bidir"
stamp "parity done"
timeout 200 python3 -m benchmarks.launch_configs --shapes lm b1024 hires --variants base full_stacks \
  --out "$OUT/lean_stacks.json" > "$OUT/lean_stacks.txt" 2>&1
stamp "timing mild done (rc $?)"
timeout 100 python3 -m benchmarks.launch_configs --shapes b1024 --variants base full_stacks --gates every8 \
  --out "$OUT/lean_stacks_every8.json" > "$OUT/lean_stacks_every8.txt" 2>&1
stamp "timing every8 done (rc $?)"
cp "$OUT"/bidir/*.json "$OUT/" 2>/dev/null
rm -rf "$OUT/bidir"
cat "$OUT/timeline.txt"
tail -n 25 "$OUT/parity.txt" "$OUT/bidir_parity.txt" "$OUT/lean_stacks.txt" "$OUT/lean_stacks_every8.txt"
