"""fused_recurrent_generalized, the generalized decoding step, on every backend (tests/backends.py:
the PyTorch loop, the Triton kernel under the interpreter, the Triton kernel on CUDA) against the
float64 token loop and the chunk op: every r_ab 0..4 and r_kv 1..4 at head dims 16..256, g per
channel or per head, resets, padding tokens, bf16; the log-decay and dtype contract; bad input
raising ValueError before any launch; the custom op under opcheck. Its gradients are autograd's
through the PyTorch loop on every device."""
import pytest
import torch

from hdla_vision.kernels import chunk_generalized, custom_ops, fused_recurrent_generalized, naive_generalized
from hdla_vision.kernels.generalized import fused_recurrent
from hdla_vision.kernels.generalized.fused_recurrent import torch_fused_recurrent_generalized
from tests.ops.compiled import assert_compiled_equals_eager
from tests.backends import CUDA_TOL, backend_cases, backends, dtypes_id, on_backend
from tests.oracle import LoopCase, case_name, compare_with_loop, generalized_problem, rel_err

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
NAMES = ("q", "k", "v", "a", "b", "g")

# (B, T, H, K, V, r_kv, r_ab, per_head_g): every r_ab 0..4 and r_kv 1..4, head dims 16..256
CASES = [
    (2, 1, 3, 16, 16, 1, 0, False),
    (1, 3, 2, 32, 24, 1, 1, True),
    (2, 2, 1, 64, 48, 2, 2, False),
    (1, 4, 2, 16, 32, 3, 3, True),
    (1, 2, 1, 128, 64, 4, 4, False),
    (1, 1, 1, 256, 256, 2, 4, True),
    (1, 2, 1, 256, 16, 1, 2, False),
]


def case_id(case):
    return "B{}T{}H{}K{}V{}_rkv{}_rab{}_{}".format(*case[:7], "headg" if case[7] else "chang")


def fp32_inputs(problem):
    return {n: None if x is None else x.float() for n, x in problem.items()}


@pytest.fixture
def triton_launches(monkeypatch):
    """The number of Triton kernel launches so far (a list, one entry per launch)."""
    launches, run = [], fused_recurrent.triton_fused_recurrent_generalized
    monkeypatch.setattr(fused_recurrent, "triton_fused_recurrent_generalized",
                        lambda *args: launches.append(1) or run(*args))
    return launches


# ----------------------------------------------------------------------------- against the loop
STEP_TOL = {"torch": 1e-5, "interpreter": 1e-4, "cuda": 1e-4}  # relative, fp32 against the float64 loop


def steps(with_resets):
    """(case, h0, resets): every case with and without an initial state, with resets where r_ab > 0
    and, unless ``with_resets`` only, without them."""
    return [(case, h0, resets) for case in CASES for h0 in (True, False)
            for resets in ((bool(case[6]),) if with_resets else (False, True)) if case[6] or not resets]


def step_id(step):
    case, h0, resets = step
    return f"{case_id(case)}{'' if h0 else '_no_h0'}{'_resets' if resets else ''}"


# the interpreter runs each case once, with the resets where the rank allows them (its cost)
@pytest.mark.parametrize("backend,step", backend_cases(step_id, torch=steps(False), interpreter=steps(True),
                                                       cuda=steps(False)), indirect=["backend"])
def test_step_matches_float64_loop(backend, step, triton_launches):
    """Output and new state (fp32) of one call; with ``resets`` g = -inf on the first token in a
    quarter of the channels (a per-head g: in every channel), and the Triton kernel ran where it should."""
    case, h0, resets = step
    B, T, H, K, V, r_kv, r_ab, per_head_g = case
    p = generalized_problem(B, T, H, K, V, r_kv, r_ab, h0=h0, per_head_g=per_head_g, seed=K + r_ab)
    if resets:
        p["g"][:, 0, ..., : max(1, K // 4) if not per_head_g else 1] = float("-inf")
    ref_o, ref_s = naive_generalized(**p, scale=0.6, output_final_state=True)
    o, s = fused_recurrent_generalized(**on_backend(fp32_inputs(p), backend), scale=0.6, output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o.cpu(), ref_o) < STEP_TOL[backend] and rel_err(s.cpu(), ref_s) < STEP_TOL[backend]
    assert len(triton_launches) == (0 if backend == "torch" else 1)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_float64_torch_step_is_exact(case):
    """The PyTorch loop in float64 is the float64 token loop (1e-12)."""
    *shape, per_head_g = case
    p = generalized_problem(*shape, per_head_g=per_head_g, seed=sum(shape))
    ref_o, ref_s = naive_generalized(**p, scale=0.7, output_final_state=True)
    o64, s64 = torch_fused_recurrent_generalized(*(p[n] for n in NAMES), 0.7, p["initial_state"])
    torch.testing.assert_close(o64, ref_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s64, ref_s, rtol=1e-12, atol=1e-12)


def test_without_initial_state_and_without_final_state(backend):
    p = generalized_problem(2, 3, 2, 16, 8, 2, 1, h0=False, seed=3)
    ref_o, ref_s = naive_generalized(**p, output_final_state=True)
    f = on_backend(fp32_inputs(p), backend)
    o, s = fused_recurrent_generalized(**f, output_final_state=True)
    assert rel_err(o.cpu(), ref_o) < STEP_TOL[backend] and rel_err(s.cpu(), ref_s) < STEP_TOL[backend]
    o2, none = fused_recurrent_generalized(**f)
    assert none is None and torch.equal(o2, o)


CHAINS = [  # (B, T, H, K, V, r_kv, r_ab, per_head_g)
    (2, 5, 2, 16, 16, 2, 2, False), (2, 5, 2, 16, 16, 2, 2, True), (1, 4, 2, 32, 32, 2, 3, False)]


@pytest.mark.parametrize("backend,case", backend_cases(case_id, torch=CHAINS, interpreter=CHAINS[2:], cuda=CHAINS),
                         indirect=["backend"])
def test_steps_chained_equal_one_multi_token_call(backend, case):
    *shape, per_head_g = case
    p = on_backend(fp32_inputs(generalized_problem(*shape, per_head_g=per_head_g, seed=4)), backend)
    o_all, s_all = fused_recurrent_generalized(**p, scale=0.5, output_final_state=True)
    state, outputs = p["initial_state"], []
    for t in range(shape[1]):
        o_t, state = fused_recurrent_generalized(*(p[n][:, t:t + 1] for n in NAMES), scale=0.5,
                                                 initial_state=state, output_final_state=True)
        outputs.append(o_t)
    tol = 1e-5 if backend == "cuda" else 1e-6
    torch.testing.assert_close(torch.cat(outputs, 1), o_all, rtol=tol, atol=tol)
    torch.testing.assert_close(state, s_all, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_steps_from_chunk_final_state_equal_chunk_over_whole_sequence(backend):
    """Prefill with the chunk op, then decode token by token: same outputs and final state."""
    p = on_backend(fp32_inputs(generalized_problem(2, 37, 2, 16, 16, 1, 2, seed=5)), backend)
    prefill = 29
    o_full, s_full = chunk_generalized(**p, output_final_state=True)
    _, state = chunk_generalized(*(p[n][:, :prefill] for n in NAMES), initial_state=p["initial_state"],
                                 output_final_state=True)
    outputs = []
    for t in range(prefill, 37):
        o_t, state = fused_recurrent_generalized(*(p[n][:, t:t + 1] for n in NAMES), initial_state=state,
                                                 output_final_state=True)
        outputs.append(o_t)
    tol = 1e-4 if backend != "cuda" else CUDA_TOL  # the CUDA chunk kernels' TF32 products
    torch.testing.assert_close(torch.cat(outputs, 1), o_full[:, prefill:], rtol=tol, atol=tol)
    torch.testing.assert_close(state, s_full, rtol=tol, atol=tol)


def test_reset_and_identity_token(backend):
    """g = -inf resets that channel exactly; a token with k, v, a, b, g = 0 (padding) keeps the state."""
    p = fp32_inputs(generalized_problem(1, 2, 2, 8, 8, 1, 2, seed=6))
    p["g"][:, 0, :, :4] = float("-inf")
    ref_o, ref_s = naive_generalized(**{n: None if x is None else x.double() for n, x in p.items()},
                                     output_final_state=True)
    p = on_backend(p, backend)
    o, s = fused_recurrent_generalized(**p, output_final_state=True)
    tol = 1e-4 if backend == "cuda" else 1e-5
    assert torch.isfinite(o).all() and rel_err(o.cpu(), ref_o) < tol and rel_err(s.cpu(), ref_s) < tol
    zeros = {n: torch.zeros_like(p[n]) for n in ("k", "v", "a", "b", "g")}
    _, kept = fused_recurrent_generalized(p["q"], **zeros, initial_state=p["initial_state"], output_final_state=True)
    torch.testing.assert_close(kept, p["initial_state"], rtol=0, atol=0)


def test_bf16_inputs_give_bf16_output(backend):
    """bf16 q, k, v, a, b with an fp32 g and state: a bf16 output (within 5%), an fp32 state."""
    p = generalized_problem(1, 4, 2, 32, 32, 2, 3, seed=1)
    ref_o, _ = naive_generalized(**p, output_final_state=True)
    f = on_backend(fp32_inputs(p), backend)
    o, s = fused_recurrent_generalized(*(f[n].bfloat16() for n in NAMES[:5]), f["g"], initial_state=f["initial_state"],
                                       output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32 and rel_err(o.cpu(), ref_o) < 0.05


def test_gradients_match_the_float64_loop(backend):
    p = on_backend(generalized_problem(1, 3, 2, 8, 4, 2, 2, per_head_g=True, seed=7), backend)
    names = (*NAMES, "initial_state")
    gen = torch.Generator().manual_seed(0)
    do = torch.randn(1, 3, 2, 4, generator=gen, dtype=torch.float64).to(p["q"].device)
    ds = torch.randn(1, 2, 8, 4, generator=gen, dtype=torch.float64).to(p["q"].device)

    def grads(fn, cast):
        leaves = {n: cast(p[n]).requires_grad_() for n in names}
        o, s = fn(**leaves, scale=0.5, output_final_state=True)
        return torch.autograd.grad((o.double() * do).sum() + (s.double() * ds).sum(), [leaves[n] for n in names])

    tol = 1e-4 if backend == "cuda" else 1e-5
    for n, got, ref in zip(names, grads(fused_recurrent_generalized, lambda x: x.float()),
                           grads(naive_generalized, lambda x: x.clone())):
        assert got.shape == ref.shape and rel_err(got, ref) < tol, n


# ----------------------------------------------------------------------------- g = -inf, dtypes
def _fused(**kw):
    """fused_recurrent_generalized with chunk_generalized's keywords, for compare_with_loop (no reverse)."""
    assert not kw.pop("reverse")
    return fused_recurrent_generalized(**kw)


def _resets(r_ab, per_head_g, dtype=F32, tol=1e-4):
    problem = dict(batch=2, seq_len=9, heads=2, dk=8, dv=6, r_kv=2, r_ab=r_ab, resets=0.2, per_head_g=per_head_g)
    name = f"rab{r_ab}{'_per_head_g' if per_head_g else ''}_{'f64' if dtype == F64 else 'f32'}"
    return LoopCase(name, problem, dict(scale=0.5), dtype, tol)


RANKS = [(0, False), (2, True), (3, False)]  # (r_ab, per_head_g)


@pytest.mark.parametrize("backend,case", backend_cases(
    case_name, torch=[_resets(*rank, dtype=F64, tol=1e-10) for rank in RANKS] + [_resets(*rank) for rank in RANKS],
    cuda=[_resets(*rank, tol=CUDA_TOL) for rank in RANKS]),
    indirect=["backend"])
def test_reset_is_the_exact_limit(backend, case):
    """Against the float64 loop at resets (g = -inf on 20% of tokens and channels): output, state and
    every gradient."""
    inputs = on_backend(generalized_problem(**case.problem), backend)
    assert torch.isinf(inputs["g"]).any()
    errors = compare_with_loop(_fused, "generalized", inputs, dtype=case.dtype, **case.op)
    assert all(err < case.tol for err in errors.values()), errors


def _with_dtypes(dtypes, backend):
    p = generalized_problem(1, 5, 2, 8, 8, 1, 2)
    return on_backend({n: x.to(dtypes.get(n, dtypes["q"])) for n, x in p.items()}, backend)


@pytest.mark.parametrize("dtypes", [dict(q=BF16, g=F32, initial_state=F32), dict(q=F16, g=F16)], ids=dtypes_id)
def test_dtype_rule_accepts(backend, dtypes):
    """k, v, a, b have q's dtype; g q's dtype or float32; the state any float dtype."""
    p = _with_dtypes(dtypes, backend)
    o, _ = fused_recurrent_generalized(**p)
    assert torch.isfinite(o.float()).all()
    ref, _ = naive_generalized(**{n: x.double() for n, x in p.items()})
    assert rel_err(o, ref) < 2e-2  # 16-bit inputs, fp32 compute


REFUSED = [  # (dtypes, message)
    (dict(q=BF16, a=F32), "a has dtype torch.float32; expected q's dtype torch.bfloat16"),
    (dict(q=F32, g=F64), "g has dtype torch.float64; expected torch.float32"),
]


@pytest.mark.parametrize("dtypes,message", REFUSED, ids=[dtypes_id(dtypes) for dtypes, _ in REFUSED])
def test_dtype_rule_refuses_naming_the_argument(backend, dtypes, message):
    with pytest.raises(ValueError) as info:
        fused_recurrent_generalized(**_with_dtypes(dtypes, backend))
    assert message in str(info.value)


# ----------------------------------------------------------------------------- bad input
def bad_inputs(positive_g):
    """(message, keywords): a bad argument each; with ``positive_g`` the g > 0 case (refused for CPU
    tensors only), else the others."""
    p = fp32_inputs(generalized_problem(1, 1, 2, 8, 8, 1, 2, seed=8))
    if positive_g:
        yield "g is a log-decay", dict(p, g=p["g"].abs() + 1e-3)
        return
    yield "a", dict(p, a=p["a"][..., :4])
    yield "b", dict(p, b=p["b"][:, :, :, :1])
    yield "k", dict(p, k=p["k"].double())
    yield "v", dict(p, v=p["v"][:, :, :, :, 0])
    yield "g must have shape", dict(p, g=p["g"][..., :3])
    yield "initial_state", dict(p, initial_state=p["initial_state"][:, :, :4])
    yield "scale", dict(p, scale="0.5")
    yield "output_final_state", dict(p, output_final_state=1)


@pytest.mark.parametrize("match, kwargs", list(bad_inputs(False)), ids=[m for m, _ in bad_inputs(False)])
def test_bad_input_raises_value_error_naming_the_argument(backend, match, kwargs):
    with pytest.raises(ValueError, match=match):
        fused_recurrent_generalized(**on_backend(kwargs, backend))


@pytest.mark.parametrize("backend", backends("torch", "interpreter"), indirect=True)
@pytest.mark.parametrize("match, kwargs", list(bad_inputs(True)), ids=[m for m, _ in bad_inputs(True)])
def test_positive_log_decay_is_refused_on_cpu(backend, match, kwargs):
    with pytest.raises(ValueError, match=match):
        fused_recurrent_generalized(**kwargs)


# ----------------------------------------------------------------------------- the custom op
@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
@pytest.mark.parametrize("h0", [True, False])
def test_opcheck(backend, h0):
    """opcheck of the op and of its backward op (no initial state: a per-head g)."""
    p = {n: None if x is None else x.float().requires_grad_()
         for n, x in on_backend(generalized_problem(2, 3, 2, 8, 4, 2, 1, h0=h0, per_head_g=not h0), backend).items()}
    args = (*(p[n] for n in NAMES), 0.5, p["initial_state"])
    torch.library.opcheck(custom_ops.fused_recurrent_generalized_op, args)
    o, state = custom_ops.fused_recurrent_generalized_op(*args)
    detached = [t.detach() for t in args[:6]]
    torch.library.opcheck(custom_ops.fused_recurrent_generalized_backward_op,
                          (torch.randn_like(o), torch.randn_like(state), *detached, 0.5,
                           p["initial_state"].detach() if h0 else None))


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_compiled_equals_eager(backend):
    """The op under torch.compile(fullgraph=True): output, state and every gradient as in eager."""
    p = on_backend(fp32_inputs(generalized_problem(2, 3, 2, 8, 4, 2, 1, per_head_g=True)), backend)
    assert_compiled_equals_eager(lambda **kw: fused_recurrent_generalized(**kw, scale=0.5, output_final_state=True), p)
