# Device call (H100, <= 560 s): B2's scratch carved from a lifetime-planned pool, the Gram VJPs summed per
# stack, and the 1024 MiB slice budget (kernels/generalized/bwd_chunk.py allocate_scratch, bwd.py).
# Usage on the device, repository root (carry .whl):  bash tools/device_pool.sh
# Writes under $OUT:
#   parity.json / parity.txt   bf16 backward parity on the GPU (tests.gpu_bwd_sweep cases, chunk 32)
#   bidir/                     bf16 parity of the bidirectional op on chunk64 against the float64 loops
#   bwd.json / bwd.txt         B1, B2 and B2's launches at C = 32 (HDLA, rank 1; vision, high-res, LM)
#   kernels/ kernels_2048/     chunk_hdla fwd+bwd and peak memory at the vision, high-res, LM, long shapes with the
#                              slice budget at 1024 (the default) and at 2048 MiB
#   models.json / models.txt   hdla_tiny against deit_tiny, training, 512 / 1024 / 2048 px: images/s, peak memory
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
(timeout 200 nice -n 10 python3 -m tests.gpu_bwd_sweep "$OUT/parity.json" --cases \
   hdla_k64_mild,hdla_k128_mild_fast_channel,rab2_k64_mild_fast_channel_rev,hdla_k64_gates20_rev,rab2_rkv2_scalar_k64 \
   > "$OUT/parity.txt" 2>&1; stamp "parity done (rc $?)") &
parity_pid=$!
mkdir -p "$OUT/bidir"
HDLA_VISION_KERNELS=chunk64 timeout 100 python3 -m benchmarks.bidirectional --part parity --out "$OUT/bidir" \
  > "$OUT/bidir.txt" 2>&1
stamp "bidir parity done (rc $?)"
timeout 100 python3 -m benchmarks.kernel_stages_bwd --shapes vision,hires,lm --kinds hdla,rab1 --chunks 32 --profile \
  --out "$OUT/bwd.json" > "$OUT/bwd.txt" 2>&1
stamp "bwd done (rc $?)"
HDLA_VISION_KERNELS=chunk64 timeout 80 python3 -m benchmarks.kernels --ops ours --shapes vision,hires,lm,long \
  --no-check --fast-gates "" --out "$OUT/kernels" > "$OUT/kernels.txt" 2>&1
stamp "kernels done (rc $?)"
HDLA_VISION_B2_SCRATCH_MIB=2048 HDLA_VISION_KERNELS=chunk64 timeout 60 python3 -m benchmarks.kernels --ops ours \
  --shapes lm,long --no-check --fast-gates "" --out "$OUT/kernels_2048" > "$OUT/kernels_2048.txt" 2>&1
stamp "kernels at 2048 MiB done (rc $?)"
wait "$parity_pid"
timeout 150 python3 -m benchmarks.models --models hdla_tiny deit_tiny_patch16_224 --modes train \
  --resolutions 512 1024 2048 --rep-ms 200 --out "$OUT" > "$OUT/models.txt" 2>&1
stamp "models done (rc $?)"
cat "$OUT/timeline.txt"
grep -h "fwd+bwd\|peak" "$OUT"/kernels*.txt | head -20
grep -h '^{' "$OUT/bwd.txt" | cut -c1-250
cut -c1-300 "$OUT/parity.txt" | tail -12
tail -8 "$OUT/bidir.txt"
tail -12 "$OUT/models.txt"
