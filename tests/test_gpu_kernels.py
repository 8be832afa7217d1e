"""GPU checks of the Triton kernels at realistic shapes (skipped without CUDA; run on the device):
bf16 against the float64 token loop (relative error < 1e-2), and HDLA against fla's
chunk_dplr_delta_rule over the doubled sequence (kernels/README.md §6) where fla is installed."""
import importlib.util

import pytest
import torch

from hdla_vision.kernels import chunk_generalized, chunk_hdla, naive_hdla
from tests.oracle import compare_with_loop, generalized_problem, hdla_problem, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda(problem):
    return {n: (None if x is None else x.cuda()) for n, x in problem.items()}


@pytest.mark.parametrize("batch,seq_len,heads,dim,g_min,h0,reverse", [
    (8, 196, 3, 64, -3.0, False, False),
    (8, 196, 3, 64, -3.0, True, True),
    (1, 1000, 2, 128, -1.0, True, False),
    (2, 333, 2, 64, -20.0, True, True),
    (1, 77, 1, 32, -0.001, False, False),
])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-2)])  # TF32 tensor-core products (~3e-3 measured)
def test_hdla_matches_loop(batch, seq_len, heads, dim, g_min, h0, reverse, dtype, tol):
    problem = _cuda(hdla_problem(batch, seq_len, heads, dim, dim, g_min=g_min, h0=h0))
    errors = compare_with_loop(chunk_hdla, "hdla", problem, reverse=reverse, dtype=dtype)
    assert all(err < tol for err in errors.values()), errors


@pytest.mark.parametrize("r_kv,r_ab,reverse", [(1, 0, False), (1, 1, True), (2, 2, False), (3, 3, True), (1, 4, False)])
def test_generalized_matches_loop_bf16(r_kv, r_ab, reverse):
    problem = _cuda(generalized_problem(2, 150, 2, 64, 64, r_kv, r_ab, g_min=-5.0))
    errors = compare_with_loop(chunk_generalized, "generalized", problem, reverse=reverse, dtype=torch.bfloat16)
    assert all(err < 1e-2 for err in errors.values()), errors


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
def test_hdla_matches_fla_dplr_over_doubled_sequence():
    from tools.fla_ops import fla_dplr_doubled

    problem = hdla_problem(2, 256, 2, 64, 64, h0=False, seed=3)
    q, k, v, beta, g = (problem[name].float().cuda() for name in ("q", "k", "v", "beta", "g"))
    ours = chunk_hdla(q, k, v, beta, g)[0]
    fla = fla_dplr_doubled(q, k, v, beta, g)
    ref = naive_hdla(*(t.double() for t in (q, k, v, beta, g)))[0]
    assert rel_err(fla, ref) < 5e-3  # the oracle itself agrees with the loop
    assert rel_err(ours, fla) < 5e-3
