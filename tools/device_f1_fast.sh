# Device call (H100, one call, <= 240 s): F1ab's factored diagonal blocks (kernels/generalized/fwd.py,
# issue 11 parts 2 and 5) timed against the exact column loop, and checked in bf16 against float64.
# Usage on the device, repository root:
#   bash tools/device_f1_fast.sh
# Writes under $OUT (6 files):
#   kernel_stages_f1.json / f1.txt  F1 (chunk_prepare: F0 + F1ab + F1c, do_bench median) and F1ab alone
#                                   (chunk_intra_kernel, torch.profiler µs) at the vision (128,196,3,64),
#                                   high-res (8,4096,3,64) and LM (4,4096,16,128) shapes for HDLA, rank 1
#                                   (kda_like) and rank 2 (r_ab = r_kv = 2) with vector decay; mild gates
#                                   and log lambda uniform in [-20, 0]; diag_limit 30 (default) and 0 (the
#                                   loop everywhere); factored_predicted: the share of row blocks whose G
#                                   half range is below the limit (F1ab's rule on F0's G; the parity
#                                   cases record the kernel's own choice);
#                                   qeff_rel / mo_rel: the default's difference from the loop's (bf16)
#   parity_k64.txt, parity_k128.txt, parity_mixed.txt
#                                   bf16 forward (o, final state) against the float64 loop on the same
#                                   bf16-rounded inputs (benchmarks.kernel_stages --case, T = 1000), one JSON
#                                   line per case: mild gates (HDLA K 64, rank 2 K 128), gates down to -20
#                                   reversed (rank 2 K 64, HDLA K 128), 16-token blocks alternately mild and
#                                   fast (rank 1 K 64, HDLA K 128 reversed); tolerance 5e-3; "factored": the
#                                   share of row blocks the kernel recorded as the product
#   timeline.txt                    start / end of each part
# The parity runs (three chains of two processes, niced) start first in the background, then three
# processes (one per kind) compile every timed configuration in parallel (F1's kernels take seconds each
# to compile, and vision and high-res specialise apart: T = 196 is not a multiple of 16), then one process
# times them from the warm Triton cache; rerun a timing alone if it looks disturbed (timeline.txt).
source tools/device_setup.sh
stamp "start"
parity() {  # parity FILE ARGS...: one --case (T = 1000), its JSON line appended to FILE
  local f="$1"; shift
  timeout 100 nice -n 10 python3 -m benchmarks.kernel_stages --seq-len 1000 --case "$@" 2>&1 | tail -n 1 >> "$f"
}
(
  (parity "$OUT/parity_k64.txt" -1 1 64 64; parity "$OUT/parity_k64.txt" 2 2 64 64 --g-min -20 --reverse) &
  (parity "$OUT/parity_k128.txt" -1 1 128 128 --g-min -20 --reverse; parity "$OUT/parity_k128.txt" 2 2 128 128) &
  (parity "$OUT/parity_mixed.txt" 1 1 64 64 --mixed-gates; parity "$OUT/parity_mixed.txt" -1 1 128 128 --mixed-gates \
     --reverse) &
  wait
  stamp "parity done"
) &
parity_pid=$!
warm=()
for kind in hdla kda_like rank2; do  # compile the timed configurations, one process per kind, in parallel
  timeout 110 python3 -m benchmarks.kernel_stages --part f1 --warm-only --shapes vision,hires,lm --kinds "$kind" \
    --gates mild --out /tmp/f1_warm > "/tmp/f1_warm_$kind.txt" 2>&1 &
  warm+=($!)
done
wait "${warm[@]}"
stamp "f1 compiled"
tail -n 2 /tmp/f1_warm_*.txt | grep -i error | cut -c1-300
timeout 110 python3 -m benchmarks.kernel_stages --part f1 --shapes vision,hires,lm --kinds hdla,kda_like,rank2 \
  --gates mild,fast --out "$OUT" > "$OUT/f1.txt" 2>&1
stamp "f1 done (rc $?)"
wait "$parity_pid"
stamp "end"
cat "$OUT/timeline.txt"
grep -h '^{' "$OUT/f1.txt" | sed 's/"B_T_H_D": \[[0-9, ]*\], //' | cut -c1-300
tail -n 3 "$OUT/f1.txt" | grep -v '^{' | cut -c1-600
for f in "$OUT"/parity_*.txt; do echo "== $(basename "$f")"; cut -c1-400 "$f"; done
