# Device call (H100, one call, <= 300 s): B2's diagonal Gram blocks as one factored tensor-core product per
# block with the token loop as the per-block fallback (kernels/generalized/bwd_chunk.py, kernels/README.md §8
# Numerics; issue 11 parts 5 and the B2 profile), timed against the token loop everywhere and checked in bf16.
# Usage on the device, repository root:
#   bash tools/device_gram_fast.sh
# Writes under $OUT:
#   parity.json / parity.txt          bf16 (and fp32) against float64 (tests.gpu_bwd_sweep --cases, T = 300):
#                                     HDLA mild (K 64) and gates to -20 reversed (K 64, 128), one fast channel
#                                     among mild ones (HDLA K 128, r_ab 2 K 64 reversed: both paths in one
#                                     chunk), a decay per head, fp32; every gradient < 5e-3, NaN fails
#   kernel_stages_bwd.json / timing.txt   B1, B2, B1+B2 (do_bench medians) and B2's launches (torch.profiler)
#                                     at vision, hires, lm for HDLA and r_ab = 1, with the default limit and
#                                     with the token loop forced (diag_limit 0), mild and fast gates, all in
#                                     one process; diag_paths (fraction of blocks that took the product) and
#                                     factored_vs_loop (each gradient's bf16 difference from the token loop's)
#   timeline.txt                      start / end of each part
# The timings run first, alone on the GPU (their compiles warm Triton's cache for the parity cases' bf16
# kernels), then the parity cases, six processes at a time. Both write their JSON after every case.
source tools/device_setup.sh
stamp "start"
timeout 170 python3 -m benchmarks.kernel_stages_bwd --shapes vision,hires,lm --kinds hdla,rab1 \
  --diag-limits default,0 --gates mild,fast --profile --out "$OUT/kernel_stages_bwd.json" > "$OUT/timing.txt" 2>&1
stamp "timing done (rc $?)"
timeout 100 python3 -m tests.gpu_bwd_sweep "$OUT/parity.json" --cases \
  hdla_k64_mild,hdla_k64_gates20_rev,hdla_k128_gates20_rev,hdla_k128_mild_fast_channel,rab2_k64_mild_fast_channel_rev,rab2_rkv2_scalar_k64,hdla_k128_v128,hdla_k64_fp32 \
  > "$OUT/parity.txt" 2>&1
stamp "parity done (rc $?)"
stamp "end"
cat "$OUT/timeline.txt"
cat "$OUT/parity.txt" | cut -c1-400
[ -f "$OUT/kernel_stages_bwd.json" ] && python3 - "$OUT/kernel_stages_bwd.json" <<'EOF'
import json
import sys

for run in json.load(open(sys.argv[1]))["runs"]:
    if "error" in run:
        print(run["shape"], run["kind"], run["gates"], run["diag_limit"], "ERROR", run["error"][-300:])
        continue
    launches = {k.split("_kernel")[0].lstrip("_"): v[0] for k, v in run.get("b2_launches_us", {}).items()}
    gram = {k: launches.get(k) for k in ("gram", "gram_vjp", "vjp", "gemm")}
    print(f"{run['shape']:6s} {run['kind']:4s} gates={run['gates']:4s} limit={run['diag_limit']:7s} "
          f"B2 {run['b2_ms']:.3f} ms  B1+B2 {run['b1_plus_b2_ms']:.3f} ms  us {gram}  paths {run['diag_paths']}  "
          f"vs_loop {({k: f'{v:.1e}' for k, v in run.get('factored_vs_loop', {}).items()})}")
EOF
