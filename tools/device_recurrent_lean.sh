#!/bin/bash
# Device call (one H100 or H200, < 560 s): the recurrence's lean kernels ($HDLA_VISION_RECURRENT_LEAN=1 backward,
# $HDLA_VISION_RECURRENT_LEAN_FWD=1 forward; kernels/README.md §11) against the default, for hdla_tiny at 224 px where
# the walk is ~75% of a graphed step. LEAN below is the backward's switch; FWD the forward's (0 or 1, default 0).
# 1. GPU parity under LEAN=1: the recurrence's CUDA tests (float64 loop, bidirectional definition, lean = default).
# 2. One block's bidirectional op fwd+bwd at the 224 / 512 px batches, LEAN 0 1 0 1 (one process each, the
#    bf16 gradients against float64 in the first of each).
# 3. The forward alone, FWD 0 1 (benchmarks.recurrent's timings at the vision and 224 px shapes).
# 4. hdla_tiny's training step as a CUDA graph at 224 px, LEAN 0 and 1, and deit_tiny beside them.
# Usage on the device, repository root, carrying .whl:   COMMIT=<sha> bash tools/device_recurrent_lean.sh
# Writes under $OUT: summary.txt, timeline.txt, results.tgz (gpu_tests_lean.txt, bidir_lean*.txt, graphs_*/).
source tools/device_setup.sh
export HDLA_VISION_RECURRENT_LEAN_FWD=${FWD:-0}
stamp "start ${COMMIT:-?} (forward lean: $HDLA_VISION_RECURRENT_LEAN_FWD)"
(HDLA_VISION_RECURRENT_LEAN=1 HDLA_VISION_RECURRENT_LEAN_FWD=1 timeout 180 python3 -m pytest -q -p no:cacheprovider \
   -m gpu tests/ops/test_recurrent_hdla.py > "$OUT/gpu_tests_lean.txt" 2>&1; stamp "gpu tests (lean) done (rc $?)") &
for lean in 0 1; do
  (HDLA_VISION_RECURRENT_LEAN=$lean timeout 180 nice -n 10 python3 -m benchmarks.models --models hdla_tiny \
     --resolutions 224 --modes train --cuda-graphs --no-eager --warmup-ms 1 --rep-ms 1 --out "$OUT/warm_$lean" \
     > "$OUT/warm_$lean.txt" 2>&1; stamp "warm lean=$lean done (rc $?)") &
done
warm_models 180 deit_tiny_patch16_224 224 --modes train --cuda-graphs --no-eager
wait
rm -rf "$OUT"/warm_*
for rep in 1 2; do
  for lean in 0 1; do
    parity=$([ "$rep" = 1 ] && echo "" || echo "--no-parity")
    HDLA_VISION_RECURRENT_LEAN=$lean timeout 45 python3 -m benchmarks.recurrent --bidir-train b224,b512 $parity \
      > "$OUT/bidir_lean${lean}_$rep.txt" 2>&1
    stamp "bidir lean=$lean rep $rep done (rc $?)"
  done
done
for fwd in 0 1; do  # the forward alone (and the recurrence's fwd+bwd) at the vision and 224 px shapes
  HDLA_VISION_RECURRENT_LEAN_FWD=$fwd timeout 40 python3 -m benchmarks.recurrent --shapes vision,m224 --baselines "" \
    --no-parity >> "$OUT/fwd_lean$fwd.txt" 2>&1
  stamp "forward lean=$fwd done (rc $?)"
done
for lean in 0 1; do
  mkdir -p "$OUT/graphs_lean$lean"
  HDLA_VISION_RECURRENT_LEAN=$lean timeout 45 python3 -m benchmarks.models --models hdla_tiny --resolutions 224 \
    --modes train --cuda-graphs --no-eager --warmup-ms 20 --rep-ms 80 --out "$OUT/graphs_lean$lean" \
    > "$OUT/graphs_lean$lean/models.txt" 2>&1
  stamp "graphs lean=$lean done (rc $?)"
done
mkdir -p "$OUT/graphs_deit"
timeout 45 python3 -m benchmarks.models --models deit_tiny_patch16_224 --resolutions 224 --modes train --cuda-graphs \
  --no-eager --warmup-ms 20 --rep-ms 80 --out "$OUT/graphs_deit" > "$OUT/graphs_deit/models.txt" 2>&1
stamp "graphs deit done (rc $?)"
{ cat "$OUT/timeline.txt"; tail -n 2 "$OUT/gpu_tests_lean.txt"
  for f in "$OUT"/bidir_lean*.txt "$OUT"/fwd_lean*.txt; do echo "== $(basename "$f")"; grep -vE "^\s*$|Warning|warn" "$f" | tail -n 6; done
  for d in "$OUT"/graphs_*; do echo "== $(basename "$d")"; grep -E "^(hdla|deit)" "$d/models.txt" | head -2; done
} > "$OUT/summary.txt" 2>&1
pack
cat "$OUT/summary.txt"
