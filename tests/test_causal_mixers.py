"""Gated DeltaNet / Gated DeltaProduct as generalized steps: the merged factors against the sub-step loop."""
import pytest
import torch
import torch.nn.functional as F

from hdla_vision.kernels import chunk_generalized, naive_generalized
from hdla_vision.layers.seed_mixers import gated_deltaproduct_factors


def substep_loop(q, k, v, beta, log_alpha, scale):
    """Token loop of the definition: S <- alpha S, then n_h delta-rule sub-steps, o = scale S^T q (float64)."""
    batch, seq_len, heads, n, dk = k.shape
    state = q.new_zeros(batch, heads, dk, v.shape[-1])
    outputs = []
    for t in range(seq_len):
        state = log_alpha[:, t].exp()[..., None, None] * state
        for j in range(n):
            kj, vj, bj = k[:, t, :, j], v[:, t, :, j], beta[:, t, :, j, None, None]
            read = torch.einsum("bhk,bhkv->bhv", kj, state)
            state = state - bj * kj.unsqueeze(-1) * read.unsqueeze(-2) + bj * kj.unsqueeze(-1) * vj.unsqueeze(-2)
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, 1), state


def random_inputs(n, seq_len=11, beta_range=2.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, dk, dv = 2, 2, 8, 6
    q = torch.randn(batch, seq_len, heads, dk, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(batch, seq_len, heads, n, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(batch, seq_len, heads, n, dv, generator=gen, dtype=torch.float64)
    beta = beta_range * torch.rand(batch, seq_len, heads, n, generator=gen, dtype=torch.float64)
    log_alpha = -torch.rand(batch, seq_len, heads, generator=gen, dtype=torch.float64)
    return q, k, v, beta, log_alpha


@pytest.mark.parametrize("per_head", [True, False], ids=["g_BTH", "g_BTHK"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_merged_factors_equal_the_substep_loop(n, per_head):
    """g per head [B, T, H] (as the mixers pass it) or broadcast to [B, T, H, K]: both are accepted."""
    q, k, v, beta, log_alpha = random_inputs(n)
    g = log_alpha if per_head else log_alpha.unsqueeze(-1).expand(*log_alpha.shape, q.shape[-1])
    a, b, kw, vw = gated_deltaproduct_factors(k, v, beta, g)
    assert a.shape == b.shape == kw.shape == k.shape and torch.equal(vw, v)
    o_ref, s_ref = substep_loop(q, k, v, beta, log_alpha, 0.5)
    o, s = naive_generalized(q, kw, vw, a, b, g, 0.5, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)
    o_chunk, s_chunk = chunk_generalized(q.float(), kw.float(), vw.float(), a.float(), b.float(), g.float(), 0.5,
                                         output_final_state=True)
    torch.testing.assert_close(o_chunk.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_chunk.double(), s_ref, rtol=1e-4, atol=1e-4)


def test_two_householder_factors_written_out():
    """n_h = 2 closed form: A = [a b1 k1, a b2 k2], B = [k1, k2 - b1 (k1.k2) k1], K = [b1 (k1 - b2 (k2.k1) k2), b2 k2]."""
    _, k, v, beta, log_alpha = random_inputs(2, seq_len=3)
    g = log_alpha.unsqueeze(-1).expand(*log_alpha.shape, k.shape[-1])
    a, b, kw, _ = gated_deltaproduct_factors(k, v, beta, g)
    k1, k2, b1, b2 = k[..., 0, :], k[..., 1, :], beta[..., :1], beta[..., 1:]
    alpha, dot = log_alpha.exp().unsqueeze(-1), (k1 * k2).sum(-1, keepdim=True)
    torch.testing.assert_close(a, torch.stack([alpha * b1 * k1, alpha * b2 * k2], -2))
    torch.testing.assert_close(b, torch.stack([k1, k2 - b1 * dot * k1], -2))
    torch.testing.assert_close(kw, torch.stack([b1 * (k1 - b2 * dot * k2), b2 * k2], -2))


def test_gated_deltanet_is_the_one_step_case():
    """n_h = 1: S_t = alpha (I - b k k^T) S + b k v^T (the Gated DeltaNet row of table in kernels/README.md §2)."""
    q, k, v, beta, log_alpha = random_inputs(1)
    g = log_alpha.unsqueeze(-1).expand(*log_alpha.shape, q.shape[-1])
    a, b, kw, _ = gated_deltaproduct_factors(k, v, beta, g)
    alpha = log_alpha.exp()[..., None, None]
    torch.testing.assert_close(a, alpha * beta.unsqueeze(-1) * k)
    torch.testing.assert_close(b, k)
    torch.testing.assert_close(kw, beta.unsqueeze(-1) * k)


def test_deltaproduct_mixer_rejects_bad_num_householder():
    from hdla_vision.layers import create_mixer

    with pytest.raises(ValueError, match="num_householder"):
        create_mixer("gated_deltaproduct", dim=16, num_heads=2, head_dim=8, directions=("fwd",), num_householder=0)


@pytest.mark.parametrize("name,kwargs,per_head", [
    ("gated_deltanet", {}, True), ("gated_deltaproduct", {}, True), ("hih_gated_deltanet", {"groups": 2}, True),
    ("hih_deltanet", {"groups": 2}, True), ("deltanet", {}, True), ("kda", {}, False), ("gla", {}, False),
])
def test_causal_mixers_pass_g_per_head_where_the_decay_is_scalar(name, kwargs, per_head, monkeypatch):
    """Prefill hands chunk_generalized g [B, T, H] for a per-head decay, [B, T, H, K] for a per-channel one."""
    import hdla_vision.layers.seed as seed
    from hdla_vision.layers import create_mixer

    shapes = []

    def recording(q, k, v, a, b, g, **kw):
        shapes.append(tuple(g.shape))
        return chunk_generalized(q, k, v, a, b, g, **kw)

    monkeypatch.setattr(seed, "chunk_generalized", recording)
    torch.manual_seed(0)
    mixer = create_mixer(name, dim=16, num_heads=2, head_dim=8, directions=("fwd",), **kwargs)
    mixer(torch.randn(2, 5, 16)).sum().backward()
    assert shapes == [(2, 5, 2) if per_head else (2, 5, 2, 8)]
