# Device call (H100, <= 400 s): the chunk64 backward without the second F1 (B2 forms B1's inputs; issue 11),
# and the sequence length from which chunk64 beats chunk16 (utils.CHUNK64_MIN_TOKENS).
# Usage on the device, repository root (carry .whl):
#   bash tools/device_b1_inputs.sh
# Writes under $OUT (packed into results.tgz at the end):
#   parity.json / parity.txt     bf16 backward parity against float64 (tests.gpu_bwd_sweep, chunk 32), in the
#                                background while the timings run
#   chunk64/kernels.json, kernels_chunk64.txt
#                                chunk_hdla fwd+bwd from T = 196 to 16384 and at the LM shape, a per-kernel
#                                profile at the LM and vision shapes
#   chunk16/kernels.json, kernels_chunk16.txt   the same op on chunk16 at T = 1024 and 2048
#   timeline.txt
source tools/device_setup.sh
stamp "start"
(timeout 200 nice -n 10 python3 -m tests.gpu_bwd_sweep "$OUT/parity.json" --cases \
   hdla_k64_mild,hdla_k128_mild_fast_channel,rab2_k64_mild_fast_channel_rev,hdla_k64_gates20_rev,rab2_rkv2_scalar_k64,rab0_k64_v64,hdla_k256_v256,hdla_k64_fp32 \
   > "$OUT/parity.txt" 2>&1; stamp "parity done (rc $?)") &
parity_pid=$!
HDLA_VISION_KERNELS=chunk64 timeout 200 python3 -m benchmarks.kernels --ops ours --fast-gates "" --no-check \
  --shapes vision,v384,v512,t2048,hires,long,lm --profile lm,vision --out "$OUT/chunk64" > "$OUT/kernels_chunk64.txt" 2>&1
stamp "chunk64 done (rc $?)"
HDLA_VISION_KERNELS=chunk16 timeout 100 python3 -m benchmarks.kernels --ops ours --fast-gates "" --no-check \
  --shapes v512,t2048 --out "$OUT/chunk16" > "$OUT/kernels_chunk16.txt" 2>&1
stamp "chunk16 done (rc $?)"
wait "$parity_pid"
stamp "end"
cat "$OUT/timeline.txt"
grep -h "fwd+bwd" "$OUT"/kernels_*.txt
grep -A18 "profile" "$OUT/kernels_chunk64.txt" | grep -E "profile|kernel " | cut -c1-30,100-160
cut -c1-300 "$OUT/parity.txt"
cd "$OUT" && tar czf results.tgz --remove-files ./*
