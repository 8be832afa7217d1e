"""The chunk backward (issue 11): its float64 specification against autograd through the token loops,
and the Triton kernels of kernels/generalized/bwd.py under TRITON_INTERPRET=1 (fp32, CPU, in a
subprocess: tests/chunk_bwd_worker.py) against the same, relative error < 1e-4 for every gradient."""

import pytest
import torch

from kernels.generalized.naive import naive_generalized
from kernels.hdla.naive import naive_hdla
from tests.chunk_bwd_reference import generalized_backward_reference, hdla_backward_reference
from tests.chunk_bwd_cases import CASES
from tests.oracle import generalized_problem, hdla_problem, rel_err
from tests.interpreted import run_interpreted_json

TOL = 1e-4


def _loop_grads(loop, problem, names, reverse, scale=0.7):
    ins = [problem[n].clone().requires_grad_() for n in names]
    h0 = problem["initial_state"].clone().requires_grad_()
    o, s = loop(*ins, scale, h0, True, reverse)
    do, dht = torch.randn_like(o), torch.randn_like(s)
    return do, dht, torch.autograd.grad((o * do).sum() + (s * dht).sum(), ins + [h0])


@pytest.mark.parametrize("r_ab,r_kv,reverse,per_head,g_min,chunk", [
    (0, 1, False, False, -3.0, 16), (1, 2, True, False, -3.0, 16), (2, 1, False, False, -20.0, 32),
    (3, 4, False, True, -3.0, 16), (4, 1, True, False, -3.0, 64)])
def test_spec_matches_autograd_through_loop(r_ab, r_kv, reverse, per_head, g_min, chunk):
    torch.manual_seed(0)
    p = generalized_problem(2, 37, 2, 8, 6, r_kv, r_ab, g_min=g_min, per_head_g=per_head)
    names = ["q", "k", "v", "a", "b", "g"]
    do, dht, ref = _loop_grads(naive_generalized, p, names, reverse)
    mine = generalized_backward_reference(do, dht, *(p[n] for n in names), 0.7, p["initial_state"], reverse, chunk)
    for name, m, r in zip(names + ["h0"], mine, ref):
        assert rel_err(m, r) < 1e-10, name


@pytest.mark.parametrize("reverse,g_min,chunk", [(False, -3.0, 16), (True, -20.0, 32)])
def test_hdla_spec_matches_autograd_through_loop(reverse, g_min, chunk):
    torch.manual_seed(0)
    p = hdla_problem(2, 37, 2, 8, 6, g_min=g_min)
    names = ["q", "k", "v", "beta", "g"]
    do, dht, ref = _loop_grads(naive_hdla, p, names, reverse)
    mine = hdla_backward_reference(do, dht, *(p[n] for n in names), 0.7, p["initial_state"], reverse, chunk)
    for name, m, r in zip(names + ["h0"], mine, ref):
        assert rel_err(m, r) < 1e-10, name


@pytest.fixture(scope="module")
def interpreted_errors():
    return run_interpreted_json("tests.chunk_bwd_worker")


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(CASES))
def test_backward_kernels_match_float64_loop(interpreted_errors, case):
    errors = interpreted_errors[case]
    assert len(errors) >= 5, errors  # every input's gradient was compared
    bad = {name: err for name, err in errors.items() if not err < TOL}  # NaN fails too
    assert not bad, f"{case}: relative errors above {TOL}: {bad}"


def test_bad_shapes_raise_before_launch():
    from kernels.generalized.bwd import generalized_backward

    p = generalized_problem(1, 5, 1, 8, 4, 1, 1)
    args = [p[n].float() for n in ("q", "k", "v", "a", "b", "g")]
    h = torch.zeros(1, 1, 1, 8, 4)
    with pytest.raises(ValueError, match="do must be"):
        generalized_backward(torch.zeros(1, 5, 1, 3), None, *args, 1.0, None, h, False)
    with pytest.raises(ValueError, match="a and b"):
        generalized_backward(torch.zeros(1, 5, 1, 4), None, *args[:3], args[3], args[4][:, :, :, :, :4], args[5],
                             1.0, None, h, False)
    with pytest.raises(ValueError, match="h must be"):
        generalized_backward(torch.zeros(1, 5, 1, 4), None, *args, 1.0, None, h[0], False)
