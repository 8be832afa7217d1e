#!/bin/bash
# One device call: fla parity and timing for the seed mixers (benchmarks/fla_seed.py). Unpacks the
# fla cache of an earlier call (fla_cache/, carried), compiles what is missing in parallel
# processes, autotunes again in one quiet process, measures, and packs the grown cache.
#   bash benchmarks/runs/fla_seed_run.sh      (on the device; results under $OUT)
source benchmarks/device_setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$OUT"
t0=$SECONDS
ls fla_cache/*.tar.xz >/dev/null 2>&1 && python benchmarks/triton_cache.py unpack fla_cache/fla_triton_cache.tar.xz
for m in gla deltanet gated_deltanet kda rwkv7 gated_deltaproduct_2 gated_deltaproduct_3; do
  for s in vision lm; do
    timeout "${WARM_S:-250}" python -m benchmarks.fla_seed --warm fla --mixers "$m" --shapes "$s" > "/tmp/warm_${m}_$s.log" 2>&1 &
  done
  timeout "${WARM_S:-250}" python -m benchmarks.fla_seed --warm ours --mixers "$m" > "/tmp/warm_ours_$m.log" 2>&1 &
done
wait
echo "parallel compile done at $((SECONDS - t0)) s"
tail -n 3 /tmp/warm_*.log > "$OUT/warm.txt"
python benchmarks/triton_cache.py drop-autotune
timeout "${TUNE_S:-100}" python -m benchmarks.fla_seed --warm fla >> "$OUT/warm.txt" 2>&1
echo "quiet autotune done at $((SECONDS - t0)) s"
timeout "${RUN_S:-200}" python -m benchmarks.fla_seed 2>&1 | tee "$OUT/fla_seed.txt"
echo "parity and timing done at $((SECONDS - t0)) s"
python benchmarks/triton_cache.py pack "$OUT/fla_triton_cache.tar.xz"
