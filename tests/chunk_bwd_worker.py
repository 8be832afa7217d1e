"""Runs the backward kernels of ``kernels/generalized/bwd.py`` under TRITON_INTERPRET=1 (fp32, CPU) and
prints, as JSON, each case's relative errors against autograd through the float64 token loop. Started
in a subprocess by tests/test_chunk_bwd_kernels.py (Triton reads TRITON_INTERPRET when a kernel is
decorated); never import it from a test."""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kernels.generalized.bwd import _chunk_prepare, generalized_backward  # noqa: E402
from kernels.generalized.fwd import chunk_state_pass  # noqa: E402
from kernels.generalized.naive import naive_generalized  # noqa: E402
from kernels.hdla.naive import naive_hdla  # noqa: E402
from tests.chunk_bwd_cases import CASES, SCALE  # noqa: E402
from tests.oracle import generalized_problem, hdla_problem, rel_err  # noqa: E402


def _run(kind, problem, chunk, reverse, with_dht):
    make = hdla_problem if kind == "hdla" else generalized_problem
    p = make(**problem)
    names = ["q", "k", "v", "beta", "g"] if kind == "hdla" else ["q", "k", "v", "a", "b", "g"]
    if kind == "hdla" and chunk == 32:
        p["beta"][..., ::3] = 0.0  # beta at both ends of its range
        p["beta"][..., 1::3] = 2.0
    ins = [p[n].clone().requires_grad_() for n in names]
    h0 = p["initial_state"]
    h0_leaf = None if h0 is None else h0.clone().requires_grad_()
    loop = naive_hdla if kind == "hdla" else naive_generalized
    o, s = loop(*ins, SCALE, h0_leaf, True, reverse)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(s.shape, generator=gen, dtype=s.dtype) if with_dht else None
    loss = (o * do).sum() + ((s * dht).sum() if with_dht else 0.0)
    ref = torch.autograd.grad(loss, ins + ([h0_leaf] if h0 is not None else []))
    f = {n: p[n].float() for n in names}
    h0f = None if h0 is None else h0.float()
    if kind == "hdla":
        args = (f["q"], f["k"], f["v"], None, None, f["g"])
        prep = _chunk_prepare(*args, SCALE, reverse, hdla_beta=f["beta"], chunk=chunk)
    else:
        args = tuple(f[n] for n in names)
        prep = _chunk_prepare(*args, SCALE, reverse, chunk=chunk)
    h, _ = chunk_state_pass(prep, h0f)
    out = generalized_backward(do.float(), None if dht is None else dht.float(), *args, SCALE, h0f, h, reverse,
                               hdla_beta=f.get("beta"), prep=prep)
    grad_names = names + (["h0"] if h0 is not None else [])
    return {n: rel_err(m, r) for n, m, r in zip(grad_names, out[:len(names)] + out[-1:], ref)}


def main(names):
    results = {name: _run(*case) for name, case in CASES.items() if not names or name in names}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
