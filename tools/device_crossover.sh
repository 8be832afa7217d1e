# Device call (H100, <= 420 s): where the chunk64 family (32-token chunks) overtakes chunk16, by sequence
# length at the backbone's head layout (H = 3, d = 64) and at the LM shape, the whole chunk_hdla op fwd+bwd,
# with fla's chunk_kda and SDPA beside them (issue 11; sets utils.CHUNK64_MIN_TOKENS).
# Usage on the device, repository root (carry .whl):
#   bash tools/device_crossover.sh
# Writes under $OUT (packed into results.tgz at the end):
#   chunk64/kernels.json, chunk16/kernels.json, baselines/kernels.json and their kernels_*.txt
#                                vision (T = 196), v384 (576), v512 (1024), hires (4096), long (16384), lm;
#                                chunk64 with a per-kernel profile at the LM and high-res shapes
#   timeline.txt
source tools/device_setup.sh
shapes=vision,v384,v512,hires,long,lm
stamp "start"
HDLA_VISION_KERNELS=chunk64 timeout 150 python3 -m benchmarks.kernels --ops ours --shapes $shapes --fast-gates "" \
  --no-check --profile lm,hires --out "$OUT/chunk64" > "$OUT/kernels_chunk64.txt" 2>&1
stamp "chunk64 done (rc $?)"
HDLA_VISION_KERNELS=chunk16 timeout 120 python3 -m benchmarks.kernels --ops ours --shapes $shapes --fast-gates "" \
  --no-check --out "$OUT/chunk16" > "$OUT/kernels_chunk16.txt" 2>&1
stamp "chunk16 done (rc $?)"
timeout 140 python3 -m benchmarks.kernels --ops sdpa,fla_kda --shapes $shapes --fast-gates "" --no-check \
  --autotune-rep-ms 5 --out "$OUT/baselines" > "$OUT/kernels_baselines.txt" 2>&1
stamp "baselines done (rc $?)"
stamp "end"
cat "$OUT/timeline.txt"
grep -h "fwd+bwd" "$OUT"/kernels_*.txt
cd "$OUT" && tar czf results.tgz --remove-files ./*
