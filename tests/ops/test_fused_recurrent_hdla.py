"""fused_recurrent_hdla, the HDLA decoding step, on every backend (tests/backends.py: the PyTorch
loop, the Triton kernel under the interpreter, the Triton kernel on CUDA) against the float64 token
loop and the chunk op: outputs and states, resets, padding tokens, bf16; the log-decay and dtype
contract; bad input raising ValueError before any launch; the custom op under opcheck. Its
gradients: the Triton backward on the Triton backends (tests/ops/test_recurrent_hdla.py checks it at
length), autograd through the PyTorch loop elsewhere."""
import pytest
import torch
import torch.nn.functional as F

from hdla_vision.kernels import chunk_hdla, custom_ops, fused_recurrent_hdla, naive_hdla
from hdla_vision.kernels.hdla.fused_recurrent import torch_fused_recurrent_hdla
from tests.ops.compiled import assert_compiled_equals_eager
from tests.backends import CUDA_TOL, backend_cases, backends, device_of, dtypes_id, on_backend
from tests.oracle import LoopCase, assert_reset_gradients_zero_and_finite, case_name, compare_with_loop, hdla_problem, rel_err

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
STEP_TOL = {"torch": 1e-5, "interpreter": 1e-5, "cuda": 1e-4}  # absolute and relative, against the loop


def hdla_inputs(batch, seq_len, heads, dk, dv, dtype=torch.float32, seed=0, device="cpu"):
    """Random decoding inputs ``([q, k, v, beta, g], state [B, H, K, V] fp32)``: unit k, beta in
    [0, 2], g = logsigmoid(2 N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dk, generator=gen)
    k = F.normalize(torch.randn(batch, seq_len, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, seq_len, heads, dv, generator=gen)
    beta = 2 * torch.rand(batch, seq_len, heads, generator=gen)
    g = F.logsigmoid(2 * torch.randn(batch, seq_len, heads, dk, generator=gen))
    state = torch.randn(batch, heads, dk, dv, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, beta, g)], state.to(device)


def _double(*tensors):
    return [x.double() for x in tensors]


# ----------------------------------------------------------------------------- against the loop
CPU_SHAPES = [(2, 1, 3, 16, 16), (1, 4, 2, 12, 20), (2, 3, 1, 32, 8)]  # (B, T, H, K, V)
INTERPRETER_SHAPES = [(2, 1, 2, 16, 16), (1, 3, 1, 12, 40)]
CUDA_SHAPES = [(3, 2, 4, 64, 64)]


def _shape_id(shape):
    return "B{}_T{}_H{}_K{}_V{}".format(*shape)


def _with_scale(shapes, scale):
    return [(shape, scale) for shape in shapes]


@pytest.mark.parametrize("backend,case", backend_cases(
    lambda case: f"{_shape_id(case[0])}_scale{case[1]}",
    torch=_with_scale(CPU_SHAPES, 0.7) + _with_scale(INTERPRETER_SHAPES, 0.5),
    interpreter=_with_scale(INTERPRETER_SHAPES, 0.5), cuda=_with_scale(CUDA_SHAPES, None)), indirect=["backend"])
def test_step_matches_float64_loop(backend, case):
    """Output and new state (fp32) from a given state."""
    shape, scale = case
    (q, k, v, beta, g), s0 = hdla_inputs(*shape, device=device_of(backend))
    o_ref, s_ref = naive_hdla(*_double(q, k, v, beta, g), scale=scale, initial_state=s0.double(),
                              output_final_state=True)
    o, s = fused_recurrent_hdla(q, k, v, beta, g, scale=scale, initial_state=s0)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    tol = STEP_TOL[backend]
    torch.testing.assert_close(o.double(), o_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(s.double(), s_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=_shape_id)
def test_float64_torch_step_is_exact(shape):
    """The PyTorch loop in float64 is the float64 token loop (1e-12)."""
    (q, k, v, beta, g), s0 = hdla_inputs(*shape)
    o_ref, s_ref = naive_hdla(*_double(q, k, v, beta, g), scale=0.7, initial_state=s0.double(),
                              output_final_state=True)
    o64, s64 = torch_fused_recurrent_hdla(*_double(q, k, v, beta, g), 0.7, s0.double())
    torch.testing.assert_close(o64, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s64, s_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", INTERPRETER_SHAPES, ids=_shape_id)
def test_without_initial_state(backend, shape):
    """No initial state: a zero state, and the new state is returned all the same."""
    (q, k, v, beta, g), _ = hdla_inputs(*shape, seed=1, device=device_of(backend))
    o, s = fused_recurrent_hdla(q, k, v, beta, g)
    o_ref, s_ref = naive_hdla(*_double(q, k, v, beta, g), output_final_state=True)
    tol = STEP_TOL[backend]
    torch.testing.assert_close(o.double(), o_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(s.double(), s_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", INTERPRETER_SHAPES, ids=_shape_id)
def test_reset_channels_are_exact(backend, shape):
    """g = -inf (lambda = 0) in half the channels of the first token: the exact reset, finite outputs."""
    (q, k, v, beta, g), s0 = hdla_inputs(*shape, seed=2, device=device_of(backend))
    g[:, 0, :, : shape[3] // 2] = float("-inf")
    o, s = fused_recurrent_hdla(q, k, v, beta, g, 0.5, s0)
    o_ref, s_ref = naive_hdla(*_double(q, k, v, beta, g), scale=0.5, initial_state=s0.double(),
                              output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    tol = STEP_TOL[backend]
    torch.testing.assert_close(o.double(), o_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(s.double(), s_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", INTERPRETER_SHAPES, ids=_shape_id)
def test_bf16_inputs_give_bf16_output(backend, shape):
    """bf16 q, k, v, beta, g with an fp32 state: a bf16 output within 10% of the output's range."""
    (q, k, v, beta, g), s0 = hdla_inputs(*shape, seed=3, device=device_of(backend))
    o_ref, _ = naive_hdla(*_double(q, k, v, beta, g), scale=0.5, initial_state=s0.double(), output_final_state=True)
    o, s = fused_recurrent_hdla(*(x.bfloat16() for x in (q, k, v, beta, g)), 0.5, s0)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert (o.double() - o_ref).abs().max() < 0.1 * o_ref.abs().max()


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_steps_from_chunk_final_state_equal_chunk_over_whole_sequence(backend):
    """Prefill with the chunk op, then decode token by token: same outputs and final state."""
    (q, k, v, beta, g), _ = hdla_inputs(2, 37, 2, 16, 16, seed=1, device=device_of(backend))
    prefill = 29
    o_full, s_full = chunk_hdla(q, k, v, beta, g, output_final_state=True)
    _, state = chunk_hdla(*(x[:, :prefill] for x in (q, k, v, beta, g)), output_final_state=True)
    outputs = []
    for t in range(prefill, q.shape[1]):
        o_t, state = fused_recurrent_hdla(*(x[:, t:t + 1] for x in (q, k, v, beta, g)), initial_state=state)
        outputs.append(o_t)
    tol = 1e-4 if backend != "cuda" else CUDA_TOL  # the CUDA chunk kernels' TF32 products
    torch.testing.assert_close(torch.cat(outputs, 1), o_full[:, prefill:], rtol=tol, atol=tol)
    torch.testing.assert_close(state, s_full, rtol=tol, atol=tol)


def test_zero_state_and_identity_token_keep_state(backend):
    """A token with k = 0, g = 0, beta = 0 (a padding token) leaves the state unchanged."""
    (q, k, v, beta, g), s0 = hdla_inputs(1, 1, 2, 8, 8, device=device_of(backend))
    _, s = fused_recurrent_hdla(q, torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(beta),
                                torch.zeros_like(g), initial_state=s0)
    torch.testing.assert_close(s, s0, rtol=0, atol=0)


# ----------------------------------------------------------------------------- g = -inf, g > 0
def _fused(**kw):
    """fused_recurrent_hdla with chunk_hdla's keywords, for compare_with_loop (no reverse; it always
    returns the state)."""
    assert not kw.pop("reverse")
    kw.pop("output_final_state")
    return fused_recurrent_hdla(**kw)


RESETS = dict(batch=2, seq_len=29, heads=2, dk=8, dv=8, resets=0.15)


@pytest.mark.parametrize("backend,case", backend_cases(
    case_name, torch=[LoopCase("resets_f64", RESETS, dtype=F64, tol=1e-10), LoopCase("resets_f32", RESETS)],
    cuda=[LoopCase("resets_f32", RESETS, tol=CUDA_TOL)]),
    indirect=["backend"])
def test_reset_is_the_exact_limit(backend, case):
    """Against the float64 loop at resets (g = -inf on 15% of tokens and channels): output, state and
    every gradient."""
    inputs = on_backend(hdla_problem(**case.problem), backend)
    assert torch.isinf(inputs["g"]).any()
    errors = compare_with_loop(_fused, "hdla", inputs, dtype=case.dtype)
    assert all(err < case.tol for err in errors.values()), errors  # NaN fails


def test_gradient_at_minus_inf_is_zero_and_all_finite(backend):
    p = on_backend({n: x.float() for n, x in hdla_problem(1, 5, 2, 8, 8, resets=0.2).items()}, backend)
    p = {n: x.requires_grad_() for n, x in p.items()}
    assert_reset_gradients_zero_and_finite(fused_recurrent_hdla, p)


@pytest.mark.parametrize("backend", backends("torch", "interpreter"), indirect=True)
def test_positive_log_decay_is_refused_on_cpu(backend):
    """g > 0 is outside the domain: refused for CPU tensors (unchecked on CUDA: a host sync)."""
    p = {n: x.float() for n, x in hdla_problem(1, 5, 1, 8, 8).items()}
    fused_recurrent_hdla(**p)  # g <= 0 (zeros included) is fine
    p["g"][0, 3, 0, 2] = 1e-3
    with pytest.raises(ValueError, match=r"g is a log-decay and must be <= 0"):
        fused_recurrent_hdla(**p)


# ----------------------------------------------------------------------------- dtypes, bad input
def _with_dtypes(dtypes, backend):
    p = hdla_problem(1, 5, 2, 8, 8)
    return on_backend({n: x.to(dtypes.get(n, dtypes["q"])) for n, x in p.items()}, backend)


@pytest.mark.parametrize("dtypes", [dict(q=BF16, g=F32, beta=F32, initial_state=F32)], ids=dtypes_id)
def test_dtype_rule_accepts(backend, dtypes):
    """k, v have q's dtype; beta and g q's dtype or float32; the state any float dtype."""
    p = _with_dtypes(dtypes, backend)
    o, _ = fused_recurrent_hdla(**p)
    assert torch.isfinite(o.float()).all()
    ref, _ = naive_hdla(**{n: x.double() for n, x in p.items()})
    assert rel_err(o, ref) < 2e-2  # bf16 inputs, fp32 compute


@pytest.mark.parametrize("dtypes,message", [
    (dict(q=BF16, v=F32), "v has dtype torch.float32; expected q's dtype torch.bfloat16")], ids=["q=bf16,v=fp32"])
def test_dtype_rule_refuses_naming_the_argument(backend, dtypes, message):
    with pytest.raises(ValueError) as info:
        fused_recurrent_hdla(**_with_dtypes(dtypes, backend))
    assert message in str(info.value)


def test_input_checks_name_the_argument(backend):
    (q, k, v, beta, g), s0 = hdla_inputs(1, 1, 2, 8, 8, device=device_of(backend))
    with pytest.raises(ValueError, match="beta"):
        fused_recurrent_hdla(q, k, v, beta[..., :1], g)
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent_hdla(q, k, v, beta, g, initial_state=s0[:, :, :4])


# ----------------------------------------------------------------------------- the custom op
@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
@pytest.mark.parametrize("h0", [True, False])
def test_opcheck(backend, h0):
    """opcheck of the op and of its backward op."""
    p = {n: None if x is None else x.float().requires_grad_()
         for n, x in on_backend(hdla_problem(2, 3, 2, 8, 4, h0=h0), backend).items()}
    args = (p["q"], p["k"], p["v"], p["beta"], p["g"], 0.5, p["initial_state"])
    torch.library.opcheck(custom_ops.fused_recurrent_hdla_op, args)
    o, state = custom_ops.fused_recurrent_hdla_op(*args)
    detached = [None if t is None else t.detach() for t in args[:5]]
    torch.library.opcheck(custom_ops.fused_recurrent_hdla_backward_op,
                          (torch.randn_like(o), torch.randn_like(state), *detached, 0.5, args[6].detach() if h0 else None))


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_compiled_equals_eager(backend):
    """The op under torch.compile(fullgraph=True): output, state and every gradient as in eager."""
    p = on_backend({n: x.float() for n, x in hdla_problem(2, 3, 2, 8, 4).items()}, backend)
    assert_compiled_equals_eager(lambda **kw: fused_recurrent_hdla(**kw, scale=0.5), p)
