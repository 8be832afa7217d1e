#!/bin/bash
# One device call: the full kernel benchmark (ours, SDPA, fla DPLR over 2T, fla chunk_kda at the
# vision, high-res and LM shapes, in one process), after fla's kernels are compiled in parallel
# (compile_fla.sh). Our kernels are not pre-compiled, so their time to first result is measured
# cold. Ran at 95c1933 (benchmarks/results/kernels_all_baselines_h100.json); that run also
# started the seed-mixer comparison, which fla_seed_only.sh now does alone.
#   bash tools/runs/kernels_all_baselines.sh      (on the device; results under $OUT)
source tools/runs/compile_fla.sh
timeout "${KERNELS_S:-270}" python -m benchmarks.kernels --ops ours,sdpa,fla_dplr,fla_kda --check-fla \
  --autotune-rep-ms 20 2>&1 | tee "$OUT/kernels.txt"
echo "kernel benchmark done at $((SECONDS - t0)) s"
timeout 40 python -m tools.triton_cache pack "$OUT/fla_triton_cache.tar.xz"
