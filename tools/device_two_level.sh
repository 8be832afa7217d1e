# Device call (H100, one call, <= 300 s): the two-level scan of the chunk64 state passes F2 and B1
# (kernels/generalized/two_level.py, issue 11 part 4) timed against one level and checked in bf16.
# Usage on the device, repository root:
#   bash tools/device_two_level.sh
# Writes under $OUT:
#   kernel_stages_f2.json / f2.txt    F2 alone (do_bench medians), groups 1 (one level), auto (the launcher's
#                                     rule; groups_run says what it chose), 4, 8, 16 at (2,16384,3,64),
#                                     (8,4096,3,64), (4,4096,16,128); HDLA's real forward prep; h_rel and
#                                     final_rel: the relative difference from the one-level F2 (bf16 parity)
#   kernel_stages_bwd.json / b1.txt   B1, B2, B1+B2 at the same shapes (rank 1, chunk 64), groups 1, auto, 8, 16;
#                                     two_level_vs_one_level: every gradient's difference from the one-level B1
#   parity_*.txt                      bf16 against float64 with the groups forced by HDLA_VISION_STATE_GROUPS:
#                                     forward o / final (benchmarks.kernel_stages --case, T = 1000, 16 chunks,
#                                     4 groups; mild gates) and every gradient (tests.gpu_bwd_sweep --case,
#                                     T = 300, chunk 32, 3 groups); tolerance 5e-3
#   timeline.txt                      start / end of each part
# The parity runs (four processes, two at a time, niced) start first in the background so that their compiles
# overlap the timings' own; rerun a timing alone if it looks disturbed (timeline.txt).
source tools/device_setup.sh
stamp "start"
(
  (HDLA_VISION_STATE_GROUPS=4 timeout 120 nice -n 10 python3 -m benchmarks.kernel_stages --case -1 1 64 64 \
     --seq-len 1000 > "$OUT/parity_fwd_hdla.txt" 2>&1
   HDLA_VISION_STATE_GROUPS=4 timeout 100 nice -n 10 python3 -m benchmarks.kernel_stages --case 2 1 128 128 \
     --per-head --reverse --seq-len 1000 > "$OUT/parity_fwd_rab2_k128.txt" 2>&1) &
  (HDLA_VISION_STATE_GROUPS=3 timeout 120 nice -n 10 python3 -m tests.gpu_bwd_sweep --case rab2_k64_v64 32 \
     > "$OUT/parity_bwd_rab2.txt" 2>&1
   HDLA_VISION_STATE_GROUPS=3 timeout 110 nice -n 10 python3 -m tests.gpu_bwd_sweep --case hdla_k64_gates20_rev 32 \
     > "$OUT/parity_bwd_hdla_gates20.txt" 2>&1) &
  wait
  stamp "parity done"
) &
parity_pid=$!
timeout 110 python3 -m benchmarks.kernel_stages --part f2 --kinds hdla --shapes long,hires,lm \
  --groups 1,auto,4,8,16 --out "$OUT" > "$OUT/f2.txt" 2>&1
stamp "f2 done (rc $?)"
timeout 120 python3 -m benchmarks.kernel_stages_bwd --shapes 2048px,hires,lm --kinds rab1 --groups 1,auto,8,16 \
  --out "$OUT/kernel_stages_bwd.json" > "$OUT/b1.txt" 2>&1
stamp "b1 done (rc $?)"
wait "$parity_pid"
stamp "end"
cat "$OUT/timeline.txt"
grep -h '^{' "$OUT/f2.txt" | cut -c1-260
grep -h '^{' "$OUT/b1.txt" | sed 's/"b2_launches_us".*//' | cut -c1-400
for f in "$OUT"/parity_*.txt; do echo "$(basename "$f"): $(tail -n 1 "$f" | cut -c1-300)"; done
