"""HDLA's four chunk Grams as one Gram product and a 2 x 2 mixing (tests/hdla_single_gram_reference.py), in
float64: the same M_QK, M_QA, L_AB, L_KB as the Grams of the rank stacks A, B (tests/chunk_bwd_reference.py),
and the mixing's hand-written VJP equal to autograd's."""
import pytest
import torch
import torch.nn.functional as F

from hdla_vision.kernels.hdla.naive import hdla_decay_factors
from tests.chunk_bwd_reference import chunk_intermediates
from tests.hdla_single_gram_reference import BASES, base_grams, mix, mix_vjp
from tests.oracle import rel_err

SCALE = 0.7
GRAMS = ("M_QK", "M_QA", "L_AB", "L_KB")


def _chunk(c, gates, seed, heads=3):
    """One chunk per head ``[heads, C, ...]``: unit k, beta with 0 and 2 among its values, log-decays in ``gates``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, c, 8, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(heads, c, 8, generator=gen, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(heads, c, generator=gen, dtype=torch.float64)
    beta[:, ::5], beta[:, 1::5] = 0.0, 2.0
    lo, hi = gates
    g = lo + (hi - lo) * torch.rand(heads, c, 8, generator=gen, dtype=torch.float64)
    return q, k, beta, g


def _direct(q, k, beta, g):
    """The four Grams over the rank stacks A = [beta u, k], B = [k, beta u - beta^2 s k]."""
    a, b = hdla_decay_factors(k, beta, g)
    v = torch.zeros_like(k).unsqueeze(-2)
    z = chunk_intermediates(q, k.unsqueeze(-2), v, a, b, g, SCALE)
    return {name: z[name] for name in GRAMS}


def _single(q, k, beta, g):
    s = (g.exp() * k * k).sum(-1)
    return mix(base_grams(q, k, g, SCALE), beta, s)


@pytest.mark.parametrize("c", [16, 32])
@pytest.mark.parametrize("gates", [(-1.0, 0.0), (-20.0, 0.0)])
def test_single_gram_product_equals_the_rank_stack_grams(c, gates):
    """Six base Grams of the [k e^G'; k e^G; q e^G] rows against the [k e^-G; k e^-G'] columns, mixed with
    beta and s, give M_QK, M_QA, L_AB and L_KB to float64 rounding, for mild and fast gates and beta at 0 and 2."""
    q, k, beta, g = _chunk(c, gates, seed=c)
    direct, single = _direct(q, k, beta, g), _single(q, k, beta, g)
    for name in GRAMS:
        assert single[name].shape == direct[name].shape, name
        assert rel_err(single[name], direct[name]) < 1e-12, (name, rel_err(single[name], direct[name]))


@pytest.mark.parametrize("c", [16, 32])
def test_mixing_vjp_equals_autograd(c):
    """mix_vjp's cotangents of the six base Grams, of beta and of s equal autograd's through mix."""
    q, k, beta, g = _chunk(c, (-3.0, 0.0), seed=100 + c)
    s = (g.exp() * k * k).sum(-1).requires_grad_()
    base = {n: x.requires_grad_() for n, x in base_grams(q, k, g, SCALE).items()}
    beta = beta.requires_grad_()
    out = mix(base, beta, s)
    gen = torch.Generator().manual_seed(7)
    D = {n: torch.randn(out[n].shape, generator=gen, dtype=torch.float64) for n in GRAMS}
    auto = torch.autograd.grad(sum((out[n] * D[n]).sum() for n in GRAMS), [base[n] for n in BASES] + [beta, s])
    d_base, dbeta, ds = mix_vjp({n: x.detach() for n, x in base.items()}, beta.detach(), s.detach(), D)
    for name, ref in zip(BASES, auto):
        assert rel_err(d_base[name], ref) < 1e-12, name
    assert rel_err(dbeta, auto[-2]) < 1e-12 and rel_err(ds, auto[-1]) < 1e-12


def test_single_gram_route_has_the_rank_stack_gradients():
    """Through the single product and the mixing, the gradients of the four Grams' weighted sum with respect
    to q, k, beta and g equal those through the rank stacks."""
    q, k, beta, g = (x.requires_grad_() for x in _chunk(32, (-20.0, 0.0), seed=3))
    gen = torch.Generator().manual_seed(11)
    direct = _direct(q, k, beta, g)
    D = {n: torch.randn(direct[n].shape, generator=gen, dtype=torch.float64) for n in GRAMS}
    want = torch.autograd.grad(sum((direct[n] * D[n]).sum() for n in GRAMS), (q, k, beta, g))
    single = _single(q, k, beta, g)
    got = torch.autograd.grad(sum((single[n] * D[n]).sum() for n in GRAMS), (q, k, beta, g))
    for name, a, b in zip("q k beta g".split(), got, want):
        assert rel_err(a, b) < 1e-11, (name, rel_err(a, b))
