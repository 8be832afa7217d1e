# Device call (H100, <= 560 s): chunk_hdla's fwd+bwd in two source trees, one after the other in one call, so that
# the timings compare on one machine: device and host time per call (benchmarks.host_profile --op) and the
# benchmarks.kernels table. Then, in the second tree, bf16 backward parity against float64 (tests.gpu_bwd_sweep).
# Usage on the device, repository root = the second tree (carry .whl and the first tree):
#   bash tools/device_ab.sh <first tree> [shapes, default "vision hires lm"]
#   CASES=all PARITY_S=300 bash tools/device_ab.sh ...   (the whole parity sweep; CASES: comma-separated names)
# Writes under $OUT: a/ and b/ (host_<shape>.txt, kernels.json, kernels.txt), parity.json / parity.txt, timeline.txt.
first=$(cd "$1" && pwd); second=$(pwd); shapes=${2:-vision hires lm}
stamp() { echo "$(date +%T) $*" >> "$OUT/timeline.txt"; }
run_tree() {  # tree, label
  (cd "$1" && source tools/device_setup.sh && mkdir -p "$OUT/$2" &&
   for shape in $shapes; do
     HDLA_VISION_KERNELS=chunk64 timeout 90 python3 -m benchmarks.host_profile --op $shape --rows 10 \
       > "$OUT/$2/host_$shape.txt" 2>&1
   done
   HDLA_VISION_KERNELS=chunk64 timeout 120 python3 -m benchmarks.kernels --ops ours --shapes ${shapes// /,} --no-check \
     --fast-gates "" --profile vision --out "$OUT/$2" > "$OUT/$2/kernels.txt" 2>&1)
  stamp "$2 ($1) done (rc $?)"
}
stamp "start ${COMMIT:-?}"
run_tree "$first" a
run_tree "$second" b
source tools/device_setup.sh
cases=${CASES:-hdla_k64_mild,hdla_k128_mild_fast_channel,rab2_k64_mild_fast_channel_rev,hdla_k64_gates20_rev,rab2_rkv2_scalar_k64}
[ "$cases" = all ] && cases=
timeout ${PARITY_S:-150} python3 -m tests.gpu_bwd_sweep "$OUT/parity.json" ${cases:+--cases $cases} > "$OUT/parity.txt" 2>&1
stamp "parity done (rc $?)"
cat "$OUT/timeline.txt"
for t in a b; do echo "== $t"; grep -h "step .* ms (do_bench)\|^host\|JITFunction" "$OUT"/$t/host_*.txt; grep -h "fwd+bwd" "$OUT/$t/kernels.txt"; done
echo "parity ok: $(grep -c "^ok" "$OUT/parity.txt")"; grep -v "^ok" "$OUT/parity.txt" | cut -c1-300 | tail -12
