# Device call (H100, <= 420 s): the chunk64 family at its 32-token default (issue 11), measured whole.
# Usage on the device, repository root (carry .whl):
#   bash tools/device_chunk32.sh
# Writes under $OUT (packed into results.tgz at the end):
#   bwd_chunks.json / bwd.txt    B1, B2 at C = 32 and 64 at the high-res and LM shapes (HDLA, rank 1; the
#                                vision shape was measured on 2026-11-24), with B2's launches
#   chunk64/kernels.json, chunk16/kernels.json, kernels_*.txt
#                                chunk_hdla fwd+bwd per family at the vision, high-res and LM shapes, with
#                                every eighth channel at log lambda = -20 too, and SDPA; fla's chunk_kda
#                                beside chunk16 (autotune shortened)
#   parity.json / parity.txt     bf16 backward parity at C = 32 (tests.gpu_bwd_sweep cases, chunk 32)
#   timeline.txt
source tools/device_setup.sh
stamp "start"
(timeout 150 nice -n 10 python3 -m tests.gpu_bwd_sweep "$OUT/parity.json" --cases \
   hdla_k64_mild,hdla_k128_mild_fast_channel,rab2_k64_mild_fast_channel_rev,hdla_k64_gates20_rev,rab2_rkv2_scalar_k64 \
   > "$OUT/parity.txt" 2>&1; stamp "parity done (rc $?)") &
parity_pid=$!
timeout 120 python3 -m benchmarks.kernel_stages_bwd --shapes hires,lm --kinds hdla,rab1 --chunks 32,64 --profile \
  --out "$OUT/bwd_chunks.json" > "$OUT/bwd.txt" 2>&1
stamp "bwd done (rc $?)"
HDLA_VISION_KERNELS=chunk64 timeout 90 python3 -m benchmarks.kernels --ops ours,sdpa --shapes vision,hires,lm \
  --no-check --fast-gates vision,hires,lm --out "$OUT/chunk64" > "$OUT/kernels_chunk64.txt" 2>&1
stamp "chunk64 done (rc $?)"
HDLA_VISION_KERNELS=chunk16 timeout 110 python3 -m benchmarks.kernels --ops ours,fla_kda,sdpa --shapes vision,hires,lm \
  --no-check --autotune-rep-ms 5 --out "$OUT/chunk16" > "$OUT/kernels_chunk16.txt" 2>&1
stamp "chunk16 done (rc $?)"
wait "$parity_pid"
stamp "end"
cat "$OUT/timeline.txt"
grep -h "fwd+bwd" "$OUT"/kernels_*.txt
grep -h '^{' "$OUT/bwd.txt" | cut -c1-200
cut -c1-300 "$OUT/parity.txt"
cd "$OUT" && tar czf results.tgz --remove-files ./*
