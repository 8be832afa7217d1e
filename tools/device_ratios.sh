#!/bin/bash
# Device call (one H100 or H200, < 560 s): issue 11's ratios in one process, and F1 / B2 variants at the LM shape.
#   1. benchmarks.kernels --ops ours,fla_kda,sdpa at the vision, high-res and LM shapes (fla carried as a wheel:
#      fla_core + einops in .whl, beside timm; tools/device_setup.sh installs them)
#   2. benchmarks.launch_configs at the LM shape: $VARIANTS (default: base f1_gram stacks16), per kernel
# Usage on the device, repository root:  bash tools/device_ratios.sh
# Writes under $OUT: summary.txt, timeline.txt and results.tgz (kernels.json / .txt, variants.json / .txt)
source tools/device_setup.sh
stamp "start"
timeout 300 python3 -m benchmarks.kernels --ops ours,fla_kda,sdpa --shapes vision,hires,lm --fast-gates "" --no-check \
  --autotune-rep-ms 20 --out "$OUT" > "$OUT/kernels.txt" 2>&1
stamp "kernels done (rc $?)"
timeout 220 python3 -m benchmarks.launch_configs --shapes lm --variants ${VARIANTS:-base f1_gram stacks16} \
  --rep-ms 100 --out "$OUT/variants.json" > "$OUT/variants.txt" 2>&1
stamp "variants done (rc $?)"
{
  cat "$OUT/timeline.txt"
  grep -E "fwd\+bwd" "$OUT/kernels.txt"
  python3 - "$OUT/variants.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001  a cut-off run: say so, print nothing else
    print("variants.json:", e); sys.exit()
rows = rows.get("rows", rows) if isinstance(rows, dict) else rows
for r in rows:
    if not isinstance(r, dict) or "fwd_bwd_ms" not in r:
        continue
    print(r["shape"], r["variant"], "fwd+bwd %.3f ms" % r["fwd_bwd_ms"], "peak", r.get("peak_mib"),
          "rel %.1e" % r.get("max_rel_vs_base", 0))
    us_of = lambda v: v if isinstance(v, (int, float)) else v[0]  # noqa: E731
    for name, us in sorted(r.get("kernels_us", {}).items(), key=lambda kv: -us_of(kv[1]))[:12]:
        print("    %-40s %8.1f" % (name[:40], us_of(us)))
PY
  grep '"fwd_bwd_ms"' "$OUT/variants.txt" | sed 's/"b2_slices[^]]*]]*, //' | cut -c1-300
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
