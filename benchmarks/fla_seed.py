"""Seed mixers: our ``chunk_generalized`` against fla 0.6's dedicated kernels (parity and time); with
``HDLA_VISION_KERNELS=delta`` our side of GLA, DeltaNet, Gated DeltaNet / DeltaProduct and KDA is the delta rule's
sub-step op, as the mixers then run them (tools/fla_ops.py).

    python -m benchmarks.fla_seed                       # parity + timing, all mixers, vision and LM shapes
    python -m benchmarks.fla_seed --mixers gla kda --shapes vision --no-parity
    python -m benchmarks.fla_seed --warm fla --mixers kda   # one fla fwd+bwd per shape (fills Triton's caches)
    python -m benchmarks.fla_seed --no-parity --sides ours ours_delta   # our two routes, no fla (no autotuning)

Parity (bf16 at (B, T, H, D) = (2, 300, 2, 64), T not a multiple of any chunk; fp32 would make fla
autotune every kernel again for new dtypes, minutes per mixer): outputs and the gradients of every leaf input, ours vs fla, and each vs the float64
token loop (``naive_generalized`` on the same factor functions). Timing: ``triton.testing.do_bench``
medians of fwd and fwd+bwd at the kernel benchmark's vision and LM shapes, bf16, ratio ours / fla
from the same run. Where fla raises (its gated backward refuses Triton 3.4 .. 3.7.0 on Hopper) the
message is recorded instead of a number; ``--fla-gated-bwd-anyway`` lifts that refusal to time
the backward anyway (the JSON says so, and the parity section then shows how far fla's gradients
are off). JSON goes to ``$OUT/fla_seed.json``; ``--merge-from DIR ...`` joins the JSONs of several
processes (one mixer per GPU) into one.
"""
import argparse
import json
import os
import time

import torch
import triton

from tools.fla_ops import MIXERS, as_float64
from benchmarks.kernels import rel_err
from benchmarks.timing import env_var
from tools.fla_seed_merge import merge
from tools.provenance import provenance
from tools.triton_cache import shorten_autotune
from hdla_vision.kernels import naive_generalized
from hdla_vision.kernels.utils import KERNEL_FAMILY_ENV

SHAPES = {"vision": (128, 196, 3, 64), "lm": (4, 4096, 16, 128)}
PARITY_SHAPE = (2, 300, 2, 64)
SCALE = 0.125
# what each timed side runs: fla's kernel, ours as HDLA_VISION_KERNELS says (None: as the environment has it), and
# ours on the delta rule's kernels (the mixers made of delta steps; the others as "ours")
SIDES = {"fla": None, "ours": None, "ours_delta": "delta"}
# mixers whose fla backward goes through the gated chunk_bwd_dqkwg that fla refuses on Hopper with Triton < 3.7.1
FLA_GATED_BWD = ("gated_deltanet", "gated_deltaproduct_2", "gated_deltaproduct_3")


def outputs_and_grads(fn, x, do):
    """``(o, {name: grad})`` of one call, or ``(o, error message)`` if the backward raises."""
    o = fn(x)
    try:
        grads = torch.autograd.grad(o, list(x.values()), do.to(o.dtype))
    except RuntimeError as err:
        return o.detach(), f"backward raised: {str(err).splitlines()[0][:200]}"
    return o.detach(), dict(zip(x, grads))


def parity(name, dtype, device):
    make, fla_fn, ours_fn, _ = MIXERS[name]
    x = make(*PARITY_SHAPE, dtype, device, torch.Generator(device=device).manual_seed(1))
    x64 = as_float64(x)
    ref_o = ours_fn(x64, SCALE, op=naive_generalized)
    do = torch.randn_like(ref_o)
    ref_g = dict(zip(x64, torch.autograd.grad(ref_o, list(x64.values()), do)))
    result = {}
    for side, fn in (("ours", lambda t: ours_fn(t, SCALE)), ("fla", lambda t: fla_fn(t, SCALE))):
        try:
            o, grads = outputs_and_grads(fn, x, do)
        except (AssertionError, RuntimeError) as err:
            result[side] = f"forward raised: {str(err).splitlines()[0][:200]}"
            continue
        errs = {"o": rel_err(o, ref_o)}
        if isinstance(grads, str):
            errs["grads"] = grads
        else:
            errs.update({f"d{k}": rel_err(g, ref_g[k]) for k, g in grads.items()})
        result[side] = {"vs_loop": errs, "_o": o, "_g": grads}
    if isinstance(result.get("ours"), dict) and isinstance(result.get("fla"), dict):
        ours, fla = result["ours"], result["fla"]
        both = {"o": rel_err(ours["_o"], fla["_o"])}
        if isinstance(ours["_g"], dict) and isinstance(fla["_g"], dict):
            both.update({f"d{k}": rel_err(ours["_g"][k], fla["_g"][k]) for k in ours["_g"]})
        result["ours_vs_fla"] = both
    for side in ("ours", "fla"):
        if isinstance(result.get(side), dict):
            result[side] = result[side]["vs_loop"]
    return result


def bench(fn, x, fwd_bwd):
    o = fn(x)
    do = torch.randn_like(o)
    leaves = list(x.values())

    def step():
        if fwd_bwd:
            torch.autograd.grad(fn(x), leaves, do)
        else:
            with torch.no_grad():
                fn(x)

    return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")


def on_side(side, fn):
    """``fn`` under the kernel family of ``side`` (:data:`SIDES`)."""
    def run(x):
        with env_var(KERNEL_FAMILY_ENV, SIDES[side]):
            return fn(x)
    return run


def timing(name, shape, device, sides=("ours", "fla")):
    """fwd and fwd+bwd ms of each side (:data:`SIDES`) on the same inputs, and ours (each of our sides) over fla."""
    make, fla_fn, ours_fn, _ = MIXERS[name]
    x = make(*shape, torch.bfloat16, device, torch.Generator(device=device).manual_seed(0))
    out = {}
    for side in sides:
        fn = on_side(side, (lambda t: fla_fn(t, SCALE)) if side == "fla" else (lambda t: ours_fn(t, SCALE)))
        t0 = time.perf_counter()
        entry = {}
        for mode, fwd_bwd in (("fwd", False), ("fwd_bwd", True)):
            try:
                entry[mode] = bench(fn, x, fwd_bwd)
            except (AssertionError, RuntimeError) as err:
                entry[mode] = f"raised: {str(err).splitlines()[0][:200]}"
        entry["wall_s"] = time.perf_counter() - t0
        out[side] = entry
    for ours in ("ours", "ours_delta"):
        for mode in ("fwd", "fwd_bwd"):
            a, b = out.get(ours, {}).get(mode), out.get("fla", {}).get(mode)
            if isinstance(a, float) and isinstance(b, float):
                out[f"{ours}_over_fla_{mode}"] = a / b
    return out


def warm(name, shapes, device, side):
    """One fwd+bwd per shape of fla's kernel or ours: compiles (and autotunes) into Triton's cache."""
    make, fla_fn, ours_fn, _ = MIXERS[name]
    fn = fla_fn if side == "fla" else ours_fn
    for shape_name in shapes:
        x = make(*SHAPES[shape_name], torch.bfloat16, device, torch.Generator(device=device).manual_seed(0))
        t0 = time.perf_counter()
        o = fn(x, SCALE)
        try:
            torch.autograd.grad(o, list(x.values()), torch.randn_like(o))
        except RuntimeError as err:
            print(f"{name} {shape_name}: {side} backward raised ({str(err).splitlines()[0][:80]})")
        torch.cuda.synchronize()
        print(f"warm {side} {name} {shape_name}: {time.perf_counter() - t0:.1f} s", flush=True)


def compile_shard(index: int, count: int) -> None:
    """Make every Triton autotuner in this process try only configurations ``index::count``.

    Several processes with different shards compile disjoint parts of fla's search space into one
    Triton cache; a later process with the full space then only benchmarks cached binaries. The
    shard's own choices are meaningless and must be dropped (``triton_cache.py drop-autotune``).
    """
    from triton.runtime.autotuner import Autotuner

    full = Autotuner.prune_configs

    def sharded(self, kwargs):
        configs = full(self, kwargs)
        return configs[index::count] or configs[:1]

    Autotuner.prune_configs = sharded


def allow_fla_gated_backward() -> None:
    """Let fla 0.6 run its gated ``chunk_bwd_dqkwg`` on Hopper with Triton < 3.7.1.

    fla refuses it there because that Triton miscompiles it (fla issue #640): the kernel runs the
    same work either way, so its time is still fla's time, but its gradients are not trusted.
    """
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mixers", nargs="+", default=list(MIXERS), choices=list(MIXERS))
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--no-parity", action="store_true")
    p.add_argument("--sides", nargs="+", default=["ours", "fla"], choices=list(SIDES),
                   help="what to time: ours (as HDLA_VISION_KERNELS says), ours_delta (on the delta rule), fla")
    p.add_argument("--warm", choices=["fla", "ours"], help="only run that side once per shape")
    p.add_argument("--autotune-rep-ms", type=float, default=None, help="time each autotune config this long")
    p.add_argument("--shard", default=None, metavar="I/N", help="with --warm: compile configurations I::N only")
    p.add_argument("--fla-gated-bwd-anyway", action="store_true",
                   help="time fla's gated backward although fla refuses it on this Triton (see allow_fla_gated_backward)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--merge-from", nargs="+", metavar="DIR", help="no GPU work: merge these runs' JSON into --out")
    args = p.parse_args()
    if args.merge_from:
        return merge(args.merge_from, args.out)
    device = "cuda"
    if args.autotune_rep_ms:
        shorten_autotune(rep_ms=args.autotune_rep_ms)
    if args.shard:
        compile_shard(*map(int, args.shard.split("/")))
    if args.fla_gated_bwd_anyway:
        allow_fla_gated_backward()
    if args.warm:
        for name in args.mixers:
            warm(name, args.shapes, device, args.warm)
        return
    import fla
    result = {**provenance(torch.cuda.get_device_name()), "torch": torch.__version__,
              "triton": triton.__version__, "fla": getattr(fla, "__version__", "?"), "scale": SCALE,
              "fla_kernels": {name: MIXERS[name][3] for name in args.mixers},
              "fla_gated_bwd_forced_for": [],
              "parity": {}, "timings_ms": {}}
    os.makedirs(args.out, exist_ok=True)
    for name in args.mixers:
        if args.fla_gated_bwd_anyway and name in FLA_GATED_BWD:
            result["fla_gated_bwd_forced_for"].append(name)
        if not args.no_parity:
            result["parity"][name] = {"bfloat16": parity(name, torch.bfloat16, device)}
            print(name, json.dumps(result["parity"][name]), flush=True)
        for shape in args.shapes:
            result["timings_ms"][f"{shape}/{name}"] = t = timing(name, SHAPES[shape], device, args.sides)
            print(shape, name, json.dumps(t), flush=True)
        with open(os.path.join(args.out, "fla_seed.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
