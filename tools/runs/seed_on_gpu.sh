#!/bin/bash
# The seed-mixer comparison with fla for some mixers on one GPU of a several-GPU machine, with a
# Triton cache of its own (so no other GPU's processes see its shards' autotune choices):
# unpack the carried fla cache, compile fla's kernels in parallel shards (and ours), forget the
# shards' autotune choices, then measure (benchmarks/fla_seed.py). If $GPU_FREE_FLAG names a file,
# the measuring waits until it exists (other work may use the GPU while fla compiles).
#   bash tools/runs/seed_on_gpu.sh GPU OUT_DIR SHARDS MIXER... [-- FLA_SEED_ARGS...]
gpu=$1 out=$2 shards=$3; shift 3
mixers=() extra=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do mixers+=("$1"); shift; done
[ "$1" = "--" ] && shift && extra=("$@")
export CUDA_VISIBLE_DEVICES=$gpu TRITON_CACHE_DIR=/tmp/tcache_$gpu
mkdir -p "$out"
t0=$SECONDS
for archive in fla_cache/*.tar.xz; do
  [ -e "$archive" ] && python -m tools.triton_cache unpack "$archive" > /dev/null
done
warm() { timeout "${WARM_S:-200}" python -m benchmarks.fla_seed --warm "$@" "${extra[@]}" >> "$out/warm.log" 2>&1; }
for m in "${mixers[@]}"; do
  for s in vision lm; do
    for ((i = 0; i < shards; i++)); do warm fla --mixers "$m" --shapes "$s" --shard "$i/$shards" & done
  done
  warm ours --mixers "$m" &
done
wait
echo "gpu $gpu (${mixers[*]}): compiled in $((SECONDS - t0)) s" | tee -a "$out/warm.log"
python -m tools.triton_cache drop-autotune >> "$out/warm.log"
while [ -n "$GPU_FREE_FLAG" ] && [ ! -e "$GPU_FREE_FLAG" ]; do sleep 1; done
echo "gpu $gpu: measuring from $((SECONDS - t0)) s" >> "$out/warm.log"
timeout "${SEED_S:-300}" python -m benchmarks.fla_seed --autotune-rep-ms 20 --mixers "${mixers[@]}" --out "$out" \
  "${extra[@]}" 2>&1 | grep -v -i "warn\|If you want\|return fn" > "$out/fla_seed.txt"
echo "gpu $gpu (${mixers[*]}): measured at $((SECONDS - t0)) s" | tee -a "$out/warm.log"
