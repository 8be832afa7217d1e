"""fused_recurrent_loglinear_hdla and fused_recurrent_loglinear_generalized, the log-linear decoding
steps (the Fenwick form on L states, kernels/README.md §7), against the chunk ops: token by token
from any offset and cache, continuing a prompt; bad input raising ValueError. The steps are a
PyTorch loop on every device, so their backends are "torch" and "cuda" (under the interpreter they
run that same loop; the chunk ops they are compared with are test_chunk_loglinear.py's)."""
import pytest
import torch

from hdla_vision.kernels import chunk_loglinear_hdla, fused_recurrent_loglinear_generalized, fused_recurrent_loglinear_hdla
from tests.backends import CUDA_TOL, backends, on_backend
from tests.oracle import (LOGLINEAR_GENERALIZED_BAD_INPUT, LOGLINEAR_OPS, bad_loglinear_problem, loglinear_problem,
                          loglinear_tokens, rel_err)

TORCH_AND_CUDA = backends("torch", "cuda")


def _tol(backend):
    """Decoding against the chunk op: fp32 (the chunk kernels' TF32 products on CUDA)."""
    return CUDA_TOL if backend == "cuda" else 1e-5


@pytest.mark.parametrize("backend", TORCH_AND_CUDA, indirect=True)
@pytest.mark.parametrize("kind", ["hdla", "generalized"])
@pytest.mark.parametrize("offset,h0", [(0, False), (0, True), (21, True)])
def test_decoding_token_by_token_equals_the_chunk_op(backend, kind, offset, h0):
    chunk, _, step = LOGLINEAR_OPS[kind]
    p = {n: None if x is None else x.float() for n, x in loglinear_problem(kind, 33, 5, h0=h0).items()}
    p = on_backend(p, backend)
    o_chunk, s_chunk = chunk(**p, output_final_state=True, offset=offset)
    state, outputs = p["initial_state"], []
    for i in range(33):
        o_i, state = step(**dict(loglinear_tokens(p, i, i + 1), initial_state=state), offset=offset + i)
        outputs.append(o_i)
    assert state.dtype == torch.float32
    assert rel_err(torch.cat(outputs, 1), o_chunk) < _tol(backend) and rel_err(state, s_chunk) < _tol(backend)


@pytest.mark.parametrize("backend", TORCH_AND_CUDA, indirect=True)
def test_decoding_continues_a_prompt(backend):
    """The chunk op's final levels are a cache the decoding step continues (prefill, then decode)."""
    p = {n: None if x is None else x.float() for n, x in loglinear_problem("hdla", 30, 4).items()}
    p = on_backend(p, backend)
    o_all, s_all = chunk_loglinear_hdla(**p, output_final_state=True)
    _, cache = chunk_loglinear_hdla(**loglinear_tokens(p, 0, 23), output_final_state=True)
    o_tail, s_tail = fused_recurrent_loglinear_hdla(**dict(loglinear_tokens(p, 23, None), initial_state=cache), offset=23)
    assert rel_err(o_tail, o_all[:, 23:]) < _tol(backend) and rel_err(s_tail, s_all) < _tol(backend)


@pytest.mark.parametrize("backend", TORCH_AND_CUDA, indirect=True)
@pytest.mark.parametrize("over,needle", LOGLINEAR_GENERALIZED_BAD_INPUT)
def test_bad_input_generalized(backend, over, needle):
    with pytest.raises(ValueError) as info:
        fused_recurrent_loglinear_generalized(**on_backend(bad_loglinear_problem("generalized", **over), backend))
    assert needle in str(info.value)


@pytest.mark.parametrize("backend", TORCH_AND_CUDA, indirect=True)
def test_decay_per_head_equals_the_decay_broadcast_over_k(backend):
    """g ``[B, T, H]`` (one decay per head, as the generalized ops take it; the scalar-gated mixers pass
    it so) gives the decoding step and the float64 loop the results of g broadcast to ``[B, T, H, K]``."""
    _, loop, step = LOGLINEAR_OPS["generalized"]
    p = loglinear_problem("generalized", 9, 3, h0=True)
    per_head = dict(p, g=p["g"][..., 0].contiguous())
    broadcast = dict(p, g=per_head["g"].unsqueeze(-1).expand_as(p["g"]).contiguous())
    o_ref, s_ref = loop(**broadcast, output_final_state=True, offset=5)
    o_loop, s_loop = loop(**per_head, output_final_state=True, offset=5)
    assert rel_err(o_loop, o_ref) < 1e-12 and rel_err(s_loop, s_ref) < 1e-12
    fp32 = on_backend({n: x.float() for n, x in per_head.items()}, backend)
    o_step, s_step = step(**fp32, offset=5)
    assert rel_err(o_step.cpu(), o_ref) < _tol(backend) and rel_err(s_step.cpu(), s_ref) < _tol(backend)
