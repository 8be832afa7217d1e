#!/bin/bash
# Device call (one H100 or H200, <= 540 s): what the scan op of one hdla_tiny block costs at the backbones'
# benchmark batches on our kernels, on fla's chunk_kda (a diagonal-plus-rank-one transition: no more work than
# HDLA's rank two) and on SDPA (FlashAttention, what deit_tiny's block runs), in one process. Issue 12's targets
# need hdla_tiny's whole step within 2x deit_tiny's at 224 px (training) and within 1x at 1024 px (inference):
# where fla's op alone, at both directions' work, exceeds that budget less the block's other parts, the target
# cannot be met by a faster kernel of this kind (benchmarks/results/NOTES.md, 2026-11-29).
# Shapes (benchmarks/kernels.py): b224 (512, 196, 3, 64) and b1024 (32, 4096, 3, 64), both directions' sequences
# of a block at 224 px (batch 256) and 1024 px (batch 16); long (2, 16384, 3, 64), one direction at 2048 px.
# Before it, the recurrence's backward (the 224 px op's cost: ~75% of hdla_tiny's graphed step) with a checkpoint
# every 4, 2 (the default since this call) and 1 tokens at (512, 196, 3, 64) (benchmarks.recurrent --bwd-configs).
# Usage on the device, repository root (carry .whl):   COMMIT=<sha> [SHAPES=b224,b1024,long] [SWEEP=1] [GRAPHS=0] \
#   bash tools/device_op_floor.sh
# GRAPHS=1 also times every op as CUDA-graph replays (benchmarks.kernels --cuda-graphs: the kernels without the host's
# launch work; our op at the high-res shape was host-bound, 3.66 ms a call against 2.25 ms of kernels, 2026-11-28).
# (results/op_floor_h200/: the first run, 2026-11-29; next: SHAPES=b2048,lm SWEEP=0, both directions at 2048 px
# and the language-model shape, where fla's autotune takes minutes a shape)
# Writes under $OUT: kernels.json (forward and forward+backward per op and shape), kernels.txt, recurrent.json and
# checkpoints.txt (the backward per checkpoint interval), timeline.txt.
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
if [ "${SWEEP:-1}" = 1 ]; then
  timeout 90 python3 -m benchmarks.recurrent --shapes m224 --bwd-configs 16x1x4,16x1x2,16x1x1 --no-parity --out "$OUT" \
    > "$OUT/checkpoints.txt" 2>&1
  stamp "checkpoint intervals done (rc $?)"
fi
timeout 400 python3 -m benchmarks.kernels --ops ours,fla_kda,sdpa --shapes "${SHAPES:-b224,b1024,long}" --no-check --fast-gates "" \
  --autotune-rep-ms 5 $([ "${GRAPHS:-0}" = 1 ] && echo --cuda-graphs) --out "$OUT" > "$OUT/kernels.txt" 2>&1
stamp "kernels done (rc $?)"
cat "$OUT/timeline.txt"
grep "^bwd" "$OUT/checkpoints.txt" 2>/dev/null
tail -n 20 "$OUT/kernels.txt"
