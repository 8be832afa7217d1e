#!/bin/bash
# Device call (one H100 or H200, < 480 s): chunk16 against chunk64 below utils.CHUNK64_MIN_TOKENS (576), after the
# chunk64 launch merges of 2026-11-28 (S4 grouped, S6+S7 in one launch). If chunk64 is as fast at 196-576 tokens,
# the auto routing can send every length to it (issue 11, item 7: one kernel family), which also takes the
# generalized op with one log-decay per head off chunk16, whose bf16 dg is 1.06e-2 from float64 at T = 300.
#   1. chunk_hdla fwd+bwd (benchmarks.kernels --ops ours) at the vision (128, 196, 3, 64) and 384 px (64, 576, 3, 64)
#      shapes, each family in its own process (warmed first, side by side)
#   2. the bidirectional ops (HDLA and the generalized op at rank 1) at the vision shape and the 224 px batch
#   3. bidirectional parity (T = 300) on chunk64
# Usage on the device, repository root, carrying .whl:   COMMIT=<sha> bash tools/device_family_crossover.sh
# Writes under $OUT: summary.txt, timeline.txt, results.tgz (k_<family>/, b_<family>/, parity_chunk64/ and stdout).
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
for fam in chunk16 chunk64; do
  (HDLA_VISION_KERNELS=$fam timeout 150 python3 -m benchmarks.bidirectional --part warmup --kinds hdla,kda \
     --shapes vision,224px_b256 --variants fused --out "$OUT/warm_$fam" > "$OUT/warm_$fam.txt" 2>&1
   stamp "warm $fam done (rc $?)") &
done
mkdir -p "$OUT/parity_chunk64"
(HDLA_VISION_KERNELS=chunk64 timeout 150 python3 -m benchmarks.bidirectional --part parity --kinds hdla,kda \
   --out "$OUT/parity_chunk64" > "$OUT/parity_chunk64.txt" 2>&1; stamp "parity chunk64 done (rc $?)") &
wait
for fam in chunk16 chunk64; do
  mkdir -p "$OUT/k_$fam" "$OUT/b_$fam"
  HDLA_VISION_KERNELS=$fam timeout 90 python3 -m benchmarks.kernels --ops ours --shapes vision,v384 --fast-gates "" \
    --no-check --out "$OUT/k_$fam" > "$OUT/k_$fam.txt" 2>&1
  stamp "kernels $fam done (rc $?)"
  HDLA_VISION_KERNELS=$fam timeout 80 python3 -m benchmarks.bidirectional --part timing --kinds hdla,kda \
    --shapes vision,224px_b256 --variants fused --out "$OUT/b_$fam" > "$OUT/b_$fam.txt" 2>&1
  stamp "bidirectional $fam done (rc $?)"
done
rm -rf "$OUT"/warm_*
{ cat "$OUT/timeline.txt"
  for fam in chunk16 chunk64; do echo "== $fam"; grep -v "^\s*$" "$OUT/k_$fam.txt" | grep -i "ours\|vision\|v384" | head -8
    grep -i "fused" "$OUT/b_$fam.txt" | head -8; done
  echo "== parity chunk64"; grep "worst" "$OUT/parity_chunk64.txt" | cut -c1-200; } > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
