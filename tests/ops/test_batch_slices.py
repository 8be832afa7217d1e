"""Every linear op splits a batch whose batch-head pairs exceed a launch grid's axis (65535 programs
on CUDA, ``kernels.utils.MAX_GRID_BATCH_HEADS``) into slices, and the result equals one unsplit
call: outputs, final states and every gradient. The limit is lowered here so that small problems
take the sliced path; on CUDA one real-size case runs past the true limit."""
import pytest
import torch

from hdla_vision.kernels import (chunk_generalized, chunk_hdla, chunk_loglinear_hdla, fused_recurrent_generalized,
                                 fused_recurrent_hdla, utils)
from tests.backends import backends, on_backend
from tests.oracle import generalized_problem, hdla_problem, rel_err

OPS = {
    "chunk_hdla": (chunk_hdla, lambda: hdla_problem(5, 19, 3, 8, 4), dict(output_final_state=True)),
    "chunk_generalized": (chunk_generalized, lambda: generalized_problem(5, 19, 3, 8, 4, r_kv=1, r_ab=2),
                          dict(output_final_state=True)),
    "fused_recurrent_hdla": (fused_recurrent_hdla, lambda: hdla_problem(5, 3, 3, 8, 4), {}),
    "fused_recurrent_generalized": (fused_recurrent_generalized,
                                    lambda: generalized_problem(5, 3, 3, 8, 4, r_kv=1, r_ab=2),
                                    dict(output_final_state=True)),
}


def outputs_and_grads(op, problem: dict, kwargs: dict):
    inputs = {n: x.float().requires_grad_() if x is not None else None for n, x in problem.items()}
    o, state = op(**inputs, **kwargs)
    loss = (o * torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o)).sum() + state.square().sum()
    wrt = [x for x in inputs.values() if x is not None]
    return [o, state] + list(torch.autograd.grad(loss, wrt))


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_sliced_batch_equals_one_call(name, backend, monkeypatch):
    op, problem_fn, kwargs = OPS[name]
    problem = on_backend(problem_fn(), backend)
    whole = outputs_and_grads(op, problem, kwargs)
    monkeypatch.setattr(utils, "MAX_GRID_BATCH_HEADS", 6)  # 3 heads: slices of 2, 2 and 1 batch entries
    assert len(utils.batch_slices(5, 3)) == 3
    sliced = outputs_and_grads(op, problem, kwargs)
    for a, b in zip(sliced, whole):
        assert a.shape == b.shape and rel_err(a, b) < 1e-6


def test_heads_beyond_the_grid_limit_are_refused(monkeypatch):
    monkeypatch.setattr(utils, "MAX_GRID_BATCH_HEADS", 2)
    p = hdla_problem(1, 4, 3, 8, 4)
    with pytest.raises(ValueError, match="heads must be at most 2"):
        chunk_hdla(**{n: x.float() for n, x in p.items()})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loglinear_lm_shape_runs_past_the_grid_limit():
    """The log-linear op folds level 1's two-token blocks into the batch: B*T/2*H = 131072 pairs at
    the LM shape (4, 4096, 16, 128), twice the grid axis; it used to fail at launch."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, t, h, d = 4, 4096, 16, 128
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, v = rnd(b, t, h, d).bfloat16(), rnd(b, t, h, d).bfloat16()
    k = torch.nn.functional.normalize(rnd(b, t, h, d), dim=-1).bfloat16()
    beta, g = torch.rand(b, t, h, device="cuda", generator=gen), -torch.rand(b, t, h, d, device="cuda", generator=gen)
    scales = torch.rand(b, t, h, 14, device="cuda", generator=gen)
    o, _ = chunk_loglinear_hdla(q, k, v, beta, g, scales)
    assert torch.isfinite(o.float()).all()
