"""Runs the backward kernels of ``kernels/generalized/bwd.py`` under TRITON_INTERPRET=1 (CPU) and prints, as
JSON, each case's relative errors against autograd through the float64 token loop. Started in a
subprocess by tests/test_chunk_bwd_kernels.py (Triton reads TRITON_INTERPRET when a kernel is decorated);
never import it from a test.

    python -m tests.chunk_bwd_worker [NAME ...]          # CASES (fp32)
    python -m tests.chunk_bwd_worker --diag [NAME ...]   # DIAG_CASES: default and forced token loop, paths
    python -m tests.chunk_bwd_worker --scratch [NAME ...]   # SCRATCH_CASES: fp16, B2's scratch fp32 and 16-bit
    python -m tests.chunk_bwd_worker --pool [NAME ...]      # POOL_CASES: B2's scratch pooled and apart, NaN-filled
    python -m tests.chunk_bwd_worker --single-gram [NAME ...]   # SINGLE_GRAM_CASES: HDLA's S2, base Grams vs rank stacks
"""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from hdla_vision.kernels.generalized.bwd import generalized_backward  # noqa: E402
from hdla_vision.kernels.generalized.fwd import chunk_prepare, chunk_state_pass  # noqa: E402
from hdla_vision.kernels.generalized.naive import naive_generalized  # noqa: E402
from hdla_vision.kernels.hdla.naive import naive_hdla  # noqa: E402
from tests.chunk_bwd_cases import (CASES, DIAG_CASES, POOL_CASES, SCALE, SCRATCH_CASES, SINGLE_GRAM_CASES,  # noqa: E402
                                   diag_gates)  # noqa: E402
from tests.oracle import generalized_problem, hdla_problem, rel_err  # noqa: E402


def _names(kind):
    return ["q", "k", "v", "beta", "g"] if kind == "hdla" else ["q", "k", "v", "a", "b", "g"]


def _loop_grads(kind, p, reverse, with_dht):
    """(do, dht, gradients of every input and h0) by autograd through the float64 token loop."""
    names = _names(kind)
    ins = [p[n].clone().requires_grad_() for n in names]
    h0 = p["initial_state"]
    h0_leaf = None if h0 is None else h0.clone().requires_grad_()
    loop = naive_hdla if kind == "hdla" else naive_generalized
    o, s = loop(*ins, SCALE, h0_leaf, True, reverse)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(s.shape, generator=gen, dtype=s.dtype) if with_dht else None
    loss = (o * do).sum() + ((s * dht).sum() if with_dht else 0.0)
    return do, dht, torch.autograd.grad(loss, ins + ([h0_leaf] if h0 is not None else []))


def _kernel_grads(kind, p, chunk, reverse, do, dht, dtype=torch.float32, **b2):
    """The kernels' gradients (forward prep and state pass, then B1 and B2) on p cast to dtype, in the
    order of :func:`_loop_grads`; ``b2``: generalized_backward's diag_limit / diag_paths."""
    names = _names(kind)
    f = {n: p[n].to(dtype) for n in names}
    h0 = p["initial_state"]
    h0f = None if h0 is None else h0.float()
    if kind == "hdla":
        args, beta = (f["q"], f["k"], f["v"], None, None, f["g"]), f["beta"]
    else:
        args, beta = tuple(f[n] for n in names), None
    prep = chunk_prepare(*args, SCALE, reverse, hdla_beta=beta, chunk=chunk)
    h, _ = chunk_state_pass(prep, h0f)
    out = generalized_backward(do.to(dtype), None if dht is None else dht.float(), *args, SCALE, h0f, h, reverse,
                               hdla_beta=beta, **b2)
    return out[:len(names)] + (out[-1:] if h0 is not None else ())


def _run(kind, problem, chunk, reverse, with_dht):
    make = hdla_problem if kind == "hdla" else generalized_problem
    p = make(**problem)
    if kind == "hdla" and chunk == 32:
        p["beta"][..., ::3] = 0.0  # beta at both ends of its range
        p["beta"][..., 1::3] = 2.0
    do, dht, ref = _loop_grads(kind, p, reverse, with_dht)
    out = _kernel_grads(kind, p, chunk, reverse, do, dht)
    grad_names = _names(kind) + (["h0"] if p["initial_state"] is not None else [])
    return {n: rel_err(m, r) for n, m, r in zip(grad_names, out, ref)}


def _run_diag(kind, problem, chunk, reverse, dtype, gates):
    """One DIAG_CASES entry: errors with the default limit and with every diagonal block forced through
    the token loop (diag_limit 0), their difference, and the paths each took (S2 and S5a after their
    levels passes)."""
    make = hdla_problem if kind == "hdla" else generalized_problem
    p = make(**problem)
    p["g"] = diag_gates(p["g"].shape, reverse, **gates)
    dtype = getattr(torch, dtype)
    if dtype != torch.float32:  # the loop on exactly what the kernels receive
        p = {n: None if x is None else x.to(dtype).double() for n, x in p.items()}
    do, dht, ref = _loop_grads(kind, p, reverse, True)
    grad_names = _names(kind) + ["h0"]
    result = {}
    runs = {}
    for label, limit in (("default", None), ("loop", 0.0)):
        paths = {}
        runs[label] = _kernel_grads(kind, p, chunk, reverse, do, dht, dtype, diag_limit=limit, diag_paths=paths)
        result[label] = {n: rel_err(m, r) for n, m, r in zip(grad_names, runs[label], ref)}
        result[label + "_paths"] = {name: t.tolist() for name, t in paths.items()}
    result["default_vs_loop"] = {n: rel_err(m, r) for n, m, r in zip(grad_names, runs["default"], runs["loop"])}
    return result


def _run_scratch(kind, problem, chunk, reverse, gates=None):
    """One SCRATCH_CASES entry on fp16 inputs, B2 with every scratch tensor fp32 and with the operand-only
    ones 16-bit ($HDLA_VISION_B2_SCRATCH "lowp"), and with the stacks that copy inputs 16-bit too ("lowp_stacks"):
    per gradient and 16-bit mode, whether it is bit-identical to the fp32 run, the largest difference, and the
    16-bit run's error against the float64 loop; and the scratch tensors each mode holds in 16 bits."""
    from hdla_vision.kernels.generalized.bwd_chunk import scratch_dtypes

    make = hdla_problem if kind == "hdla" else generalized_problem
    p = make(**problem)
    if gates is not None:
        p["g"] = diag_gates(p["g"].shape, reverse, **gates)
    p = {n: None if x is None else x.half().double() for n, x in p.items()}  # what the kernels get
    do, dht, ref = _loop_grads(kind, p, reverse, True)
    runs, result = {}, {}
    grad_names = _names(kind) + ["h0"]
    r_ab = 2 if kind == "hdla" else problem["r_ab"]
    for mode in ("fp32", "lowp", "lowp_stacks"):
        os.environ["HDLA_VISION_B2_SCRATCH"] = mode
        runs[mode] = _kernel_grads(kind, p, chunk, reverse, do, dht, torch.float16)
        if mode != "fp32":
            result[mode] = {
                "identical": {n: torch.equal(m, r) for n, m, r in zip(grad_names, runs[mode], runs["fp32"])},
                "max_diff": {n: (m.double() - r.double()).abs().max().item() if m.numel() else 0.0
                             for n, m, r in zip(grad_names, runs[mode], runs["fp32"])},
                "error": {n: rel_err(m, r) for n, m, r in zip(grad_names, runs[mode], ref)},
                "scratch": sorted(scratch_dtypes(torch.float16, torch.float16, r_ab, kind == "hdla", True))}
    del os.environ["HDLA_VISION_B2_SCRATCH"]
    return result


def _run_pool(kind, problem, chunk, reverse, dtype, gates):
    """One POOL_CASES entry: the gradients with B2's scratch carved from the planned pool and with one
    allocation per tensor, all scratch memory NaN before B2 runs: per gradient, whether the two are
    bit-identical and finite, and the pooled run's error against the float64 loop; and whether the pooled run
    with S4's products in one launch each (b2_config's s4_group 1) gives the same bits as its grouped launches."""
    from hdla_vision.kernels.generalized import bwd_chunk

    make = hdla_problem if kind == "hdla" else generalized_problem
    p = make(**problem)
    if gates is not None:
        p["g"] = diag_gates(p["g"].shape, reverse, **gates)
    dtype = getattr(torch, dtype)
    if dtype != torch.float32:
        p = {n: None if x is None else x.to(dtype).double() for n, x in p.items()}
    do, dht, ref = _loop_grads(kind, p, reverse, True)
    real = bwd_chunk._scratch_bytes
    bwd_chunk._scratch_bytes = lambda n, device: real(n, device).fill_(255)  # 0xFF..: NaN in fp32, fp16, bf16
    runs = {}
    for pool in (False, True):
        bwd_chunk.SCRATCH_POOL = pool
        runs[pool] = _kernel_grads(kind, p, chunk, reverse, do, dht, dtype)
    config = bwd_chunk.b2_config
    bwd_chunk.b2_config = lambda *a, **k: dict(config(*a, **k), s4_group=1)
    runs["s4_single"] = _kernel_grads(kind, p, chunk, reverse, do, dht, dtype)
    bwd_chunk.b2_config, bwd_chunk._scratch_bytes, bwd_chunk.SCRATCH_POOL = config, real, True
    names = _names(kind) + ["h0"]
    return {"identical": {n: torch.equal(m, r) for n, m, r in zip(names, runs[True], runs[False])},
            "s4_single_identical": {n: torch.equal(m, r) for n, m, r in zip(names, runs["s4_single"], runs[True])},
            "finite": {n: bool(torch.isfinite(m).all()) for n, m in zip(names, runs[True])},
            "error": {n: rel_err(m, r) for n, m, r in zip(names, runs[True], ref)}}


def _run_single_gram(problem, chunk, reverse, dtype, gates):
    """One SINGLE_GRAM_CASES entry (HDLA): S2's four Grams and S5a's stack gradients (after S5b) from the six base
    Grams (``_hdla_gram_kernel``, ``_hdla_gram_vjp_kernel``, the default) and from the rank stacks
    (``$HDLA_VISION_HDLA_GRAM=0``), each scratch tensor apart so that they survive the backward: per Gram and per
    gradient buffer the relative difference (gk plus A's rank-1 rows of ga, gradients of the same column k e^-G,
    which the single launch stores in gk, leaving 0 in ga where S5b adds nothing), whether the
    paths recorded after S2b agree per block (the largest over its K tiles: the two take different tiles), how many block tiles took the levels, and the default run's gradient errors
    against the float64 loop."""
    from hdla_vision.kernels.generalized import bwd_chunk

    p = hdla_problem(**problem)
    if gates is not None:
        p["g"] = diag_gates(p["g"].shape, reverse, **gates)
    dtype = getattr(torch, dtype)
    if dtype != torch.float32:
        p = {n: None if x is None else x.to(dtype).double() for n, x in p.items()}
    do, dht, ref = _loop_grads("hdla", p, reverse, True)
    real_alloc = bwd_chunk.allocate_scratch
    runs = {}
    for flag in ("1", "0"):
        os.environ["HDLA_VISION_HDLA_GRAM"] = flag
        seen, paths = {}, {}
        bwd_chunk.allocate_scratch = lambda *a, **kw: seen.setdefault("z", real_alloc(*a, **dict(kw, pool=False)))
        grads = _kernel_grads("hdla", p, chunk, reverse, do, dht, dtype, diag_paths=paths)
        runs[flag] = ({n: seen["z"][n].float() for n in ("mqk", "mqa", "lab", "lkb", "gq", "gk", "ga", "gb")}, grads,
                      paths)
    bwd_chunk.allocate_scratch = real_alloc
    del os.environ["HDLA_VISION_HDLA_GRAM"]
    names = _names("hdla") + ["h0"]
    new, old = runs["1"][0], runs["0"][0]
    rank0 = lambda x: x.unflatten(1, (-1, 2))[:, :, 0]  # noqa: E731  A's rank-0 rows of ga [blocks, 2C, K]
    rank1 = lambda x: x.unflatten(1, (-1, 2))[:, :, 1]  # noqa: E731  A's rank-1 rows (S5b's levels add there)
    return {"gram_diff": {n: rel_err(new[n], old[n]) for n in ("mqk", "mqa", "lab", "lkb")},
            "vjp_diff": dict(gq=rel_err(new["gq"], old["gq"]), gb=rel_err(new["gb"], old["gb"]),
                             ga0=rel_err(rank0(new["ga"]), rank0(old["ga"])),
                             gk=rel_err(new["gk"] + rank1(new["ga"]), old["gk"] + rank1(old["ga"])),
                             ga1_max=float(rank1(new["ga"]).abs().max())),
            "paths_equal": bool(torch.equal(runs["1"][2]["gram"].amax(-1), runs["0"][2]["gram"].amax(-1))),
            "vjp_paths_equal": bool(torch.equal(runs["1"][2]["gram_vjp"], runs["0"][2]["gram_vjp"])),
            "levels_taken": int((runs["1"][2]["gram"] >= 2).sum()),
            "vjp_levels_taken": int((runs["1"][2]["gram_vjp"] >= 2).sum()),
            "error": {n: rel_err(m, r) for n, m, r in zip(names, runs["1"][1], ref)}}


def main(args):
    modes = {"--diag": (DIAG_CASES, _run_diag), "--scratch": (SCRATCH_CASES, _run_scratch),
             "--pool": (POOL_CASES, _run_pool), "--single-gram": (SINGLE_GRAM_CASES, _run_single_gram)}
    names = [a for a in args if a not in modes]
    cases, run = next((modes[a] for a in args if a in modes), (CASES, _run))
    json.dump({name: run(*case) for name, case in cases.items() if not names or name in names}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
