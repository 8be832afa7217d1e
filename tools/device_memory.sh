# Device call (H100, one call, <= 240 s): peak training memory and images/s of the mixer models against deit_tiny
# with the recomputed mixer stages (issue 12 part 4), eager, bf16 autocast.
# Usage on the device, repository root:
#   bash tools/device_memory.sh
# Writes under $OUT:
#   predicted_chunk16.json, predicted_chunk64.json, predicted.txt
#                   python -m tools.saved_memory --whole: what autograd saves per model on fake CUDA tensors (no GPU
#                   work) and the predicted peak ratio to deit_tiny (saved bytes + 16 B/parameter), both kernel families
#   recompute_chunk16/models.json, recompute_chunk16.txt
#                   benchmarks.models, training step (bf16 autocast, fused AdamW), eager: hdla_tiny, gla_tiny, gdn_tiny,
#                   kda_tiny, deit_tiny at 224 px (batch 256) and 1024 px (batch 16), default kernels (chunk16):
#                   img/s, peak MiB (torch.cuda.max_memory_allocated over one step), ratios to deit_tiny
#   saved_chunk16/models.json, saved_chunk16.txt
#                   the same for hdla_tiny, gla_tiny, deit_tiny with --no-activation-recompute (the activations saved,
#                   as before): what the recomputation costs in img/s and saves in memory
#   recompute_chunk64/models.json, recompute_chunk64.txt
#                   hdla_tiny, gla_tiny, deit_tiny with HDLA_VISION_KERNELS=chunk64 (bf16 chunk states)
#   timeline.txt    start / end of each part
# Each benchmark row is printed as it is measured (one JSON line), so a run cut short keeps what it measured.
source tools/device_setup.sh
stamp() { echo "$(date +%T) $*" >> "$OUT/timeline.txt"; }
bench() {  # bench NAME SECONDS [ENV=VALUE ...] -- ARGS...: one benchmarks.models run into $OUT/NAME
  local name=$1 seconds=$2; shift 2
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout "$seconds" python3 -m benchmarks.models --modes train --resolutions 224 1024 \
    --warmup-ms 25 --rep-ms 100 --out "$OUT/$name" "$@" > "$OUT/$name.txt" 2>&1
  stamp "$name done (rc $?)"
}
stamp "start"
(for family in chunk16 chunk64; do
   timeout 60 python3 -m tools.saved_memory --whole --kernels "$family" --resolutions 224 1024 --top 0 \
     --out "$OUT/predicted_$family.json"
 done > "$OUT/predicted.txt" 2>&1; stamp "predicted done (rc $?)") &
THREE="hdla_tiny gla_tiny deit_tiny_patch16_224"
bench recompute_chunk16 100 HDLA_VISION_KERNELS=chunk16 -- --models hdla_tiny gla_tiny gdn_tiny kda_tiny deit_tiny_patch16_224
bench saved_chunk16 55 HDLA_VISION_KERNELS=chunk16 -- --models $THREE --no-activation-recompute
bench recompute_chunk64 70 HDLA_VISION_KERNELS=chunk64 -- --models $THREE
wait
stamp "end"
cat "$OUT/timeline.txt"
grep -h '"saved_ratio"' "$OUT/predicted.txt"
for name in recompute_chunk16 saved_chunk16 recompute_chunk64; do
  echo "== $name"
  grep -h '^{' "$OUT/$name.txt" | cut -c1-260
  sed -n '/^ratios /,$p' "$OUT/$name.txt"
done
