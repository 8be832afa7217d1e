"""The bidirectional op on the GPU (kernels/README.md §9): bf16 parity against the float64 token loops,
and the time of the fused op against the two single-direction calls and the sum it replaces.

    HDLA_VISION_KERNELS=chunk64 python -m benchmarks.bidirectional --part parity [--cases hdla_mild,...]
    HDLA_VISION_KERNELS=chunk64 python -m benchmarks.bidirectional --part timing --shapes vision,1024px,2048px
    HDLA_VISION_KERNELS=chunk64 python -m benchmarks.bidirectional --part warmup --kinds hdla,kda
    HDLA_VISION_KERNELS=chunk64 python -m benchmarks.bidirectional --part timing --shapes vision,hires \
        --gates mild,every8 --variants fused
    HDLA_VISION_KERNELS=chunk64 python -m benchmarks.bidirectional --part scratch --shapes 224px_b256,512px_b64

``--part parity``: per case (HDLA, and the generalized op with stacked and shared inputs, ranks 0 and 1,
a decay per head), y, both final states and every gradient in bf16 (gates in fp32, as the mixers keep
them) against the float64 loops on the same rounded inputs, and the fused op against the two
single-direction calls (``two_calls``) in bf16. ``--part timing``: at each shape, forward and
forward+backward (``benchmarks.timing``) of ``chunk_hdla_bidirectional`` (``fused``; ``fused+stack``
adds the mixer's ``torch.stack`` of the gates) and of ``chunk_hdla`` twice plus the mixer's old sum
``y_f + y_b - (q.k) v`` (``two_calls``), with the ratio fused / two_calls; ``--kinds hdla,kda`` adds
the generalized op at rank 1 (k, a, b stacked, v shared); ``--gates mild,every8`` times each shape with the
mixers' gates and with log lambda = -20 per step on every eighth key channel (fast-forgetting gates: the
diagonal blocks by levels, kernels/generalized/diag_levels.py), ``--variants`` a subset of the three.
``--part warmup``: one forward+backward of
every timing variant at every shape, untimed, so that the Triton kernels are compiled (and cached on
disk) before a timing run; several warm-ups and parity runs can compile side by side. ``--part scratch``:
the fused op's forward+backward time and peak memory above its inputs at each of ``--budgets`` (MiB of
B2's scratch per launch, ``$HDLA_VISION_B2_SCRATCH_MIB``; 0 = the whole batch in one launch). Writes
``bidirectional_<part>.json`` to ``--out`` (default ``$OUT`` or ``.``), headed by the device, date and
commit (parity with ``--cases``: ``bidirectional_parity_<first case>.json``).
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.timing import time_fwd_bwd
from hdla_vision.kernels import chunk_generalized, chunk_generalized_bidirectional, chunk_hdla, chunk_hdla_bidirectional
from tools.provenance import provenance

SHAPES = {  # (B, T, H, K = V): the vision mixers' scans at 224, 1024 and 2048 px (patch 16)
    "vision": (128, 196, 3, 64),
    "1024px": (16, 4096, 3, 64),
    "2048px": (2, 16384, 3, 64),
    "hires": (8, 4096, 3, 64),  # benchmarks/kernels.py's high-res shape
    "224px_b256": (256, 196, 3, 64),  # benchmarks/models.py's training batches
    "512px_b64": (64, 1024, 3, 64),
}
# (kind, bidirectional_problem keywords): T = 300 is not a multiple of the chunk (32)
PARITY = {
    "hdla_mild": ("hdla", dict(g_min=-0.1)),
    "hdla_gates20_beta_ends": ("hdla", dict(g_min=-20.0, beta_ends=True)),
    "rab1_stacked_kab": ("generalized", dict(stacked=("k", "a", "b"), r_ab=1)),
    "rab1_scalar_shared_vb": ("generalized", dict(stacked=("k", "a"), r_ab=1, per_head_g=True)),
    "rab0_shared_kv": ("generalized", dict(stacked=(), r_ab=0)),
    # fast-forgetting gates: log lambda = -20 per step on every eighth channel (both directions), mild elsewhere
    "hdla_every8_m20": ("hdla", dict(g_min=-1.0, every8=-20.0)),
    "rab1_every8_m20_stacked_ka": ("generalized", dict(stacked=("k", "a"), r_ab=1, g_min=-1.0, every8=-20.0)),
}
PARITY_SHAPE = (2, 300, 2, 64, 64)


def _fused_launches():
    """A counter of the fused output kernel's launches (the parity checks name the path that ran)."""
    from hdla_vision.kernels.generalized import fwd

    calls = []
    real = fwd.chunk_output_bidir

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    fwd.chunk_output_bidir = counting
    return calls


def _states(s_f, s_b):
    return None if s_f is None else torch.stack([s_f, s_b])


def _two_calls(kind):
    """The single-direction ops twice and the own-write correction, as the mixers summed them before."""
    def hdla(q, k, v, beta, g, scale=None, initial_state=None, output_final_state=False):
        s = 1.0 if scale is None else scale
        h0 = [None, None] if initial_state is None else initial_state
        y_f, s_f = chunk_hdla(q, k, v, beta[0], g[0], scale, h0[0], output_final_state)
        y_b, s_b = chunk_hdla(q, k, v, beta[1], g[1], scale, h0[1], output_final_state, reverse=True)
        return y_f + y_b - s * (q * k).sum(-1, keepdim=True) * v, _states(s_f, s_b)

    def generalized(q, k, v, a, b, g, scale=None, initial_state=None, output_final_state=False):
        s = 1.0 if scale is None else scale
        h0 = [None, None] if initial_state is None else initial_state
        side = [[x[d] if x.dim() == 6 else x for x in (k, v, a, b)] for d in (0, 1)]
        y_f, s_f = chunk_generalized(q, *side[0], g[0], scale, h0[0], output_final_state)
        y_b, s_b = chunk_generalized(q, *side[1], g[1], scale, h0[1], output_final_state, reverse=True)
        own = s * ((q.unsqueeze(-2) * side[1][0]).sum(-1, keepdim=True) * side[1][1]).sum(-2)
        return y_f + y_b - own, _states(s_f, s_b)

    return hdla if kind == "hdla" else generalized


def parity(device, cases) -> dict:
    """bf16 errors against the float64 loops per case, and fused against two single-direction calls."""
    from tests.bidirectional_oracle import bidirectional_problem, compare_bidirectional

    launches = _fused_launches()
    results = {}
    for name in cases:
        kind, kw = PARITY[name]
        kw = dict(kw)
        every8 = kw.pop("every8", None)
        problem = bidirectional_problem(kind, *PARITY_SHAPE, **kw)
        if every8 is not None:
            problem["g"][..., ::8] = every8
        fused = chunk_hdla_bidirectional if kind == "hdla" else chunk_generalized_bidirectional
        before = len(launches)
        errors = compare_bidirectional(fused, kind, problem, scale=0.5, dtype=torch.bfloat16, device=device,
                                       round_reference=True, gate_dtype=torch.float32)
        row = {"vs_float64": errors, "fused_path": len(launches) > before}
        row["vs_two_calls"] = _fused_against_two_calls(kind, problem, device)
        results[name] = row
        worst = max(errors.values())
        print(f"{name:24s} fused={row['fused_path']}  worst vs float64 {worst:.2e}  "
              + "  ".join(f"{n} {e:.1e}" for n, e in errors.items())
              + f"  | vs two calls: y {row['vs_two_calls']['y']:.1e}", flush=True)
    return results


def _fused_against_two_calls(kind, problem, device) -> dict:
    """Relative difference of y (bf16 inputs, fp32 gates) between the fused op and the two calls."""
    from tests.oracle import rel_err

    ins = {n: None if x is None else x.to(device, torch.float32 if n in ("g", "beta") else torch.bfloat16)
           for n, x in problem.items()}
    fused = chunk_hdla_bidirectional if kind == "hdla" else chunk_generalized_bidirectional
    with torch.no_grad():
        y_fused, s_fused = fused(**ins, scale=0.5, output_final_state=True)
        y_two, s_two = _two_calls(kind)(**ins, scale=0.5, output_final_state=True)
    return {"y": rel_err(y_fused, y_two), "final_state": rel_err(s_fused, s_two)}


def _timing_inputs(kind, batch, seq_len, heads, dim, device, seed=0, gates="mild"):
    """bf16 q, k (unit), v and fp32 gates stacked by direction (beta in (0, 2), g = logsigmoid(x + 2)),
    as the vision mixers hand them over; ``kda``: the generalized op at rank 1 (k, a, b stacked).
    ``gates="every8"``: g = -20 on every eighth channel (benchmarks/kernels.py's fast-forgetting gates)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q = rnd(batch, seq_len, heads, dim)
    k = F.normalize(rnd(batch, seq_len, heads, dim), dim=-1)
    v = rnd(batch, seq_len, heads, dim)
    g = F.logsigmoid(rnd(2, batch, seq_len, heads, dim) + 2.0)
    if gates == "every8":
        g[..., ::8] = -20.0
    elif gates != "mild":
        raise ValueError(f"gates must be mild or every8, got {gates!r}")
    if kind == "hdla":
        beta = 2 * torch.sigmoid(rnd(2, batch, seq_len, heads))
        return [q.bfloat16().requires_grad_(), k.bfloat16().requires_grad_(), v.bfloat16().requires_grad_(),
                beta.requires_grad_(), g.requires_grad_()]
    beta = torch.sigmoid(rnd(2, batch, seq_len, heads, 1, 1))
    kk = F.normalize(rnd(2, batch, seq_len, heads, 1, dim), dim=-1)
    stacked = [(beta * kk).bfloat16(), (beta * kk).bfloat16(), (g.exp().unsqueeze(-2) * kk).bfloat16()]
    return [q.bfloat16().requires_grad_(), stacked[0].requires_grad_(), v.unsqueeze(-2).bfloat16().requires_grad_(),
            stacked[1].requires_grad_(), stacked[2].requires_grad_(), g.requires_grad_()]


def _variants(kind):
    """{name: fn(*inputs) -> y} of the timing."""
    if kind == "hdla":
        def fused(q, k, v, beta, g):
            return chunk_hdla_bidirectional(q, k, v, beta, g)[0]

        def fused_stack(q, k, v, beta, g):  # the mixer's own step before the op: the gates stacked
            return chunk_hdla_bidirectional(q, k, v, torch.stack([beta[0], beta[1]]), torch.stack([g[0], g[1]]))[0]
    else:
        def fused(q, k, v, a, b, g):
            return chunk_generalized_bidirectional(q, k, v, a, b, g, scale=0.125)[0]

        def fused_stack(q, k, v, a, b, g):
            stack = lambda x: torch.stack([x[0], x[1]])  # noqa: E731
            return chunk_generalized_bidirectional(q, stack(k), v, stack(a), stack(b), stack(g), scale=0.125)[0]
    two = _two_calls(kind)
    scale = None if kind == "hdla" else 0.125

    def two_calls(*inputs):
        return two(*inputs, scale=scale)[0]

    return {"fused": fused, "fused+stack": fused_stack, "two_calls": two_calls}


def _runs(kinds, shapes, gates):
    """(result key, kind, shape name, gates) of each timing row: ``kind/shape`` for the mixers' gates,
    ``kind/shape/every8`` for the fast-forgetting ones."""
    return [(f"{kind}/{name}" + ("" if gate == "mild" else f"/{gate}"), kind, name, gate)
            for kind in kinds for name in shapes for gate in gates]


def warmup(device, shapes, kinds, gates=("mild",), variants=None) -> dict:
    """One forward+backward per variant and shape (compiles the kernels); returns the seconds each took."""
    import time

    seconds = {}
    for key, kind, name, gate in _runs(kinds, shapes, gates):
        inputs = _timing_inputs(kind, *SHAPES[name], device, gates=gate)
        chosen = {v: fn for v, fn in _variants(kind).items() if variants is None or v in variants}
        for variant, fn in chosen.items():
            start = time.perf_counter()
            torch.autograd.grad(fn(*inputs).float().square().sum(), inputs, allow_unused=True)
            torch.cuda.synchronize()
            seconds[f"{key}/{variant}"] = time.perf_counter() - start
        print(f"warm-up {key}: " + ", ".join(f"{v} {seconds[f'{key}/{v}']:.1f} s" for v in chosen), flush=True)
        del inputs
        torch.cuda.empty_cache()
    return seconds


def timing(device, shapes, kinds, gates=("mild",), variants=None) -> dict:
    """ms of forward and forward+backward per row of :func:`_runs` and variant; with both variants, the
    ratio fused / two_calls; with both gates, every8 / mild of each variant (under the every8 key)."""
    results = {}
    for key, kind, name, gate in _runs(kinds, shapes, gates):
        inputs = _timing_inputs(kind, *SHAPES[name], device, gates=gate)
        row = {}
        for variant, fn in _variants(kind).items():
            if variants is None or variant in variants:
                fwd_ms, all_ms = time_fwd_bwd(fn, inputs)
                row[variant] = {"fwd": fwd_ms, "fwd_bwd": all_ms}
        line = "  ".join(f"{v} fwd {t['fwd']:.3f} fwd+bwd {t['fwd_bwd']:.3f} ms" for v, t in row.items())
        if "fused" in row and "two_calls" in row:
            row["ratio_fused_over_two_calls"] = {p: row["fused"][p] / row["two_calls"][p] for p in ("fwd", "fwd_bwd")}
            line += (f"  | fused/two: fwd {row['ratio_fused_over_two_calls']['fwd']:.2f}x "
                     f"fwd+bwd {row['ratio_fused_over_two_calls']['fwd_bwd']:.2f}x")
        mild = results.get(f"{kind}/{name}")
        if gate != "mild" and mild is not None:
            row["ratio_over_mild"] = {v: {p: t[p] / mild[v][p] for p in ("fwd", "fwd_bwd")}
                                      for v, t in row.items() if v in mild}
            line += "  | over mild: " + "  ".join(f"{v} fwd {r['fwd']:.2f}x fwd+bwd {r['fwd_bwd']:.2f}x"
                                                  for v, r in row["ratio_over_mild"].items())
        results[key] = row
        print(f"{key:20s} {SHAPES[name]}  {line}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    return results


def scratch(device, shapes, kinds, budgets) -> dict:
    """{kind/shape: {budget MiB: {fwd_bwd ms, peak MiB}}}: the fused op under each B2 scratch budget;
    peak is the most memory allocated during one forward+backward above what was allocated before it."""
    from hdla_vision.kernels.generalized.bwd import SCRATCH_BUDGET_ENV

    results = {}
    for kind in kinds:
        fn = _variants(kind)["fused"]
        for name in shapes:
            inputs = _timing_inputs(kind, *SHAPES[name], device)
            grad = torch.randn_like(fn(*inputs))
            row = {}
            for budget in budgets:
                os.environ[SCRATCH_BUDGET_ENV] = str(budget)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                torch.autograd.grad(fn(*inputs), inputs, grad, allow_unused=True)
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                _, ms = time_fwd_bwd(fn, inputs)
                row[str(budget)] = {"fwd_bwd": ms, "peak_mib": peak}
                print(f"{kind:5s} {name:10s} {SHAPES[name]} budget {budget:5d} MiB: fwd+bwd {ms:.3f} ms, "
                      f"peak {peak:.0f} MiB", flush=True)
            results[f"{kind}/{name}"] = row
            del inputs, grad
            torch.cuda.empty_cache()
    os.environ.pop(SCRATCH_BUDGET_ENV, None)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("parity", "timing", "warmup", "scratch"), required=True)
    parser.add_argument("--cases", default=",".join(PARITY), help="parity cases")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kinds", default="hdla", help="hdla and/or kda (the generalized op at rank 1)")
    parser.add_argument("--gates", default="mild", help="timing / warmup: mild and/or every8 (-20 on 1/8 of channels)")
    parser.add_argument("--variants", default=None, help="timing / warmup: a subset of fused,fused+stack,two_calls")
    parser.add_argument("--budgets", default="0,1024,512", help="--part scratch: B2 scratch budgets in MiB")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    device = "cuda"
    result = dict(provenance(torch.cuda.get_device_name()), kernels=os.environ.get("HDLA_VISION_KERNELS", "chunk16"))
    cases = args.cases.split(",")
    runs = dict(gates=args.gates.split(","), variants=args.variants.split(",") if args.variants else None)
    if args.part == "parity":
        result["cases"] = parity(device, cases)
    elif args.part == "scratch":
        budgets = [int(b) for b in args.budgets.split(",")]
        result["scratch"] = scratch(device, args.shapes.split(","), args.kinds.split(","), budgets)
    elif args.part == "warmup":
        result["seconds"] = warmup(device, args.shapes.split(","), args.kinds.split(","), **runs)
    else:
        result["timings_ms"] = timing(device, args.shapes.split(","), args.kinds.split(","), **runs)
    suffix = f"_{cases[0]}" if args.part == "parity" and cases != list(PARITY) else ""
    path = os.path.join(args.out, f"bidirectional_{args.part}{suffix}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
