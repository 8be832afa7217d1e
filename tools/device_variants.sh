#!/bin/bash
# Device call (one H100 or H200, < 560 s): the switched-off kernel variants of 2026-11-28 timed against the defaults
# in one process, and their bf16 parity against float64, so that the next session can turn on what wins:
#   f1_gram   F1 for HDLA from six base Grams of q and k ($HDLA_VISION_F1_GRAM=1, fwd.f1_hdla_gram)
#   stacks16  B2's copies of k, a, b in 16 bits ($HDLA_VISION_B2_SCRATCH=lowp_stacks)
# Usage on the device, repository root, carrying .whl with timm 1.0.31 (tools/device_setup.sh says why):
#   bash tools/device_variants.sh
# Writes under $OUT:
#   variants.json / .txt          benchmarks.launch_configs --variants base f1_gram stacks16 at the LM, 1024 px
#                                 batch and high-res shapes (HDLA) and the 1024 px batch for the KDA-like op
#   parity_<variant>.json / .txt  tests.gpu_bwd_sweep with the variant's switch on: the HDLA cases and two ranks
#   bidir_<variant>.txt           the bidirectional op with -20 on every eighth channel, the switch on
#   timeline.txt
source tools/device_setup.sh
stamp "start"
cases=$(python3 -c "from tests.gpu_bwd_sweep import CASES; print(','.join(n for n, c in CASES.items() if c['kind'] == 'hdla' or n in ('rab1_k128_v128', 'rab2_k64_v64', 'rab1_k128_every8_m20')))")
HDLA_VISION_F1_GRAM=1 timeout 200 python3 -m tests.gpu_bwd_sweep "$OUT/parity_f1_gram.json" --cases "$cases" \
  > "$OUT/parity_f1_gram.txt" 2>&1 &
p1=$!
HDLA_VISION_B2_SCRATCH=lowp_stacks timeout 200 python3 -m tests.gpu_bwd_sweep "$OUT/parity_stacks16.json" --cases "$cases" \
  > "$OUT/parity_stacks16.txt" 2>&1 &
p2=$!
wait "$p1" "$p2"
stamp "parity done"
for variant in f1_gram stacks16; do
  env $( [ $variant = f1_gram ] && echo HDLA_VISION_F1_GRAM=1 || echo HDLA_VISION_B2_SCRATCH=lowp_stacks ) \
    HDLA_VISION_KERNELS=chunk64 timeout 60 python3 -m benchmarks.bidirectional --part parity --cases hdla_every8_m20 \
    --out "$OUT" > "$OUT/bidir_$variant.txt" 2>&1
done
stamp "bidirectional parity done"
timeout 220 python3 -m benchmarks.launch_configs --shapes lm b1024 hires b1024:kda --variants base f1_gram stacks16 \
  --rep-ms 100 --out "$OUT/variants.json" > "$OUT/variants.txt" 2>&1
stamp "timing done (rc $?)"
cat "$OUT/timeline.txt"
grep -h "^ok\|^FAIL" "$OUT"/parity_*.txt | cut -c1-160
grep -h "worst" "$OUT"/bidir_*.txt
grep -v "^    " "$OUT/variants.txt" | grep fwd_bwd | cut -c1-220
