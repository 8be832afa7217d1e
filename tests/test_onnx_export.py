"""ONNX export: the exportable decomposition of the ops (chunk form with the block-doubling
inverse) against the float64 token loop, and exported backbones run by onnxruntime against eager."""
import pytest
import torch

from hdla_vision.kernels import naive_generalized, naive_hdla
from hdla_vision.kernels.generalized.torch_chunk import doubling_unit_lower, solve_unit_lower
from hdla_vision.kernels.ops import exportable_generalized, exportable_hdla
from tests.oracle import generalized_problem, hdla_problem, rel_err


@pytest.mark.parametrize("tokens,rank", [(16, 1), (16, 2), (16, 3), (5, 2), (1, 1)])
def test_doubling_inverse_equals_triangular_solve(tokens, rank):
    """(I + L)^{-1} by block doubling equals solve_triangular's for strictly lower block-triangular L
    (r x r blocks on the diagonal are 0), chunk sizes that are and are not powers of two."""
    gen = torch.Generator().manual_seed(0)
    size = tokens * rank
    tok = torch.arange(size) // rank
    lmat = torch.randn(3, size, size, generator=gen, dtype=torch.float64) * 0.5
    lmat = lmat.masked_fill(~(tok[:, None] > tok[None, :]), 0.0)
    inv = doubling_unit_lower(lmat, rank)
    eye = torch.eye(size, dtype=torch.float64)
    assert rel_err(inv, solve_unit_lower(lmat, rank)) < 1e-12
    assert rel_err((eye + lmat) @ inv, eye.expand(3, -1, -1)) < 1e-12


GEN_CASES = [  # (batch, T, H, K, V, r_kv, r_ab, g_min, per_head_g, resets, reverse)
    (2, 37, 2, 8, 6, 1, 2, -3.0, False, 0.0, False),
    (1, 50, 2, 16, 8, 2, 3, -20.0, False, 0.1, True),
    (1, 33, 2, 8, 8, 1, 1, -3.0, True, 0.0, True),
    (1, 20, 1, 8, 8, 1, 0, -3.0, False, 0.0, False),
]


@pytest.mark.parametrize("batch,seq_len,heads,dk,dv,r_kv,r_ab,g_min,per_head_g,resets,reverse", GEN_CASES)
def test_exportable_generalized_matches_loop(batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min, per_head_g,
                                             resets, reverse):
    """fp32 exportable form (output and final state) against the float64 loop; resets are g = -inf."""
    p = generalized_problem(batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min=g_min, per_head_g=per_head_g,
                            resets=resets)
    ref_o, ref_s = naive_generalized(**p, scale=0.5, output_final_state=True, reverse=reverse)
    f = {n: x.float() for n, x in p.items()}
    o, s = exportable_generalized(f["q"], f["k"], f["v"], f["a"], f["b"], f["g"], 0.5, f["initial_state"], reverse)
    assert o.dtype == torch.float32 and rel_err(o, ref_o) < 1e-4 and rel_err(s, ref_s) < 1e-4


@pytest.mark.parametrize("reverse", [False, True])
def test_exportable_hdla_matches_loop(reverse):
    p = hdla_problem(2, 45, 2, 16, 8, g_min=-8.0, resets=0.05)
    ref_o, ref_s = naive_hdla(**p, output_final_state=True, reverse=reverse)
    f = {n: x.float() for n, x in p.items()}
    o, s = exportable_hdla(f["q"], f["k"], f["v"], f["beta"], f["g"], 1.0, f["initial_state"], reverse)
    assert rel_err(o, ref_o) < 1e-4 and rel_err(s, ref_s) < 1e-4
