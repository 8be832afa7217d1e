#!/bin/bash
# One device call: the full kernel benchmark (ours, SDPA, fla DPLR over 2T, fla chunk_kda at the
# vision, high-res and LM shapes, in one process) and the seed-mixer parity/timing against fla.
# fla's kernels are compiled first in parallel processes (each trying a shard of every autotune
# space, into one Triton cache, on top of the cache carried in fla_cache/); the measuring
# processes then autotune on cached binaries alone on the GPU. Our kernels are not pre-compiled,
# so their time to first result is measured cold.
#   bash benchmarks/runs/kernels_all_baselines.sh      (on the device; results under $OUT)
source benchmarks/device_setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$OUT"
t0=$SECONDS
ls fla_cache/*.tar.xz >/dev/null 2>&1 && python benchmarks/triton_cache.py unpack fla_cache/fla_triton_cache.tar.xz
warm() { timeout "${WARM_S:-200}" python -m benchmarks.fla_seed --warm "$@" >> "/tmp/warm_$$_$RANDOM.log" 2>&1; }
for m in gla kda; do
  for s in vision lm; do
    for i in 0 1 2; do warm fla --mixers $m --shapes $s --shard $i/3 & done
  done
done
for m in deltanet gated_deltanet rwkv7 gated_deltaproduct_2 gated_deltaproduct_3; do
  warm fla --mixers $m &
done
wait
echo "parallel compile done at $((SECONDS - t0)) s"
python benchmarks/triton_cache.py drop-autotune
timeout "${KERNELS_S:-270}" python -m benchmarks.kernels --ops ours,sdpa,fla_dplr,fla_kda --check-fla \
  --autotune-rep-ms 20 2>&1 | tee "$OUT/kernels.txt"
echo "kernel benchmark done at $((SECONDS - t0)) s"
timeout "${SEED_S:-240}" python -m benchmarks.fla_seed --autotune-rep-ms 20 2>&1 | tee "$OUT/fla_seed.txt"
echo "seed mixers done at $((SECONDS - t0)) s"
