#!/bin/bash
# Device call (one H100 or H200, < 500 s): where the time goes now that S4's products are grouped (f07b23b):
# chunk_hdla against fla's KDA and SDPA at the vision, high-res, LM and 2048 px shapes (benchmarks.kernels, with the
# per-kernel profile at long and lm), one hdla_tiny block at 2048 px / batch 2 (host time against device time,
# cProfile's top rows), and log-linear's CUDA tests through F2's chains (-k chains; the full file runs past 120 s).
# Usage on the device, repository root, carrying .whl:   COMMIT=<sha> bash tools/device_where_now.sh
# Writes under $OUT: summary.txt, timeline.txt, results.tgz (kernels/, host.txt, chains_tests.txt).
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
mkdir -p "$OUT/kernels"
timeout 170 python3 -m benchmarks.kernels --ops ours,fla_kda,sdpa --shapes vision,hires,lm,long --no-check \
  --profile long,lm --out "$OUT/kernels" > "$OUT/kernels.txt" 2>&1
stamp "kernels done (rc $?)"
timeout 110 python3 -m benchmarks.host_profile --model hdla_tiny --res 2048 --batch 2 --rows 30 > "$OUT/host.txt" 2>&1
stamp "host profile done (rc $?)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_chunk_loglinear.py -k chains \
  > "$OUT/chains_tests.txt" 2>&1
stamp "chains tests done (rc $?)"
{ cat "$OUT/timeline.txt"; grep -v "^ " "$OUT/kernels.txt" | tail -n 30
  grep -E "host .* ms|do_bench|synchronis" "$OUT/host.txt"; tail -n 3 "$OUT/chains_tests.txt"; } > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
