#!/bin/bash
# One device call: the seed-mixer parity/timing against fla only, mixers whose fla kernels compile
# fastest first (fla_seed.py writes its JSON after each mixer), fla's cache packed at the end.
#   bash benchmarks/runs/fla_seed_only.sh      (on the device; results under $OUT)
source benchmarks/device_setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$OUT"
t0=$SECONDS
ls fla_cache/*.tar.xz >/dev/null 2>&1 && python benchmarks/triton_cache.py unpack fla_cache/fla_triton_cache.tar.xz
warm() { timeout "${WARM_S:-180}" python -m benchmarks.fla_seed --warm "$@" >> "/tmp/warm_$$_$RANDOM.log" 2>&1; }
for m in gla kda; do
  for s in vision lm; do
    for i in 0 1 2; do warm fla --mixers $m --shapes $s --shard $i/3 & done
  done
done
for m in deltanet gated_deltanet rwkv7 gated_deltaproduct_2 gated_deltaproduct_3; do
  for s in vision lm; do warm fla --mixers $m --shapes $s & done
done
for m in deltanet gated_deltanet rwkv7 gated_deltaproduct_2 gated_deltaproduct_3 kda gla; do
  warm ours --mixers $m &
done
wait
echo "parallel compile done at $((SECONDS - t0)) s"
python benchmarks/triton_cache.py drop-autotune
timeout "${SEED_S:-240}" python -m benchmarks.fla_seed --autotune-rep-ms 20 --mixers deltanet gated_deltanet \
  gated_deltaproduct_2 rwkv7 kda gla gated_deltaproduct_3 2>&1 | grep -v -i "warn\|If you want\|return fn" | tee "$OUT/fla_seed.txt"
echo "seed mixers done at $((SECONDS - t0)) s"
timeout 40 python benchmarks/triton_cache.py pack "$OUT/fla_triton_cache.tar.xz"
