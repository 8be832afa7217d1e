"""Seed mixers on the generalized op against each paper's own recurrence (float64 token loops).

Every oracle below is written from the mixer's paper with explicit K x K transition matrices
(RWKV-7 with its own V x K state orientation), never from our (A, B, d, K, V) factorisation.
The op under test is ``chunk_generalized`` (the vectorised chunk form on CPU), forward and
reversed, outputs and the gradients of every raw input.
"""
import pytest
import torch
import torch.nn.functional as F

from hdla_vision.kernels import chunk_generalized
from hdla_vision.layers import seed_mixers as sm

B, T, H, K, V = 2, 37, 2, 8, 4  # T spans three 16-token chunks, the last one partial
SCALE = 0.7
TOL = dict(rtol=1e-9, atol=1e-10)


def _eye():
    return torch.eye(K, dtype=torch.float64)


def _outer(x, y):
    """``[B, H, K] x [B, H, L] -> [B, H, K, L]``."""
    return x.unsqueeze(-1) * y.unsqueeze(-2)


def token_loop(step, q, reverse, state_shape=(B, H, K, V), read=None):
    """Run ``state = step(state, t)`` over t (reversed if asked); ``o_t = SCALE * read(state, q_t)``."""
    read = read or (lambda s, qt: torch.einsum("bhkv,bhk->bhv", s, qt))
    state = torch.zeros(state_shape, dtype=torch.float64)
    out = [None] * T
    for t in (reversed(range(T)) if reverse else range(T)):
        state = step(state, t)
        out[t] = SCALE * read(state, q[:, t])
    return torch.stack(out, dim=1)


def _raw(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()


# --- each mixer: (raw inputs, constrained per-token quantities, our op, the paper's recurrence) ----------
def make_inputs(gen, n=1, r=4):
    """Raw leaves (gradients are taken w.r.t. these)."""
    return {
        "q": _raw(B, T, H, K, gen=gen), "k": _raw(B, T, H, K, gen=gen), "v": _raw(B, T, H, V, gen=gen),
        "k_n": _raw(B, T, H, n, K, gen=gen), "v_n": _raw(B, T, H, n, V, gen=gen),
        "beta": _raw(B, T, H, gen=gen), "beta_n": _raw(B, T, H, n, gen=gen),
        "gate_vec": _raw(B, T, H, K, gen=gen), "gate_head": _raw(B, T, H, gen=gen),
        "kappa": _raw(B, T, H, K, gen=gen), "icl": _raw(B, T, H, K, gen=gen),
        "mask": _raw(H, r, r, gen=gen), "mask_dd": _raw(B, T, H, r, r, gen=gen),
    }


def unit(x):
    return F.normalize(x, dim=-1)


def gla(raw, reverse):
    g = F.logsigmoid(raw["gate_vec"]) / 4
    ours = sm.gla_factors(raw["k"], raw["v"], g)

    def step(s, t):  # S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T
        return g[:, t].exp().unsqueeze(-1) * s + _outer(raw["k"][:, t], raw["v"][:, t])

    return ours, token_loop(step, raw["q"], reverse)


def deltanet(raw, reverse):
    k, beta = unit(raw["k"]), torch.sigmoid(raw["beta"])
    ours = sm.deltanet_factors(k, raw["v"], beta)

    def step(s, t):  # S_t = (I - beta k k^T) S_{t-1} + beta k v^T
        kt, bt = k[:, t], beta[:, t, :, None, None]
        return (_eye() - bt * _outer(kt, kt)) @ s + bt * _outer(kt, raw["v"][:, t])

    return ours, token_loop(step, raw["q"], reverse)


def gated_deltanet(raw, reverse):
    k, beta, log_alpha = unit(raw["k"]), torch.sigmoid(raw["beta"]), F.logsigmoid(raw["gate_head"])
    ours = sm.gated_deltanet_factors(k, raw["v"], beta, log_alpha)

    def step(s, t):  # S_t = alpha (I - beta k k^T) S_{t-1} + beta k v^T
        kt, bt, at = k[:, t], beta[:, t, :, None, None], log_alpha[:, t, :, None, None].exp()
        return at * (_eye() - bt * _outer(kt, kt)) @ s + bt * _outer(kt, raw["v"][:, t])

    return ours, token_loop(step, raw["q"], reverse)


def kda(raw, reverse):
    k, beta, g = unit(raw["k"]), torch.sigmoid(raw["beta"]), F.logsigmoid(raw["gate_vec"])
    ours = sm.kda_factors(k, raw["v"], beta, g)

    def step(s, t):  # S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T
        kt, bt = k[:, t], beta[:, t, :, None, None]
        transition = (_eye() - bt * _outer(kt, kt)) @ torch.diag_embed(g[:, t].exp())
        return transition @ s + bt * _outer(kt, raw["v"][:, t])

    return ours, token_loop(step, raw["q"], reverse)


def rwkv7(raw, reverse):
    kappa_hat, icl = unit(raw["kappa"]), torch.sigmoid(raw["icl"])
    log_w = -0.6065 * torch.sigmoid(raw["gate_vec"])  # RWKV-7: w = exp(-e^-0.5 sigmoid(.))
    ours = sm.rwkv7_factors(raw["k"], raw["v"], kappa_hat, icl, log_w)

    def step(wkv, t):  # paper, V x K state, row vectors: wkv_t = wkv_{t-1}(Diag(w) - kh^T (a*kh)) + v^T k
        kh = kappa_hat[:, t]
        transition = torch.diag_embed(log_w[:, t].exp()) - _outer(kh, icl[:, t] * kh)
        return wkv @ transition + _outer(raw["v"][:, t], raw["k"][:, t])

    def read(wkv, r):  # y = wkv r^T
        return torch.einsum("bhvk,bhk->bhv", wkv, r)

    return ours, token_loop(step, raw["q"], reverse, (B, H, V, K), read)


def gated_deltaproduct(raw, reverse):
    k, beta = unit(raw["k_n"]), torch.sigmoid(raw["beta_n"]) * 2  # DeltaProduct: beta in (0, 2)
    log_alpha = F.logsigmoid(raw["gate_head"])
    ours = sm.gated_deltaproduct_factors_5d(k, raw["v_n"], beta, log_alpha)

    def step(s, t):  # S <- alpha S; then n_h steps S <- (I - b_j k_j k_j^T) S + b_j k_j v_j^T
        s = log_alpha[:, t, :, None, None].exp() * s
        for j in range(k.shape[-2]):
            kj, bj = k[:, t, :, j], beta[:, t, :, j, None, None]
            s = (_eye() - bj * _outer(kj, kj)) @ s + bj * _outer(kj, raw["v_n"][:, t, :, j])
        return s

    return ours, token_loop(step, raw["q"], reverse)


def _head_in_head(raw, reverse, gated, data_dependent):
    k, beta = unit(raw["k"]), torch.sigmoid(raw["beta"])
    log_alpha = F.logsigmoid(raw["gate_head"]) if gated else None
    logits = raw["mask_dd"] if data_dependent else raw["mask"]
    ours = sm.head_in_head_factors(k, raw["v"], beta, sm.head_in_head_mask(logits), log_alpha)
    r = logits.shape[-1]

    def mask_at(t):  # M = M_org M_org^T (positive M_org, unit rows), expanded over K/r x K/r blocks
        m_org = F.normalize(F.softplus(logits[:, t] if data_dependent else logits), dim=-1)
        small = m_org @ m_org.transpose(-1, -2)
        return torch.kron(small, torch.ones(K // r, K // r, dtype=torch.float64))

    def step(s, t):  # S_t = alpha (I - beta (k k^T) o M) S_{t-1} + beta k v^T (paper eq. 10, appendix B)
        kt, bt = k[:, t], beta[:, t, :, None, None]
        transition = _eye() - bt * _outer(kt, kt) * mask_at(t)
        if gated:
            transition = log_alpha[:, t, :, None, None].exp() * transition
        return transition @ s + bt * _outer(kt, raw["v"][:, t])

    return ours, token_loop(step, raw["q"], reverse)


def hih_deltanet(raw, reverse):
    return _head_in_head(raw, reverse, gated=False, data_dependent=False)


def hih_gated_deltanet(raw, reverse):
    return _head_in_head(raw, reverse, gated=True, data_dependent=True)


CASES = {
    "gla": (gla, {}), "deltanet": (deltanet, {}), "gated_deltanet": (gated_deltanet, {}), "kda": (kda, {}),
    "rwkv7": (rwkv7, {}), "gdp2": (gated_deltaproduct, {"n": 2}), "gdp3": (gated_deltaproduct, {"n": 3}),
    "hih_deltanet_r4": (hih_deltanet, {"r": 4}), "hih_deltanet_r2": (hih_deltanet, {"r": 2}),
    "hih_gated_deltanet_r4": (hih_gated_deltanet, {"r": 4}),
}


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("name", list(CASES))
def test_factors_match_paper_recurrence(name, reverse):
    case, sizes = CASES[name]
    gen = torch.Generator().manual_seed(hash(name) % 2**31)
    raw = make_inputs(gen, **sizes)
    ours, expected = case(raw, reverse)
    got, _ = chunk_generalized(raw["q"], *ours, scale=SCALE, reverse=reverse)
    torch.testing.assert_close(got, expected, **TOL)

    weight = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    leaves = [t for t in raw.values()]
    grads_got = torch.autograd.grad((got * weight).sum(), leaves, allow_unused=True, retain_graph=True)
    grads_exp = torch.autograd.grad((expected * weight).sum(), leaves, allow_unused=True)
    used = 0
    for key, g_got, g_exp in zip(raw, grads_got, grads_exp):
        assert (g_got is None) == (g_exp is None), f"{key}: gradient reaches only one side"
        if g_exp is not None:
            used += 1
            torch.testing.assert_close(g_got, g_exp, **TOL, msg=lambda m: f"grad of {key}: {m}")
    assert used >= 3


def test_reversed_differs_from_forward():
    """Guard against a test that would pass with the direction ignored."""
    raw = make_inputs(torch.Generator().manual_seed(0))
    _, fwd = kda(raw, False)
    _, rev = kda(raw, True)
    assert (fwd - rev).abs().max() > 1e-3


def test_head_in_head_mask_bounds():
    m_org = sm.head_in_head_mask(torch.randn(3, 4, 4) * 3)
    mask = m_org @ m_org.transpose(-1, -2)
    assert torch.all(mask >= 0) and torch.all(mask <= 1 + 1e-6)
    torch.testing.assert_close(torch.diagonal(mask, dim1=-2, dim2=-1), torch.ones(3, 4))


def test_factor_shape_errors():
    k = torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match="beta"):
        sm.deltanet_factors(k, torch.randn(1, 5, 2, 4), torch.rand(1, 5, 3))
    with pytest.raises(ValueError, match="r dividing K"):
        sm.head_in_head_factors(k, torch.randn(1, 5, 2, 4), torch.rand(1, 5, 2), torch.rand(2, 3, 3))
    with pytest.raises(ValueError, match="one shape"):
        sm.gla_factors(k, torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4))
