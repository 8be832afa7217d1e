"""GPU checks of the Triton kernels at realistic shapes (skipped without CUDA; run on the device):
bf16 against the float64 token loop (relative error < 1e-2). chunk_hdla's are its "cuda" backend
in tests/ops/test_chunk_hdla.py."""
import pytest
import torch

from hdla_vision.kernels import chunk_generalized
from tests.oracle import compare_with_loop, generalized_problem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda(problem):
    return {n: (None if x is None else x.cuda()) for n, x in problem.items()}


@pytest.mark.parametrize("r_kv,r_ab,reverse", [(1, 0, False), (1, 1, True), (2, 2, False), (3, 3, True), (1, 4, False)])
def test_generalized_matches_loop_bf16(r_kv, r_ab, reverse):
    problem = _cuda(generalized_problem(2, 150, 2, 64, 64, r_kv, r_ab, g_min=-5.0))
    errors = compare_with_loop(chunk_generalized, "generalized", problem, reverse=reverse, dtype=torch.bfloat16)
    assert all(err < 1e-2 for err in errors.values()), errors
