#!/bin/bash
# Device call (one H100 or H200, < 450 s) after tools/device_ncu.sh's profile at the LM shape (2026-11-28,
# benchmarks/results/ncu_h200/): F1c (`chunk_nc_kernel`, 142 registers x 8 warps: one block per SM) and F2
# (`chunk_state_kernel`, 98 x 8 warps: two) are held to 12.5-25% occupancy by registers; B1 runs 64 programs per
# batch slice at the LM shape. Times their warps (F1c 4, F2 4) and B1 on 16 V columns, against the defaults.
# Usage on the device, repository root, carrying .whl:  COMMIT=<sha> bash tools/device_occupancy.sh
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 330 python3 -m benchmarks.launch_configs --shapes lm hires b1024 --variants base f1c_w4 f2_w4 b1_bv16 \
  --rep-ms 100 --out "$OUT/occupancy.json" > "$OUT/occupancy.txt" 2>&1
stamp "variants done (rc $?)"
{ cat "$OUT/timeline.txt"; python3 - "$OUT/occupancy.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if "error" in r:
        print(r)
        continue
    k = r["kernels_us"]
    pick = {n: round(k[n][0], 1) for n in ("chunk_nc_kernel", "chunk_state_kernel", "_bwd_state_kernel",
                                           "chunk_intra_kernel") if n in k}
    print(r["shape"], r["variant"], round(r["fwd_bwd_ms"], 3), "ms", "rel %.1e" % r["max_rel_vs_base"],
          r["peak_mib"], "MiB", "kernel sum %.1f us" % sum(v[0] for v in k.values()), pick)
PY
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
