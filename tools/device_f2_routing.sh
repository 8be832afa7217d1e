#!/bin/bash
# Device call (one H100 or H200, < 560 s), 2026-11-28 third session:
#   1. hdla_tiny's training step at 512 px, the recurrence's training limit at 512 (now) against 1024 (before)
#      tokens, alternating in one process (benchmarks.launch_configs --models-ab)
#   2. F2's state columns per program (fwd.f2_block_v: 16 at the LM and high-res shapes) at 32 / 64 / 128
# Usage on the device, repository root, carrying .whl:  COMMIT=<sha> bash tools/device_f2_routing.sh
# Writes under $OUT: summary.txt, timeline.txt and results.tgz (models_ab.json, f2_bv.json and their stdout)
source tools/device_setup.sh
stamp "start ${COMMIT:-?}"
timeout 230 python3 -m benchmarks.launch_configs --models-ab hdla_tiny --resolutions 512 \
  --variants base recurrence_train_1024 --rounds 2 --rep-ms 150 --out "$OUT/models_ab.json" > "$OUT/models_ab.txt" 2>&1
stamp "models A/B done (rc $?)"
timeout 250 python3 -m benchmarks.launch_configs --shapes lm hires b1024 --variants base f2_bv32 f2_bv64 f2_bv128 \
  --rep-ms 100 --out "$OUT/f2_bv.json" > "$OUT/f2_bv.txt" 2>&1
stamp "F2 variants done (rc $?)"
{ cat "$OUT/timeline.txt"; python3 - "$OUT/models_ab.json" "$OUT/f2_bv.json" <<'PY'
import json, os, sys
for path in sys.argv[1:]:
    if not os.path.exists(path):
        print("missing", path)
        continue
    for r in json.load(open(path))["rows"]:
        if "error" in r:
            print(r)
        elif "step_ms" in r:
            print(r["variant"], r["round"], r["resolution"], round(r["step_ms"], 2), "ms", round(r["images_per_s"], 1),
                  "img/s", round(r["peak_mem_mib"]), "MiB")
        else:
            state = {k: round(v[0] if isinstance(v, list) else v, 1) for k, v in r["kernels_us"].items()
                     if "state" in k or "group" in k}
            print(r["shape"], r["variant"], round(r["fwd_bwd_ms"], 3), "ms", "rel %.1e" % r["max_rel_vs_base"],
                  r["peak_mib"], "MiB", state)
PY
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
