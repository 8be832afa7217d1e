"""chunk_hdla on CPU tensors against HDLA's own loop (explicit Householder products), and the
A/B factorisation against the generalized op."""
import pytest
import torch

from hdla_vision.kernels import chunk_hdla, hdla_decay_factors, naive_generalized, naive_hdla
from tests.oracle import compare_with_loop, hdla_problem, rel_err


@pytest.mark.parametrize("batch,seq_len,heads,dk,dv,g_min,h0,reverse", [
    (2, 37, 2, 8, 8, -3.0, True, False),
    (1, 21, 1, 16, 8, -20.0, True, True),
    (1, 1, 1, 8, 4, -1.0, False, True),
    (3, 70, 2, 8, 16, -0.01, True, False),
])
def test_torch_path_matches_householder_loop(batch, seq_len, heads, dk, dv, g_min, h0, reverse):
    inputs = hdla_problem(batch, seq_len, heads, dk, dv, g_min=g_min, h0=h0)
    errors = compare_with_loop(chunk_hdla, "hdla", inputs, reverse=reverse)
    assert all(err < 1e-4 for err in errors.values()), errors


def test_decay_factors_reproduce_the_householder_sandwich():
    p = hdla_problem(1, 3, 2, 8, 4)
    a, b = hdla_decay_factors(p["k"], p["beta"], p["g"])
    eye = torch.eye(8, dtype=torch.float64)
    for t in range(3):
        for h in range(2):
            k, beta, lam = p["k"][0, t, h], p["beta"][0, t, h], p["g"][0, t, h].exp()
            house = eye - beta * torch.outer(k, k)
            expected = house @ torch.diag(lam) @ house
            got = torch.diag(lam) - a[0, t, h].T @ b[0, t, h]
            assert torch.allclose(got, expected, atol=1e-12)


def test_hdla_equals_generalized_op_with_its_factors():
    p = hdla_problem(2, 19, 2, 8, 8)
    a, b = hdla_decay_factors(p["k"], p["beta"], p["g"])
    o1, s1 = naive_hdla(**p, output_final_state=True)
    o2, s2 = naive_generalized(p["q"], p["k"].unsqueeze(3), p["v"].unsqueeze(3), a, b, p["g"],
                               initial_state=p["initial_state"], output_final_state=True)
    assert rel_err(o1, o2) < 1e-12 and rel_err(s1, s2) < 1e-12


def test_bf16_inputs_return_bf16():
    p = {n: x.bfloat16() for n, x in hdla_problem(1, 20, 1, 8, 8).items()}
    o, s = chunk_hdla(**p, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.bfloat16 and torch.isfinite(o.float()).all()


@pytest.mark.parametrize("over,needle", [
    (dict(beta=torch.rand(1, 4, 3)), "beta must have shape [B, T, H]"),
    (dict(k=torch.randn(1, 4, 2, 9)), "k must have shape [B, T, H, K]"),
    (dict(v=torch.randn(1, 4, 2, 1, 8)), "v must have shape [B, T, H, V]"),
    (dict(g="x"), "g must be a torch.Tensor"),
])
def test_bad_input(over, needle):
    p = {n: x.float() for n, x in hdla_problem(1, 4, 2, 8, 8).items()}
    p.update(over)
    with pytest.raises(ValueError) as info:
        chunk_hdla(**p)
    assert needle in str(info.value)
