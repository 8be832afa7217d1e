# Sourced by the device run scripts: installs the checkout, unpacks the fla cache carried in
# fla_cache/ (if any), then compiles fla's kernels for every seed mixer at the vision and LM head
# sizes in parallel processes (GLA and KDA, the slowest, as three shards of each autotune space),
# plus ours for the mixers named in $WARM_OURS, and forgets the processes' autotune choices so the
# measuring process autotunes alone on the GPU (on cached binaries).
source tools/device_setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$OUT"
t0=$SECONDS
ls fla_cache/*.tar.xz >/dev/null 2>&1 && python -m tools.triton_cache unpack fla_cache/fla_triton_cache.tar.xz
warm() { timeout "${WARM_S:-180}" python -m benchmarks.fla_seed --warm "$@" >> "/tmp/warm_$$_$RANDOM.log" 2>&1; }
for m in gla kda; do
  for s in vision lm; do
    for i in 0 1 2; do warm fla --mixers $m --shapes $s --shard $i/3 & done
  done
done
for m in deltanet gated_deltanet rwkv7 gated_deltaproduct_2 gated_deltaproduct_3; do
  for s in vision lm; do warm fla --mixers $m --shapes $s & done
done
for m in $WARM_OURS; do warm ours --mixers "$m" & done
wait
echo "parallel compile done at $((SECONDS - t0)) s"
python -m tools.triton_cache drop-autotune
