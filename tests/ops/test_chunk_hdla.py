"""chunk_hdla on every backend (tests/backends.py: the PyTorch chunk form, the Triton kernels under
the interpreter, the Triton kernels on CUDA) against HDLA's float64 token loop (explicit Householder
products): the output, the final state and every gradient; the log-decay and dtype contract; bad
input raising ValueError before any launch; the custom op under opcheck and torch.compile. The
float64 references themselves are checked first."""
import importlib.util

import pytest
import torch

from hdla_vision.kernels import chunk_hdla, custom_ops, hdla_decay_factors, naive_generalized, naive_hdla
from tests.ops.compiled import assert_compiled_equals_eager
from tests.backends import CUDA_TOL, backend_cases, backends, dtypes_id, on_backend
from tests.oracle import (LoopCase, assert_full_reset_forgets, assert_reset_gradients_zero_and_finite, case_name,
                          compare_with_loop, hdla_problem, rel_err)

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


# ----------------------------------------------------------------------------- the references
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


def test_hdla_loop_equals_generalized_loop_with_its_factors():
    p = hdla_problem(2, 19, 2, 8, 8)
    a, b = hdla_decay_factors(p["k"], p["beta"], p["g"])
    o1, s1 = naive_hdla(**p, output_final_state=True)
    o2, s2 = naive_generalized(p["q"], p["k"].unsqueeze(3), p["v"].unsqueeze(3), a, b, p["g"],
                               initial_state=p["initial_state"], output_final_state=True)
    assert rel_err(o1, o2) < 1e-12 and rel_err(s1, s2) < 1e-12


def test_hdla_is_rank_one_over_two_steps_per_token():
    """HDLA's step (I - beta k k^T) Diag(lambda) (I - beta k k^T) S + k v^T is two rank-one steps of the generalized
    loop (kernels/README.md §2): (I - beta k k^T) S with no decay and no write, then (Diag(lambda) - beta k
    (lambda k)^T) S + k v^T; the second step's output is the token's, the write key stays k (no division by beta),
    beta at 0 and 2 included."""
    p = hdla_problem(2, 13, 2, 8, 5, g_min=-20.0)
    p["beta"][0, :3] = 0.0
    p["beta"][1, :3] = 2.0
    q, k, v, beta, g = (p[n] for n in ("q", "k", "v", "beta", "g"))

    def steps(first, second):  # [B, T, H, ...] twice -> [B, 2T, H, ...], the first of each pair first
        return torch.stack([first, second], dim=2).flatten(1, 2)

    lam = g.exp()
    a = steps(beta.unsqueeze(-1) * k, beta.unsqueeze(-1) * k).unsqueeze(3)
    b = steps(k, lam * k).unsqueeze(3)
    o2, s2 = naive_generalized(steps(torch.zeros_like(q), q), steps(torch.zeros_like(k), k).unsqueeze(3),
                               steps(torch.zeros_like(v), v).unsqueeze(3), a, b, steps(torch.zeros_like(g), g),
                               initial_state=p["initial_state"], output_final_state=True)
    o1, s1 = naive_hdla(**p, output_final_state=True)
    assert rel_err(o2[:, 1::2], o1) < 1e-12 and rel_err(s2, s1) < 1e-12


def test_naive_loops_reset_and_stay_finite():
    """The two float64 references (Householder products; generalized loop on HDLA's factors) agree
    at resets (g = -inf), with finite gradients and dL/dg = 0 at g = -inf."""
    p = {n: x.requires_grad_() for n, x in hdla_problem(1, 12, 2, 6, 5, resets=0.3).items()}
    o1, s1 = naive_hdla(**p, output_final_state=True)
    a, b = hdla_decay_factors(p["k"], p["beta"], p["g"])
    o2, s2 = naive_generalized(p["q"], p["k"].unsqueeze(3), p["v"].unsqueeze(3), a, b, p["g"],
                               initial_state=p["initial_state"], output_final_state=True)
    assert rel_err(o1, o2) < 1e-12 and rel_err(s1, s2) < 1e-12
    (o1.square().sum() + s1.square().sum() + o2.sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in p.values())
    reset = torch.isinf(p["g"])
    assert reset.any() and (p["g"].grad[reset] == 0).all()


# ----------------------------------------------------------------------------- against the loop
def _case(name, batch, seq_len, heads, dk, dv, g_min=-3.0, h0=True, resets=0.0, dtype=F32, tol=1e-4, **op):
    problem = dict(batch=batch, seq_len=seq_len, heads=heads, dk=dk, dv=dv, g_min=g_min, h0=h0, resets=resets)
    return LoopCase(name, problem, op, dtype, tol)


CPU_CASES = [  # small head dims; T not a multiple of the chunk, batch 1, T = 1, reverse, gates to -20
    _case("B2_T37_H2_K8", 2, 37, 2, 8, 8),
    _case("B1_T21_K16_V8_rev_gates-20", 1, 21, 1, 16, 8, g_min=-20.0, reverse=True),
    _case("B1_T1_V4_rev_no_h0", 1, 1, 1, 8, 4, g_min=-1.0, h0=False, reverse=True),
    _case("B3_T70_V16_slow_decay", 3, 70, 2, 8, 16, g_min=-0.01),
    # g = -inf (full resets) on about 15% of the tokens and of the single channels: the exact limit
    _case("T29_rev_resets_f64", 2, 29, 2, 8, 8, resets=0.15, dtype=F64, tol=1e-10, reverse=True),
    _case("T29_rev_resets_f32", 2, 29, 2, 8, 8, resets=0.15, reverse=True),
]
INTERPRETER_CASES = [  # the Triton kernels' block sizes (K >= 16), kept small: the interpreter is slow
    _case("hdla_T37_B2_fwd", 2, 37, 2, 16, 16),
    _case("hdla_T21_rev_gates-20", 1, 21, 1, 32, 16, g_min=-20.0, reverse=True),
    _case("hdla_T5_B1_no_h0_scale", 1, 5, 1, 16, 32, h0=False, scale=0.5),
    _case("hdla_T16_dk24_dv40", 1, 16, 1, 24, 40, reverse=True),
    _case("hdla_T33_rev_resets", 1, 33, 1, 16, 16, resets=0.15, reverse=True),
]
CUDA_CASES = [  # realistic shapes; bf16, and fp32 with TF32 tensor-core products (~3e-3 measured)
    _case(f"B{b}_T{t}_H{h}_D{d}_gmin{g_min}{'_h0' if h0 else ''}{'_rev' if rev else ''}_{name}",
          b, t, h, d, d, g_min=g_min, h0=h0, dtype=dtype, tol=CUDA_TOL, reverse=rev)
    for b, t, h, d, g_min, h0, rev in [(8, 196, 3, 64, -3.0, False, False), (8, 196, 3, 64, -3.0, True, True),
                                       (1, 1000, 2, 128, -1.0, True, False), (2, 333, 2, 64, -20.0, True, True),
                                       (1, 77, 1, 32, -0.001, False, False)]
    for dtype, name in [(BF16, "bf16"), (F32, "fp32")]
]


@pytest.mark.parametrize("backend,case", backend_cases(case_name, torch=CPU_CASES,
                                                       interpreter=INTERPRETER_CASES, cuda=CUDA_CASES),
                         indirect=["backend"])
def test_matches_float64_loop(backend, case):
    """Output, final state and the gradients of q, k, v, beta, g and the initial state."""
    problem = on_backend(hdla_problem(**case.problem), backend)
    errors = compare_with_loop(chunk_hdla, "hdla", problem, dtype=case.dtype, **case.op)
    assert len(errors) >= 4, errors  # o, final state and gradients were all compared
    bad = {name: err for name, err in errors.items() if not err < case.tol}  # NaN fails too
    assert not bad, f"{case.name}: relative errors above {case.tol}: {bad}"


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
@pytest.mark.parametrize("backend", backends("cuda"), indirect=True)
def test_matches_fla_dplr_over_doubled_sequence(backend):
    """fla's chunk_dplr_delta_rule over the doubled sequence (kernels/README.md §6) as a second oracle."""
    from tools.fla_ops import fla_dplr_doubled

    problem = hdla_problem(2, 256, 2, 64, 64, h0=False, seed=3)
    q, k, v, beta, g = (problem[name].float().cuda() for name in ("q", "k", "v", "beta", "g"))
    ours = chunk_hdla(q, k, v, beta, g)[0]
    fla = fla_dplr_doubled(q, k, v, beta, g)
    ref = naive_hdla(*(t.double() for t in (q, k, v, beta, g)))[0]
    assert rel_err(fla, ref) < 5e-3  # the oracle itself agrees with the loop
    assert rel_err(ours, fla) < 5e-3


def test_bf16_inputs_return_bf16(backend):
    p = on_backend({n: x.bfloat16() for n, x in hdla_problem(1, 20, 1, 8, 8).items()}, backend)
    o, s = chunk_hdla(**p, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.bfloat16 and torch.isfinite(o.float()).all()


# ----------------------------------------------------------------------------- g = -inf, g > 0
@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_full_reset_forgets_everything_before_it(backend):
    """With lambda = 0 in every channel at token t the transition is 0: the outputs from t on equal
    the op run on the suffix from a zero state, and the earlier inputs get no gradient."""
    p = on_backend({n: x.float() for n, x in hdla_problem(1, 40, 2, 8, 8).items()}, backend)
    assert_full_reset_forgets(chunk_hdla, p, 21, CUDA_TOL if backend == "cuda" else 1e-5)


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_gradient_at_minus_inf_is_zero_and_all_finite(backend):
    p = on_backend({n: x.float() for n, x in hdla_problem(1, 33, 2, 8, 8, resets=0.2).items()}, backend)
    p = {n: x.requires_grad_() for n, x in p.items()}
    assert_reset_gradients_zero_and_finite(lambda **x: chunk_hdla(**x, output_final_state=True), p)


@pytest.mark.parametrize("backend", backends("torch", "interpreter"), indirect=True)
def test_positive_log_decay_is_refused_on_cpu(backend):
    """g > 0 is outside the domain: refused for CPU tensors (unchecked on CUDA: a host sync)."""
    p = {n: x.float() for n, x in hdla_problem(1, 5, 1, 8, 8).items()}
    chunk_hdla(**p)  # g <= 0 (zeros included) is fine
    p["g"][0, 3, 0, 2] = 1e-3
    with pytest.raises(ValueError, match=r"g is a log-decay and must be <= 0"):
        chunk_hdla(**p)


@pytest.mark.parametrize("backend", backends("torch"), indirect=True)
def test_compiled_op_raises_on_positive_log_decay(backend):
    """g <= 0 is checked inside the op, so a compiled graph refuses g > 0 too (a ValueError naming g)."""
    torch._dynamo.reset()
    p = {n: x.float() for n, x in hdla_problem(1, 8, 1, 8, 8).items()}
    compiled = torch.compile(lambda **kw: chunk_hdla(**kw)[0], fullgraph=True)
    compiled(**p)
    p["g"][0, 3, 0, 1] = 0.5
    with pytest.raises(ValueError, match="g is a log-decay and must be <= 0"):
        compiled(**p)


# ----------------------------------------------------------------------------- dtypes, bad input
def _with_dtypes(dtypes, backend):
    """A small problem with each input in ``dtypes[name]`` (default q's dtype)."""
    p = hdla_problem(1, 5, 2, 8, 8)
    return on_backend({n: x.to(dtypes.get(n, dtypes["q"])) for n, x in p.items()}, backend)


@pytest.mark.parametrize("dtypes", [dict(q=BF16, g=F32, beta=F32), dict(q=BF16, beta=F32)], ids=dtypes_id)
def test_dtype_rule_accepts(backend, dtypes):
    """k, v have q's dtype; beta and g q's dtype or float32 (bf16 inputs, fp32 or wider compute)."""
    p = _with_dtypes(dtypes, backend)
    o, _ = chunk_hdla(**p)
    assert torch.isfinite(o.float()).all()
    ref, _ = naive_hdla(**{n: x.double() for n, x in p.items()})
    assert rel_err(o, ref) < 2e-2


REFUSED = [  # (dtypes, message)
    (dict(q=BF16, k=F32), "k has dtype torch.float32; expected q's dtype torch.bfloat16"),
    (dict(q=F32, beta=F64), "beta has dtype torch.float64; expected torch.float32"),
]


@pytest.mark.parametrize("dtypes,message", REFUSED, ids=[dtypes_id(dtypes) for dtypes, _ in REFUSED])
def test_dtype_rule_refuses_naming_the_argument(backend, dtypes, message):
    with pytest.raises(ValueError) as info:
        chunk_hdla(**_with_dtypes(dtypes, backend))
    assert message in str(info.value)


@pytest.mark.parametrize("over,needle", [
    (dict(beta=torch.rand(1, 4, 3)), "beta must have shape [B, T, H]"),
    (dict(k=torch.randn(1, 4, 2, 9)), "k must have shape [B, T, H, K]"),
    (dict(v=torch.randn(1, 4, 2, 1, 8)), "v must have shape [B, T, H, V]"),
    (dict(g="x"), "g must be a torch.Tensor"),
])
def test_bad_input(backend, over, needle):
    p = on_backend({n: x.float() for n, x in hdla_problem(1, 4, 2, 8, 8).items()}, backend)
    p.update(on_backend(over, backend))
    with pytest.raises(ValueError) as info:
        chunk_hdla(**p)
    assert needle in str(info.value)


# ----------------------------------------------------------------------------- the custom op
def _float_leaves(problem, backend):
    return {n: None if x is None else x.float().requires_grad_() for n, x in on_backend(problem, backend).items()}


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
@pytest.mark.parametrize("final,reverse,h0", [(True, False, True), (False, True, False)])
def test_opcheck(backend, final, reverse, h0):
    """torch.library.opcheck: schema, autograd registration, fake implementation, AOT dispatch."""
    p = _float_leaves(hdla_problem(1, 20, 2, 8, 8, h0=h0), backend)
    args = (p["q"], p["k"], p["v"], p["beta"], p["g"], 1.0, p["initial_state"], final, reverse)
    torch.library.opcheck(custom_ops.chunk_hdla_op, args)


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_opcheck_backward_op(backend):
    h = on_backend({n: None if x is None else x.float() for n, x in hdla_problem(1, 18, 2, 8, 8, h0=False).items()},
                   backend)
    args = (h["q"], h["k"], h["v"], h["beta"], h["g"], 1.0, None, False, True)
    o, state, x = torch.ops.hdla_vision.chunk_hdla(*args)
    torch.library.opcheck(custom_ops.chunk_hdla_backward_op,
                          (torch.randn_like(o), None, *args[:5], None, x, state, 1.0, True))


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
@pytest.mark.parametrize("reverse", [False, True])
def test_compiled_equals_eager(backend, reverse):
    """The op under torch.compile(fullgraph=True): output, state and every gradient as in eager."""
    p = on_backend({n: x.float() for n, x in hdla_problem(1, 37, 2, 8, 8).items()}, backend)
    assert_compiled_equals_eager(lambda **kw: chunk_hdla(**kw, scale=0.5, output_final_state=True, reverse=reverse), p)
