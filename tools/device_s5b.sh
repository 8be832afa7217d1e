#!/bin/bash
# Device call (one H100 or H200, < 560 s) after S5b's one-load flag check (2026-11-28):
#   1. bf16 parity of the fast-gate cases that send blocks to S2b / S5b (every rank, K 32-256, reversed, resets,
#      fp32) and of the bidirectional op with -20 on every eighth channel
#   2. benchmarks.launch_configs at the LM, 1024 px batch and high-res shapes: base (S5b's new check) against
#      B2's scratch budget (budget_0: one launch, budget_2048), F2's / B1's two-level scan on 8 groups, B1 at BV 16
#   3. fla's chunk_kda and ours at the LM shape in one process (fla's autotuning takes minutes there)
# Usage on the device, repository root, carrying .whl (timm 1.0.31, fla_core 0.6.0, einops):  bash tools/device_s5b.sh
# Writes under $OUT: summary.txt, timeline.txt and results.tgz (parity.json / .txt, bidir.txt and its JSON,
# variants.json / .txt, kernels.json / .txt)
source tools/device_setup.sh
stamp "start"
cases=hdla_k64_gates20_rev,hdla_k128_gates20_rev,hdla_k128_mild_fast_channel,rab2_k64_mild_fast_channel_rev,\
hdla_k64_every8_m20,hdla_k128_every8_m20_rev,rab1_k128_every8_m20,rab2_k64_every8_m35_resets_rev,\
hdla_k64_every8_m20_fp32,rab0_k64_v64,rab4_k32_v32,hdla_k256_v64
timeout 150 python3 -m tests.gpu_bwd_sweep "$OUT/parity.json" --cases "$cases" > "$OUT/parity.txt" 2>&1
stamp "parity done (rc $?)"
HDLA_VISION_KERNELS=chunk64 timeout 60 python3 -m benchmarks.bidirectional --part parity --cases hdla_every8_m20 \
  --out "$OUT" > "$OUT/bidir.txt" 2>&1
stamp "bidirectional parity done (rc $?)"
timeout 200 python3 -m benchmarks.launch_configs --shapes lm b1024 hires \
  --variants ${VARIANTS:-base budget_0 budget_2048 groups8 b1_bv16} --rep-ms 100 --out "$OUT/variants.json" \
  > "$OUT/variants.txt" 2>&1
stamp "variants done (rc $?)"
timeout 240 python3 -m benchmarks.kernels --ops ours,fla_kda --shapes lm --fast-gates "" --no-check \
  --autotune-rep-ms 10 --out "$OUT" > "$OUT/kernels.txt" 2>&1
stamp "kernels done (rc $?)"
{
  cat "$OUT/timeline.txt"
  grep -h "^ok\|^FAIL" "$OUT/parity.txt" | cut -c1-150
  grep -h "worst" "$OUT/bidir.txt"
  grep -E "fwd\+bwd" "$OUT/kernels.txt"
  python3 - "$OUT/variants.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as e:  # noqa: BLE001  a cut-off run
    print("variants.json:", e); sys.exit()
us = lambda v: v if isinstance(v, (int, float)) else v[0]  # noqa: E731
for r in rows:
    if "fwd_bwd_ms" not in r:
        print(r); continue
    k = r.get("kernels_us", {})
    pick = {n: round(us(k[n])) for n in ("_gram_vjp_levels_kernel", "_bwd_state_kernel", "chunk_state_kernel") if n in k}
    print(r["shape"], r["variant"], "%.3f ms" % r["fwd_bwd_ms"], "peak", r["peak_mib"], "slices", r["b2_slices"],
          "kernels %.0f us" % sum(us(v) for v in k.values()), pick, "rel %.1e" % r["max_rel_vs_base"])
PY
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack
