#!/bin/bash
# One device call: profile our kernels, run the GPU tests, and fill Triton's cache with fla's
# kernels (compiled in parallel processes, then autotuned again in one quiet process so the
# choices are not skewed by the others); packs fla's cache entries for later calls.
#   bash benchmarks/runs/fla_warm_and_profile.sh      (on the device; results under $OUT)
source benchmarks/device_setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$OUT"
t0=$SECONDS
python -m benchmarks.kernels --ops ours --profile vision,hires,lm --out /tmp/prof > "$OUT/profile.txt" 2>&1
echo "profile done at $((SECONDS - t0)) s"
for m in gla deltanet gated_deltanet kda rwkv7 gated_deltaproduct_2 gated_deltaproduct_3; do
  for s in vision lm; do
    timeout "${WARM_S:-270}" python -m benchmarks.fla_seed --warm fla --mixers "$m" --shapes "$s" > "/tmp/warm_${m}_$s.log" 2>&1 &
  done
done
for s in vision lm; do  # DPLR over 2T with bf16 gates: its own autotune keys
  timeout "${WARM_S:-270}" python -m benchmarks.kernels --ops fla_dplr --shapes "$s" --out "/tmp/k_$s" > "/tmp/warm_dplr2t_$s.log" 2>&1 &
done
timeout "${WARM_S:-270}" python -m pytest -q -m gpu -rf -p no:cacheprovider tests/ > "$OUT/pytest_gpu.txt" 2>&1 &
timeout "${WARM_S:-270}" python benchmarks/seed_parity.py gdp3_tiny hihdn_tiny hihgdn_tiny hdla_tiny > /tmp/seed_parity.log 2>&1 &
wait
echo "parallel phase done at $((SECONDS - t0)) s"
tail -n 3 /tmp/warm_*.log /tmp/seed_parity.log > "$OUT/warm.txt"
python benchmarks/triton_cache.py drop-autotune
timeout "${TUNE_S:-150}" python -m benchmarks.fla_seed --warm fla >> "$OUT/warm.txt" 2>&1
timeout 90 python -m benchmarks.kernels --ops fla_dplr,fla_kda --shapes vision,lm --out /tmp/k >> "$OUT/warm.txt" 2>&1
echo "quiet autotune done at $((SECONDS - t0)) s"
python benchmarks/triton_cache.py pack "$OUT/fla_triton_cache.tar.xz"
ls /tmp/tcache | wc -l
