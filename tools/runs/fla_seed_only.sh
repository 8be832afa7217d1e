#!/bin/bash
# One device call: the seed-mixer parity/timing against fla (benchmarks/fla_seed.py), mixers whose
# fla kernels compile fastest first (the JSON is written after each mixer), fla's cache packed at
# the end for the next call. Ran at d851fe6 (benchmarks/results/fla_seed_h100.json).
#   bash tools/runs/fla_seed_only.sh      (on the device; results under $OUT)
WARM_OURS="deltanet gated_deltanet rwkv7 gated_deltaproduct_2 gated_deltaproduct_3 kda gla"
source tools/runs/compile_fla.sh
timeout "${SEED_S:-240}" python -m benchmarks.fla_seed --autotune-rep-ms 20 --mixers deltanet gated_deltanet \
  gated_deltaproduct_2 rwkv7 kda gla gated_deltaproduct_3 2>&1 | grep -v -i "warn\|If you want\|return fn" | tee "$OUT/fla_seed.txt"
echo "seed mixers done at $((SECONDS - t0)) s"
timeout 40 python -m tools.triton_cache pack "$OUT/fla_triton_cache.tar.xz"
