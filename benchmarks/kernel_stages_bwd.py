"""Per-kernel timing of the chunk backward (kernels/generalized/bwd.py): B1 (serial dS pass) and B2
(chunk VJP), separately and together, with ``triton.testing.do_bench`` medians, bf16 inputs.

    python -m benchmarks.kernel_stages_bwd [--out results.json] [--shapes vision,hires,lm,2048px] [--profile]
    python -m benchmarks.kernel_stages_bwd --shapes 2048px --kinds rab1 --groups 1,auto,8,16   # B1 two-level
    python -m benchmarks.kernel_stages_bwd --diag-limits default,0 --gates mild,fast,every8 --profile
        # B2's diagonal Gram blocks: one factored product or the levels (default limit) against the token
        # loop (0), with mild gates (every block one product), fast ones (log-decay uniform in [-20, 0])
        # and every8 (-20 on every eighth channel): those blocks by levels (S2b, S5b)
    python -m benchmarks.kernel_stages_bwd --scratch lowp,fp32 --profile
        # B2's operand-only scratch in 16 bits (the default) against all scratch fp32 (bwd_chunk.scratch_dtypes),
        # with every gradient of the two compared bit for bit (lowp_scratch_equal)
    python -m benchmarks.kernel_stages_bwd --aot [--kinds hdla,kda] [--no-head-dims]   # no GPU

--aot compiles the kernels for the H100 (tools/aot_check.py) and prints registers, spills, shared
memory and wgmma per kernel for HDLA, KDA-like (r_ab = 1, vector decay), GLA (r_ab = 0), GDN (r_ab = 1,
decay per head) and Gated DeltaProduct (r_ab = r_kv = 2, decay per head), with per-kernel FLOP / byte
estimates at the LM shape.

The forward's per-chunk tensors (N, Qeff, gamma, h) are random tensors of the right shapes and
dtypes (gamma in (0, 1], N small, so that long chains stay finite for the two-level parity check):
the kernels' run time does not depend on their values, and the backward is timed on its own
(the forward's kernels: ``benchmarks.kernel_stages``). Variants: HDLA, and r_ab = 1 with vector decay.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

from benchmarks.timing import device_us, env_var, profile_steps
from hdla_vision.kernels.generalized import bwd
from tools.provenance import provenance

SHAPES = {"vision": (128, 196, 3, 64), "hires": (8, 4096, 3, 64), "lm": (4, 4096, 16, 128),
          "2048px": (2, 16384, 3, 64)}


# variant -> (r_ab, r_kv, scalar decay per head); "hdla" builds its A, B (r_ab = 2) from (k, beta, g)
VARIANTS = {"hdla": (2, 1, False), "kda": (1, 1, False), "gla": (0, 1, False), "gdn": (1, 1, True),
            "gdp": (2, 2, True), "rab3": (3, 1, False), "rab4": (4, 1, False), "rab4_rkv4": (4, 4, False)}
# extra head dims (K, V) compiled by --aot at a small shape
HEAD_DIMS = [(16, 16), (32, 32), (256, 256), (64, 128), (128, 64)]


def _every8(x):
    """Mild gates with log lambda = -20 on every eighth channel (benchmarks/kernels.py --fast-gates)."""
    g = -0.5 * x.abs()
    if g.dim() == 4:
        g[..., ::8] = -20.0
    return g


# gates -> g from a draw of ``fill``: mild (|N(0, 1/4)|, a 16-token block's log-decay spread ~6, every
# diagonal block one product), fast (uniform in [-20, 0]: most blocks by levels, kernels/generalized/
# diag_levels.py) or every8 (mild with -20 on every eighth channel: every block and K tile by levels)
GATES = {"mild": lambda x: -0.5 * x.abs(), "fast": lambda x: -20.0 * torch.special.ndtr(x), "every8": _every8}


def _inputs(kind, batch, seq_len, heads, dk, chunk, dv=None, dev="cuda", fill=torch.randn, dtype=torch.bfloat16,
            gates="mild"):
    """Inputs of one backward: random (timing) or, with ``fill=torch.zeros``, zeros (compile only)."""
    bf, dv = dtype, dv or dk
    r_ab, r_kv, scalar = VARIANTS["kda" if kind == "rab1" else kind]
    nt = triton.cdiv(seq_len, chunk)
    q = fill(batch, seq_len, heads, dk, device=dev, dtype=bf)
    g_shape = (batch, seq_len, heads) if scalar else (batch, seq_len, heads, dk)
    g = GATES[gates](fill(*g_shape, device=dev))
    do = fill(batch, seq_len, heads, dv, device=dev, dtype=bf)
    h = fill(batch, heads, nt, dk, dv, device=dev, dtype=bf)
    if kind == "hdla":
        k = F.normalize(fill(batch, seq_len, heads, dk, device=dev) + 1e-3, dim=-1).to(bf)
        v = fill(batch, seq_len, heads, dv, device=dev, dtype=bf)
        beta = 2 * fill(batch, seq_len, heads, device=dev).abs()
        args = (q, k, v, None, None, g)
    else:
        k = fill(batch, seq_len, heads, r_kv, dk, device=dev, dtype=bf) / dk**0.5
        v = fill(batch, seq_len, heads, r_kv, dv, device=dev, dtype=bf)
        a = fill(batch, seq_len, heads, r_ab, dk, device=dev, dtype=bf) / dk**0.5
        b = fill(batch, seq_len, heads, r_ab, dk, device=dev, dtype=bf) / dk**0.5
        args, beta = (q, k, v, a, b, g), None
    dht = fill(batch, heads, dk, dv, device=dev)
    return dict(do=do, dht=dht, args=args, beta=beta, h=h, h0=fill(batch, heads, dk, dv, device=dev))


def default_chunk(kind, dk):
    """The forward's chunk size for this variant (kernels/README.md §8's rule)."""
    from hdla_vision.kernels.generalized.fwd import default_chunk as rule
    r_ab, r_kv, _ = VARIANTS["kda" if kind == "rab1" else kind]
    return rule(r_ab, r_kv, dk)


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def scratch_mode(mode):
    """B2's scratch dtypes (``$HDLA_VISION_B2_SCRATCH``: lowp or fp32; None: leave it) inside the block."""
    return env_var("HDLA_VISION_B2_SCRATCH", mode)


def time_case(kind, shape, chunk, profile=False, groups=None, diag_limit=None, gates="mild", check_scratch=False,
              check_paths=True):
    """do_bench medians of B1 + B2, B1 and B2 (and B2's launches with ``profile``); ``groups``: B1's
    two-level groups (None: the launcher's rule). Other than 1 group, also the relative difference of
    every gradient from the one-level B1's (``two_level_vs_one_level``, bf16 parity). ``diag_limit``:
    B2's bound for the factored diagonal Gram blocks (None: the default; 0: all token by token), and
    ``diag_paths``, per S2 and S5a the fraction of diagonal blocks (and K tiles) on each path (1 one
    product, 2..5 by levels, 0 the token loop), and where some did not take the loop,
    ``factored_vs_loop``: every gradient's relative difference from the token loop's (bf16 parity).
    ``check_scratch``: ``lowp_scratch_equal``, whether each gradient with B2's 16-bit scratch equals
    (torch.equal) the one with all scratch fp32 (the caller's scratch mode is timed). ``check_paths``
    False skips ``diag_paths`` and ``factored_vs_loop``, whose kernel variants (the path record, the
    token loop alone) each compile anew."""
    batch, seq_len, heads, d = shape
    x = _inputs(kind, batch, seq_len, heads, d, chunk, gates=gates)
    timings = {}
    stages = {}

    def full(n_groups=groups, paths=None, limit=diag_limit):
        return bwd.generalized_backward(x["do"], x["dht"], *x["args"], 0.1, x["h0"], x["h"], False,
                                        hdla_beta=x["beta"], stages=stages, groups=n_groups,
                                        diag_limit=limit, diag_paths=paths)

    if check_paths:
        paths = {}
        out = full(paths=paths)
        timings["diag_paths"] = {name: {str(code): round(((t == code).sum() / (t >= 0).sum()).item(), 4)
                                        for code in t[t >= 0].unique().tolist()} for name, t in paths.items()}
        if any(code != "0" for shares in timings["diag_paths"].values() for code in shares):
            ref = full(limit=0.0)
            timings["factored_vs_loop"] = {f"d{i}": _rel(o, r) for i, (o, r) in enumerate(zip(out, ref))
                                           if o is not None}
    if check_scratch:
        with scratch_mode("lowp"):
            lowp = full()
        with scratch_mode("fp32"):
            ref = full()
        timings["lowp_scratch_equal"] = {f"d{i}": torch.equal(o, r) for i, (o, r) in enumerate(zip(lowp, ref))
                                         if o is not None}
    stages.clear()

    out = full()
    torch.cuda.synchronize()
    timings["b1_groups"] = stages.pop("b1_groups")
    if timings["b1_groups"] > 1:
        ref = full(1)
        timings["two_level_vs_one_level"] = {f"d{i}": _rel(o, r) for i, (o, r) in enumerate(zip(out, ref))
                                             if o is not None}
        full()
        stages.pop("b1_groups")
    timings["b1_plus_b2_ms"] = triton.testing.do_bench(full, warmup=50, rep=200)
    stages.pop("b1_groups")
    for name, fn in stages.items():
        timings[name + "_ms"] = triton.testing.do_bench(fn, warmup=50, rep=200)
    if profile:
        timings["b2_launches_us"] = profile_launches(stages["b2"])
    return timings


def profile_launches(fn, calls=5):
    """``{kernel name: [µs per call, launches per call]}`` of ``fn`` (one B2) under torch.profiler,
    largest first: which of B2's launches the time goes to."""
    per_call = {}
    for e in profile_steps(fn, calls).key_averages():
        if device_us(e) > 0:
            per_call[e.key[:60]] = [round(device_us(e) / calls, 1), e.count / calls]
    return dict(sorted(per_call.items(), key=lambda kv: -kv[1][0]))


def work_estimate(kind, shape, chunk, dv=None, ds_bytes=2):
    """Algorithmic FLOPs (matrix products, 2mnk) and HBM bytes of B1 and B2 for one backward at
    ``shape = (B, T, H, K)`` (bf16 inputs; h, N, Qeff bf16; dS ``ds_bytes`` per element).
    Off-diagonal decay factoring and masking add no FLOPs here: this is the work to judge against
    the H100's peaks, not what a given kernel version executes."""
    from hdla_vision.kernels.generalized import bwd as _bwd
    batch, seq_len, heads, dk = shape
    dv = dv or dk
    r_ab, r_kv, scalar = VARIANTS["kda" if kind == "rab1" else kind]
    c, nt = chunk, triton.cdiv(seq_len, chunk)
    r, rk = r_ab * c, r_kv * c
    blocks = batch * heads * nt
    bv1 = _bwd.b1_config(dk, dv)["BV"]
    b1_flops = 2 * dk * dk * dv + 2 * c * dk * dv
    b1_bytes = (dk * dk * 2) * triton.cdiv(dv, bv1) + c * dk * 2 + c * dv * 2 + dk * 4 + dk * dv * ds_bytes
    mm = lambda m, n, k: 2 * m * n * k  # noqa: E731
    fwd = mm(c, rk, dk) + mm(c, r, dk) + mm(r, r, dk) + mm(r, rk, dk) + mm(r, r, dk) + mm(r, r, rk) \
        + mm(c, r, rk) + mm(rk, r, dk)
    vpart = mm(c, dk, dv) + mm(c, rk, dv) + mm(dk, dk, dv) + mm(dk, rk, dv) + mm(rk, c, dv) + mm(rk, dk, dv)
    back = mm(r, rk, dk) + mm(r, dk, dk) + mm(r, dk, rk) + mm(r, c, rk) + mm(r, dk, dk) + mm(r, c, dk) \
        + mm(c, r, dk) + mm(c, rk, r) + mm(r, r, dk) + mm(r, r, rk) + mm(r, r, dk) + mm(r, r, rk)
    grams = 2 * (mm(c, rk, dk) + mm(c, r, dk) + mm(r, r, dk) + mm(r, rk, dk))
    if not r_ab:
        fwd, back, grams = mm(c, rk, dk), 0, 2 * mm(c, rk, dk)
        vpart -= mm(dk, dk, dv)
    tok_in = c * (dk * 2 + rk // c * (dk + dv) * 2 + 2 * r_ab * dk * 2 + dv * 2 + (2 if scalar else dk * 2))
    b2_bytes = tok_in * 2 + dk * dv * (2 + ds_bytes)  # inputs read, same-size gradients written; h and dS
    return {"b1": dict(flops=b1_flops * blocks, bytes=b1_bytes * blocks),
            "b2": dict(flops=(fwd + vpart + back + grams) * blocks, bytes=b2_bytes * blocks)}


def format_work(kind, shape, chunk, peak_flops=400e12, peak_bytes=3.3e12):
    """One line per kernel: GFLOP, MB, and the time floors at a realistic wgmma rate and HBM bandwidth."""
    lines = []
    for name, w in work_estimate(kind, shape, chunk).items():
        t_f, t_b = w["flops"] / peak_flops * 1e3, w["bytes"] / peak_bytes * 1e3
        lines.append(f"{kind:5s} {name}: {w['flops'] / 1e9:8.1f} GFLOP {w['bytes'] / 1e6:8.1f} MB  "
                     f"floor {max(t_f, t_b):.3f} ms ({'compute' if t_f > t_b else 'memory'}: {t_f:.3f} / {t_b:.3f})")
    return "\n".join(lines)


def aot_cases(kinds, shapes, head_dims=True):
    """(kind, label, (B, T, H, K), V) of every configuration compiled by :func:`aot_report`."""
    cases = [(kind, name, SHAPES[name], SHAPES[name][3]) for name in shapes for kind in kinds]
    if head_dims:
        cases += [(kind, f"K{dk}V{dv}", (2, 512, 2, dk), dv) for dk, dv in HEAD_DIMS for kind in kinds]
    return cases


def aot_compile(kind, shape, dv, dtype=torch.bfloat16):
    """Compile B1 and B2 (and every other launch of one backward) for the H100 without a GPU:
    the records of tools.aot_check.compile_only."""
    from tools.aot_check import compile_only
    batch, seq_len, heads, dk = shape
    chunk = default_chunk(kind, dk)
    x = _inputs(kind, batch, seq_len, heads, dk, chunk, dv=dv, dev="cpu", fill=torch.zeros, dtype=dtype)
    with compile_only() as records:
        bwd.generalized_backward(x["do"], x["dht"], *x["args"], 0.1, x["h0"], x["h"], False,
                                 hdla_beta=x["beta"])
    return chunk, records


def aot_report(kinds, shapes, head_dims=True, dtype=torch.bfloat16):
    """Print regs / spills / smem / wgmma per kernel and configuration, and the work estimates at
    the LM shape; returns the number of spilling compilations."""
    from tools.aot_check import format_records
    spills = 0
    for kind, label, shape, dv in aot_cases(kinds, shapes, head_dims):
        chunk, records = aot_compile(kind, shape, dv, dtype)
        print(f"\n== {kind} at {label} {shape} V={dv} C={chunk} ({str(dtype)[6:]}, sm_90a)")
        print(format_records(records))
        spills += sum(r["stack"] > 0 or r["local"] > 0 for r in records)
    print(f"\n{spills} kernel compilations spill registers")
    print("\nwork per backward at the LM shape", SHAPES["lm"], "(400 TFLOP/s, 3.3 TB/s):")
    for kind in kinds:
        print(format_work(kind, SHAPES["lm"], default_chunk(kind, SHAPES["lm"][3])))
    return spills


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernel_stages_bwd.json"))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kinds", default="hdla,rab1")
    parser.add_argument("--chunks", default="64")
    parser.add_argument("--aot", action="store_true",
                        help="no GPU: compile B1 and B2 for the H100 and report regs / spills / smem / wgmma")
    parser.add_argument("--profile", action="store_true", help="per-launch breakdown of B2 (torch.profiler)")
    parser.add_argument("--no-head-dims", action="store_true", help="with --aot: only the benchmark shapes")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="with --aot: the input dtype compiled")
    parser.add_argument("--groups", default="1",
                        help="B1's two-level scan groups to time, comma-separated ints or 'auto' (the rule)")
    parser.add_argument("--diag-limits", default="default",
                        help="B2's diagonal-block limits to time, comma-separated: 'default' or a float (0: the "
                             "token loop everywhere)")
    parser.add_argument("--gates", default="mild", help="comma-separated: mild, fast (GATES)")
    parser.add_argument("--timing-only", action="store_true",
                        help="skip the diagonal-path record and the token-loop comparison (their kernel variants "
                             "compile anew: a cold cache's minutes)")
    parser.add_argument("--scratch", default="default",
                        help="B2's scratch dtypes to time, comma-separated: default (the module's or "
                             "$HDLA_VISION_B2_SCRATCH), lowp, fp32; with both lowp and fp32, lowp's runs also "
                             "compare the two bit for bit")
    args = parser.parse_args()
    if args.aot:
        kinds = "hdla,kda,gla,gdn,gdp" if args.kinds == "hdla,rab1" else args.kinds
        aot_report(kinds.split(","), args.shapes.split(","), not args.no_head_dims, getattr(torch, args.dtype))
        return
    scratches = args.scratch.split(",")
    unknown = set(scratches) - {"default", "lowp", "fp32"}
    if unknown:
        raise ValueError(f"--scratch: unknown modes {sorted(unknown)} (default, lowp, fp32)")
    results = dict(provenance(torch.cuda.get_device_name()), runs=[])
    for name in args.shapes.split(","):
        for kind in args.kinds.split(","):
            for chunk, groups, gates, limit, scratch in (
                    (int(c), g, gt, lim, sc) for c in args.chunks.split(",") for g in args.groups.split(",")
                    for gt in args.gates.split(",") for lim in args.diag_limits.split(",") for sc in scratches):
                try:
                    with scratch_mode(None if scratch == "default" else scratch):
                        t = time_case(kind, SHAPES[name], chunk, args.profile,
                                      None if groups == "auto" else int(groups),
                                      None if limit == "default" else float(limit), gates,
                                      check_scratch=scratch == "lowp" and "fp32" in scratches,
                                      check_paths=not args.timing_only)
                except Exception as exc:  # noqa: BLE001  one failing configuration must not end the sweep
                    t = {"error": f"{type(exc).__name__}: {str(exc)[-400:]}"}
                run = dict(shape=name, bthd=SHAPES[name], kind=kind, chunk=chunk, groups=groups, gates=gates,
                           diag_limit=limit, scratch=scratch, **t)
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
