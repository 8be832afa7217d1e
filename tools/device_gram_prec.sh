# Device call (H100, <= 330 s): B2's factored diagonal Gram blocks with tf32x3 operands (the default since
# bf16 operands left dg 1e-2 to 2.4e-2 off float64 at mild gates): bf16 parity of every gradient, then B2
# timings (vision, hires, lm; HDLA and rank 1; mild gates) and, at the vision shape, the same with bf16
# operands (HDLA_VISION_DIAG_PRECISION=bf16) for the cost of the precision.
# Writes parity.json / parity.txt, kernel_stages_bwd.json / timing.txt, bf16_vision.json / bf16_vision.txt,
# timeline.txt under $OUT.
source tools/device_setup.sh
stamp "start"
timeout 150 python3 -m tests.gpu_bwd_sweep "$OUT/parity.json" --cases \
  hdla_k64_mild,hdla_k128_mild_fast_channel,rab2_k64_mild_fast_channel_rev,hdla_k128_v128,hdla_k64_gates20_rev,rab2_rkv2_scalar_k64,hdla_k64_fp32 \
  > "$OUT/parity.txt" 2>&1
stamp "parity done (rc $?)"
timeout 110 python3 -m benchmarks.kernel_stages_bwd --shapes vision,lm,hires --kinds hdla,rab1 --gates mild \
  --diag-limits default --profile --out "$OUT/kernel_stages_bwd.json" > "$OUT/timing.txt" 2>&1
stamp "timing done (rc $?)"
HDLA_VISION_DIAG_PRECISION=bf16 timeout 40 python3 -m benchmarks.kernel_stages_bwd --shapes vision --kinds hdla \
  --gates mild --diag-limits default --profile --out "$OUT/bf16_vision.json" > "$OUT/bf16_vision.txt" 2>&1
stamp "bf16 vision done (rc $?)"
cat "$OUT/timeline.txt"
cut -c1-400 "$OUT/parity.txt"
for f in "$OUT/kernel_stages_bwd.json" "$OUT/bf16_vision.json"; do
[ -f "$f" ] && python3 - "$f" <<'PY'
import json
import sys

for run in json.load(open(sys.argv[1]))["runs"]:
    if "error" in run:
        print(run["shape"], run["kind"], "ERROR", run["error"][-300:])
        continue
    launches = {k.split("_kernel")[0].lstrip("_"): round(v[0]) for k, v in run.get("b2_launches_us", {}).items()}
    print(f"{run['shape']:6s} {run['kind']:4s} B2 {run['b2_ms']:.3f} ms  B1+B2 {run['b1_plus_b2_ms']:.3f} ms  us {launches}")
PY
done
