#!/bin/bash
# One device call after the M-chunk serial kernel landed: its GPU tests, our op with M = 1 and 4
# against fla DPLR over 2T and fla chunk_kda at the long shapes (one process), and the seed-mixer
# parity/timing against fla. fla is compiled first in parallel (as in kernels_all_baselines.sh).
#   bash benchmarks/runs/scan_chunks_and_seeds.sh      (on the device; results under $OUT)
# Ran once at ca54516, with the M-chunk kernel of branch merge64 (--scan-chunks exists there only).
source benchmarks/device_setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$OUT"
t0=$SECONDS
ls fla_cache/*.tar.xz >/dev/null 2>&1 && python benchmarks/triton_cache.py unpack fla_cache/fla_triton_cache.tar.xz
warm() { timeout "${WARM_S:-150}" python -m benchmarks.fla_seed --warm "$@" >> "/tmp/warm_$$_$RANDOM.log" 2>&1; }
for m in gla kda; do
  for s in vision lm; do
    for i in 0 1 2; do warm fla --mixers $m --shapes $s --shard $i/3 & done
  done
done
for m in deltanet gated_deltanet rwkv7 gated_deltaproduct_2 gated_deltaproduct_3; do
  warm fla --mixers $m &
done
TRITON_CACHE_DIR=/tmp/tcache_tests timeout "${WARM_S:-150}" python -m pytest -q -rf -p no:cacheprovider \
  --durations=5 tests/test_gpu_kernels.py > "$OUT/pytest_gpu_kernels.txt" 2>&1 &
wait
echo "parallel phase done at $((SECONDS - t0)) s"
python benchmarks/triton_cache.py drop-autotune
timeout "${KERNELS_S:-170}" python -m benchmarks.kernels --ops ours,fla_dplr,fla_kda --shapes hires,lm \
  --scan-chunks 1,4 --autotune-rep-ms 20 2>&1 | tee "$OUT/kernels.txt"
echo "kernel benchmark done at $((SECONDS - t0)) s"
timeout "${SEED_S:-200}" python -m benchmarks.fla_seed --autotune-rep-ms 20 2>&1 | grep -v -i "warn\|If you want\|return fn" | tee "$OUT/fla_seed.txt"
echo "seed mixers done at $((SECONDS - t0)) s"
