# Device call (H100, one call, < 360 s): fast-forgetting gates on the chunk64 family with the diagonal
# blocks by levels (kernels/generalized/diag_levels.py; F1's _diag_levels, B2's S2b and S5b; issue 11 part 5),
# single-direction and bidirectional (both scans in one launch, kernels/README.md §9).
# Usage on the device, repository root:
#   bash tools/device_fast_gates.sh
# Writes under $OUT (packed into results.tgz at the end):
#   kernels/kernels.json, kernels.txt   chunk_hdla fwd and fwd+bwd at the vision, high-res and LM shapes with mild
#                                       gates and with log lambda = -20 on every eighth channel (fast), one
#                                       process, alone on the GPU: the issue's target is fast <= 1.2x mild
#   bwd.json / bwd.txt                  B1, B2 and B2's launches (torch.profiler: S2, S2b, S5a, S5b, ...) for HDLA
#                                       at the vision and LM shapes, C = 32, gates mild / every8 (the same fast
#                                       gates) / fast (uniform in [-20, 0] everywhere)
#   parity.json / parity.txt            bf16 (and one fp32) forward o, final state and every gradient against
#                                       float64 (tests.gpu_bwd_sweep, T = 300): -20 on every eighth channel (HDLA
#                                       K 64, K 128 reversed, rank 1 K 128), -35 with resets (rank 2, reversed),
#                                       uniform [-20, 0] (HDLA, reversed); < 5e-3 and no NaN
#   bidir_parity/bidirectional_parity_<case>.json, bidir_parity_<case>.txt
#                                       the bidirectional op in bf16 (fp32 gates) against the float64 loops
#                                       (benchmarks.bidirectional, B 2, T 300, H 2, K = V = 64): -20 on every
#                                       eighth channel in both directions, HDLA and rank 1 with k, a stacked;
#                                       y, both final states and every gradient, fused=True: the fused path ran
#   bidir_warmup/, bidir_warmup.txt     first-call seconds of the bidirectional timing runs (compilation)
#   bidir_timing.json, bidir_timing.txt the fused bidirectional HDLA op, fwd and fwd+bwd ms, mild gates against
#                                       -20 on every eighth channel at vision (128,196,3,64) and high-res
#                                       (8,4096,3,64), and the ratio every8 / mild
#   timeline.txt                        start / end of each part
# The single-direction timings run first, one after the other, alone on the GPU; then the parity cases and
# the bidirectional warm-up side by side (compilation, untimed); the bidirectional timing last, alone.
source tools/device_setup.sh
stamp "start"
HDLA_VISION_KERNELS=chunk64 timeout 120 python3 -m benchmarks.kernels --ops ours --shapes vision,hires,lm --no-check \
  --fast-gates vision,hires,lm --out "$OUT/kernels" > "$OUT/kernels.txt" 2>&1
stamp "kernels done (rc $?)"
timeout 60 python3 -m benchmarks.kernel_stages_bwd --shapes vision,lm --kinds hdla --chunks 32 --gates mild,every8,fast \
  --profile --timing-only --out "$OUT/bwd.json" > "$OUT/bwd.txt" 2>&1
stamp "bwd done (rc $?)"
pids=()
timeout 120 python3 -m tests.gpu_bwd_sweep "$OUT/parity.json" --cases \
  hdla_k64_every8_m20,hdla_k128_every8_m20_rev,rab1_k128_every8_m20,rab2_k64_every8_m35_resets_rev,hdla_k64_gates20_rev,hdla_k64_every8_m20_fp32 \
  > "$OUT/parity.txt" 2>&1 &
pids+=($!)
mkdir -p "$OUT/bidir_parity" "$OUT/bidir_warmup"
for case in hdla_every8_m20 rab1_every8_m20_stacked_ka; do
  HDLA_VISION_KERNELS=chunk64 timeout 120 python3 -m benchmarks.bidirectional --part parity --cases "$case" \
    --out "$OUT/bidir_parity" > "$OUT/bidir_parity_$case.txt" 2>&1 &
  pids+=($!)
done
HDLA_VISION_KERNELS=chunk64 timeout 120 python3 -m benchmarks.bidirectional --part warmup --shapes vision,hires \
  --gates mild,every8 --variants fused --out "$OUT/bidir_warmup" > "$OUT/bidir_warmup.txt" 2>&1 &
pids+=($!)
for pid in "${pids[@]}"; do wait "$pid"; done
stamp "parity and bidirectional warm-up done"
HDLA_VISION_KERNELS=chunk64 timeout 45 python3 -m benchmarks.bidirectional --part timing --shapes vision,hires \
  --gates mild,every8 --variants fused --out "$OUT" > "$OUT/bidir_timing.txt" 2>&1
rc=$?
mv "$OUT/bidirectional_timing.json" "$OUT/bidir_timing.json" 2>/dev/null
stamp "bidirectional timing done (rc $rc)"
stamp "end"
cat "$OUT/timeline.txt"
python3 - "$OUT" <<'EOF'
import json
import os
import sys

out = sys.argv[1]
path = os.path.join(out, "kernels", "kernels.json")
if os.path.exists(path):
    t = json.load(open(path))["timings_ms"]
    for shape in ("vision", "hires", "lm"):
        mild, fast = t.get(f"{shape}/ours"), t.get(f"{shape}/ours_fast_gates")
        if mild and fast:
            print(f"{shape:6s} mild fwd {mild['fwd']:.3f} fwd+bwd {mild['fwd_bwd']:.3f} ms | fast fwd {fast['fwd']:.3f} "
                  f"fwd+bwd {fast['fwd_bwd']:.3f} ms | fast/mild fwd {fast['fwd'] / mild['fwd']:.2f} "
                  f"fwd+bwd {fast['fwd_bwd'] / mild['fwd_bwd']:.2f}")
path = os.path.join(out, "bwd.json")
if os.path.exists(path):
    for run in json.load(open(path))["runs"]:
        if "error" in run:
            print(run["shape"], run["kind"], run["gates"], "ERROR", run["error"][-300:])
            continue
        launches = {k.split("_kernel")[0].lstrip("_"): round(v[0], 1) for k, v in run.get("b2_launches_us", {}).items()
                    if "gram" in k}
        print(f"{run['shape']:6s} {run['kind']:4s} gates={run['gates']:6s} B1 {run['b1_ms']:.3f} B2 {run['b2_ms']:.3f} ms "
              f"B1+B2 {run['b1_plus_b2_ms']:.3f} ms  gram launches us {launches}")
EOF
cut -c1-400 "$OUT/parity.txt"
for f in "$OUT"/bidir_parity_*.txt; do cut -c1-420 "$f" | grep -v "^wrote" | tail -n 3; done
tail -n 4 "$OUT/bidir_warmup.txt"
grep -v "^wrote" "$OUT/bidir_timing.txt" | tail -n 6
cd "$OUT" && tar czf results.tgz --remove-files ./*
