# Device call (H100, <= 300 s): B2 with its operand-only scratch in 16 bits and S4 reading 16-bit copies of T
# and At (bwd_chunk.scratch_dtypes, the default, with S4 at 2 pipeline stages) against all scratch fp32 (main's
# B2: S4 at 3 stages) (issue 11: S4's products were memory-bound on fp32 tiles). The copies' cost shows in
# _stacks_kernel and _inverse_kernel of the --profile breakdown, their saving in _gemm_kernel.
# Usage on the device, repository root:  bash tools/device_b2_scratch.sh
# Writes under $OUT:
#   parity.json / parity.txt   bf16 backward parity against float64 (tests.gpu_bwd_sweep, 5 cases; rank 0
#                              is the case where M_QK is 16-bit), in the background while the timings run
#   b2_scratch.json / timing.txt
#                              B1, B2 at the vision, LM and high-res shapes (HDLA, rank 1; C = 32), each with
#                              scratch lowp and fp32, B2's launches (--profile), and every gradient of the two
#                              modes compared bit for bit on the GPU (lowp_scratch_equal)
#   stages3.json / stages3.txt lowp scratch with S4 at 3 stages (HDLA_VISION_B2_GEMM_STAGES=3), vision and LM:
#                              how much of the change is the stage count
#   gla.json / gla.txt         rank 0 (GLA-like) at the vision shape, both modes, bit for bit
#   timeline.txt
source tools/device_setup.sh
stamp "start"
(timeout 270 nice -n 10 python3 -m tests.gpu_bwd_sweep "$OUT/parity.json" --cases \
   hdla_k64_mild,hdla_k64_gates20_rev,rab2_rkv2_scalar_k64,rab0_k64_v64,rab2_k64_mild_fast_channel_rev \
   > "$OUT/parity.txt" 2>&1; stamp "parity done (rc $?)") &
parity_pid=$!
# Every kernel variant timed below, compiled first by the AOT path in parallel processes (one per shape, kind,
# scratch mode and stage count: ints specialise by divisibility, so each shape compiles its own) into the
# shared on-disk Triton cache; one process compiling them in turn took ~35 s per configuration.
warm_pids=()
warm() {  # MODE STAGES KIND SHAPE
  HDLA_VISION_B2_SCRATCH=$1 HDLA_VISION_B2_GEMM_STAGES=$2 timeout 100 python3 -m benchmarks.kernel_stages_bwd --aot \
    --kinds "$3" --shapes "$4" --no-head-dims > /dev/null 2>&1 &
  warm_pids+=($!)
}
for shape in vision lm hires; do for kind in hdla rab1; do warm lowp "" $kind $shape; warm fp32 "" $kind $shape; done; done
for shape in vision lm; do for kind in hdla rab1; do warm lowp 3 $kind $shape; done; done
warm lowp "" gla vision; warm fp32 "" gla vision
wait "${warm_pids[@]}"
stamp "warm-up compiled"
timeout 120 python3 -m benchmarks.kernel_stages_bwd --shapes vision,lm,hires --kinds hdla,rab1 --chunks 32 \
  --scratch lowp,fp32 --timing-only --profile --out "$OUT/b2_scratch.json" > "$OUT/timing.txt" 2>&1
stamp "timing done (rc $?)"
HDLA_VISION_B2_GEMM_STAGES=3 timeout 35 python3 -m benchmarks.kernel_stages_bwd --shapes vision,lm --kinds hdla,rab1 \
  --chunks 32 --scratch lowp --timing-only --profile --out "$OUT/stages3.json" > "$OUT/stages3.txt" 2>&1
stamp "stages 3 done (rc $?)"
timeout 25 python3 -m benchmarks.kernel_stages_bwd --shapes vision --kinds gla --chunks 32 --scratch lowp,fp32 \
  --timing-only --out "$OUT/gla.json" > "$OUT/gla.txt" 2>&1
stamp "gla done (rc $?)"
wait "$parity_pid"
stamp "end"
cat "$OUT/timeline.txt"
cut -c1-400 "$OUT/parity.txt"
for f in "$OUT/b2_scratch.json" "$OUT/stages3.json" "$OUT/gla.json"; do
[ -f "$f" ] && python3 - "$f" <<'PY'
import json
import sys

runs = json.load(open(sys.argv[1]))["runs"]
for run in runs:
    if "error" in run:
        print(run["shape"], run["kind"], run["scratch"], "ERROR", run["error"][-300:])
        continue
    launches = {k.split("_kernel")[0].lstrip("_"): round(v[0]) for k, v in run.get("b2_launches_us", {}).items()}
    same = run.get("lowp_scratch_equal")
    same = "" if same is None else ("  bit-identical" if all(same.values()) else f"  DIFFERENT {same}")
    print(f"{run['shape']:6s} {run['kind']:4s} {run['scratch']:4s} B2 {run['b2_ms']:.3f} ms  "
          f"B1+B2 {run['b1_plus_b2_ms']:.3f} ms  us {launches}{same}")
by = {(r["shape"], r["kind"], r["scratch"]): r for r in runs if "error" not in r}
for (shape, kind, mode), run in by.items():
    ref = by.get((shape, kind, "fp32"))
    if mode == "lowp" and ref:
        gemm = [sum(v[0] for k, v in r.get("b2_launches_us", {}).items() if k.startswith("_gemm")) for r in (run, ref)]
        print(f"{shape:6s} {kind:4s} lowp / fp32: B2 {run['b2_ms']:.3f} / {ref['b2_ms']:.3f} ms "
              f"({run['b2_ms'] / max(ref['b2_ms'], 1e-9):.2f}x), gemm {gemm[0]:.0f} / {gemm[1]:.0f} us")
PY
done
