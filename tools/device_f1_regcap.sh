#!/bin/bash
# Device call (one H100 or H200, < 300 s): F1ab (`chunk_intra_kernel`) with its registers capped (ptxas .maxnreg via
# fwd.launch_register_cap): 128 at 8 warps (two blocks per SM; 1368 / 848 bytes of spills at the LM / high-res shape
# on sm_90a) and 168 at 4 warps (three), against the defaults (255 registers, one block per SM at the LM shape;
# benchmarks/results/ncu_h200/), at the LM, high-res and 1024 px shapes. Outputs must match the defaults to bf16
# rounding (max_rel_vs_base).
# Usage on the device, repository root, carrying .whl:  COMMIT=<sha> bash tools/device_f1_regcap.sh
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 250 python3 -m benchmarks.launch_configs --shapes lm hires b1024 --variants base f1ab_reg128 f1ab_reg168_w4 \
  --rep-ms 100 --out "$OUT/f1_regcap.json" > "$OUT/f1_regcap.txt" 2>&1
stamp "variants done (rc $?)"
{ cat "$OUT/timeline.txt"; python3 - "$OUT/f1_regcap.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if "error" in r:
        print(r)
        continue
    f1 = r["kernels_us"].get("chunk_intra_kernel", [float("nan")])[0]
    print(r["shape"], r["variant"], round(r["fwd_bwd_ms"], 3), "ms", "rel %.1e" % r["max_rel_vs_base"],
          "chunk_intra_kernel %.1f us" % f1)
PY
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
