# Device call (H100, < 300 s): the bidirectional op (issue 12 part 1, kernels/README.md §9) on the chunk64
# kernels: bf16 parity, and the fused op's time against the two single-direction calls and the sum.
# Usage on the device, repository root (carry .whl if the device needs wheels):
#   bash tools/device_bidir.sh
# Step 1 compiles side by side (the parity runs and the timing warm-ups, each its own process; their GPU
# work is untimed); step 2 times with the kernels cached, alone on the GPU. Writes under $OUT (packed
# into results.tgz at the end when there are more than 8 files):
#   bidirectional_parity_<case>.json, parity_<case>.txt
#                     per case (HDLA mild, HDLA with gates to -20 and beta at 0 and 2; rank 1 with k, a, b
#                     stacked; rank 1 with a decay per head, v and b shared; rank 0 with k, v shared), B 2,
#                     T 300, H 2, K = V = 64: y, both final states and every gradient in bf16 (fp32 gates)
#                     against the float64 loops on the same rounded inputs; fused=True: the fused path ran;
#                     "vs two calls": the fused op against chunk_* twice + the sum, both in bf16
#   warmup_<kind>/bidirectional_warmup.json, warmup_<kind>.txt   first-call seconds (compilation)
#   bidirectional_timing.json, timing.txt
#                     fwd and fwd+bwd ms (benchmarks.timing) of fused, fused+stack (with the mixer's stack
#                     of the gates) and two_calls (chunk_hdla twice + the mixer's old sum) at (128,196,3,64),
#                     (16,4096,3,64), (2,16384,3,64), and the ratios fused / two_calls
#   kda/bidirectional_timing.json, timing_kda.txt   the same for the generalized op at rank 1 (k, a, b
#                     stacked, v shared) at the vision and 2048 px shapes
#   timeline.txt
source tools/device_setup.sh
export HDLA_VISION_KERNELS=chunk64
stamp "start"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/timeline.txt" 2>&1
pids=()
for case in hdla_mild hdla_gates20_beta_ends rab1_stacked_kab rab1_scalar_shared_vb rab0_shared_kv; do
  timeout 160 python3 -m benchmarks.bidirectional --part parity --cases "$case" --out "$OUT" \
    > "$OUT/parity_$case.txt" 2>&1 &
  pids+=($!)
done
for kind in hdla kda; do
  mkdir -p "$OUT/warmup_$kind"
  shapes=vision,1024px,2048px
  [ "$kind" = kda ] && shapes=vision,2048px
  timeout 160 python3 -m benchmarks.bidirectional --part warmup --kinds "$kind" --shapes "$shapes" \
    --out "$OUT/warmup_$kind" > "$OUT/warmup_$kind.txt" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
stamp "step 1 (parity, warm-ups) done"
timeout 60 python3 -m benchmarks.bidirectional --part timing --shapes vision,1024px,2048px --out "$OUT" \
  > "$OUT/timing.txt" 2>&1
stamp "timing done (rc $?)"
mkdir -p "$OUT/kda"
timeout 45 python3 -m benchmarks.bidirectional --part timing --kinds kda --shapes vision,2048px --out "$OUT/kda" \
  > "$OUT/timing_kda.txt" 2>&1
stamp "kda timing done (rc $?)"
stamp "end"
cat "$OUT/timeline.txt"
for f in "$OUT"/parity_*.txt; do cut -c1-420 "$f" | grep -v "^wrote" | tail -n 3; done
tail -n 3 "$OUT"/warmup_*.txt
grep -v "^wrote" "$OUT/timing.txt" | tail -n 12
grep -v "^wrote" "$OUT/timing_kda.txt" | tail -n 6
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  cd "$OUT" && tar czf results.tgz --remove-files ./*
fi
