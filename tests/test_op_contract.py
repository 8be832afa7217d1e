"""The ops' contract at its edges, on CPU tensors (the Triton kernels get the same cases under
TRITON_INTERPRET=1 in test_chunk_interpret.py / test_fused_recurrent*.py; chunk_hdla's are in
tests/ops/test_chunk_hdla.py on every backend):

* g = -inf (lambda = 0) is the exact reset, with finite outputs and gradients (dL/dg = 0 there);
* g > 0 is outside the domain and refused for CPU tensors;
* the dtype rule: k, v, a, b have q's dtype; g and beta have q's dtype or float32;
* at r_ab = 0 the empty a, b get empty gradients.
"""
import pytest
import torch

from hdla_vision.kernels import chunk_generalized, fused_recurrent_generalized, fused_recurrent_hdla
from hdla_vision.kernels.utils import LOG_ZERO_FP32, LOG_ZERO_FP64
from tests.oracle import compare_with_loop, generalized_problem, hdla_problem, rel_err

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


def fused(**kw):
    """fused_recurrent_hdla with chunk_hdla's keywords (no reverse; it always returns the state)."""
    assert not kw.pop("reverse")
    kw.pop("output_final_state")
    return fused_recurrent_hdla(**kw)


def fused_generalized(**kw):
    """fused_recurrent_generalized with chunk_generalized's keywords (no reverse)."""
    assert not kw.pop("reverse")
    return fused_recurrent_generalized(**kw)


# ----------------------------------------------------------------------------- g = -inf
def test_floors_underflow_to_exactly_zero():
    """The clamp is exact only if exp of the floor is 0 in the compute dtype."""
    assert torch.exp(torch.tensor(LOG_ZERO_FP32, dtype=F32)) == 0
    assert torch.exp(torch.tensor(LOG_ZERO_FP64, dtype=F64)) == 0


@pytest.mark.parametrize("r_ab,reverse", [(0, False), (2, True), (3, False)])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_generalized_reset_is_the_exact_limit(r_ab, reverse, dtype):
    """Against the float64 loop, where exp(-inf) = 0 resets the diagonal: output, state, all gradients."""
    inputs = generalized_problem(2, 37, 2, 8, 6, 2, r_ab, resets=0.15)
    assert torch.isinf(inputs["g"]).any()
    errors = compare_with_loop(chunk_generalized, "generalized", inputs, scale=0.5, reverse=reverse, dtype=dtype)
    tol = 1e-10 if dtype == F64 else 1e-4
    assert all(err < tol for err in errors.values()), errors  # NaN fails


@pytest.mark.parametrize("r_ab,per_head_g", [(0, False), (2, True), (3, False)])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_fused_generalized_reset_is_the_exact_limit(r_ab, per_head_g, dtype):
    """The decoding op against the float64 loop at resets: output, state, all gradients."""
    inputs = generalized_problem(2, 9, 2, 8, 6, 2, r_ab, resets=0.2, per_head_g=per_head_g)
    assert torch.isinf(inputs["g"]).any()
    errors = compare_with_loop(fused_generalized, "generalized", inputs, scale=0.5, dtype=dtype)
    tol = 1e-10 if dtype == F64 else 1e-4
    assert all(err < tol for err in errors.values()), errors


@pytest.mark.parametrize("op", [fused], ids=["fused_recurrent_hdla"])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_hdla_reset_is_the_exact_limit(op, dtype):
    inputs = hdla_problem(2, 29, 2, 8, 8, resets=0.15)
    errors = compare_with_loop(op, "hdla", inputs, reverse=False, dtype=dtype)
    tol = 1e-10 if dtype == F64 else 1e-4
    assert all(err < tol for err in errors.values()), errors


@pytest.mark.parametrize("kind", ["gla"])
def test_full_reset_forgets_everything_before_it(kind):
    """With lambda = 0 in every channel at token t, GLA's transitions are 0: the outputs from t on
    equal the op run on the suffix from a zero state, and the earlier inputs get no gradient."""
    t = 21
    p = generalized_problem(1, 40, 2, 8, 8, 1, 0)
    op = chunk_generalized
    p = {n: x.float() for n, x in p.items()}
    p["g"][:, t] = float("-inf")
    p["q"].requires_grad_()
    p["v"].requires_grad_()
    o, _ = op(**p)
    suffix = {n: (x[:, t:] if n != "initial_state" else None) for n, x in p.items()}
    o_suffix, _ = op(**suffix)
    assert rel_err(o[:, t:], o_suffix) < 1e-5
    o[:, t:].square().sum().backward()
    assert p["v"].grad[:, :t].abs().max() == 0 and p["v"].grad[:, t:].abs().max() > 0


@pytest.mark.parametrize("op", ["generalized", "fused"])
def test_gradient_at_minus_inf_is_zero_and_all_finite(op):
    if op == "generalized":
        p = generalized_problem(1, 33, 2, 8, 8, 1, 2, resets=0.2)
        fn = chunk_generalized
    else:
        p = hdla_problem(1, 5, 2, 8, 8, resets=0.2)
        fn = fused_recurrent_hdla
    p = {n: x.float().requires_grad_() for n, x in p.items()}
    o, s = fn(**p) if op == "fused" else fn(**p, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    (o.square().sum() + s.square().sum()).backward()
    for name, x in p.items():
        assert torch.isfinite(x.grad).all(), name
    reset = torch.isinf(p["g"])
    assert reset.any() and (p["g"].grad[reset] == 0).all()
    assert (p["g"].grad[~reset] != 0).float().mean() > 0.5  # the other entries are real gradients


# ----------------------------------------------------------------------------- g > 0
@pytest.mark.parametrize("op", ["generalized", "fused"])
def test_positive_log_decay_is_refused_on_cpu(op):
    if op == "generalized":
        p = {n: x.float() for n, x in generalized_problem(1, 5, 1, 8, 8, 1, 2).items()}
        fn = chunk_generalized
    else:
        p = {n: x.float() for n, x in hdla_problem(1, 5, 1, 8, 8).items()}
        fn = fused_recurrent_hdla
    fn(**p)  # g <= 0 (zeros included) is fine
    p["g"][0, 3, 0, 2] = 1e-3
    with pytest.raises(ValueError, match=r"g is a log-decay and must be <= 0"):
        fn(**p)


# ----------------------------------------------------------------------------- dtypes
def _generalized(dtypes):
    p = generalized_problem(1, 5, 2, 8, 8, 1, 2)
    return {n: x.to(dtypes.get(n, dtypes["q"])) for n, x in p.items()}


def _hdla(dtypes):
    p = hdla_problem(1, 5, 2, 8, 8)
    return {n: x.to(dtypes.get(n, dtypes["q"])) for n, x in p.items()}


ACCEPTED = [  # (op, dtypes): the rule's allowed mixes
    ("generalized", dict(q=BF16, g=F32)),
    ("generalized", dict(q=F16, g=F32, initial_state=F32)),
    ("generalized", dict(q=F64, g=F32)),
    ("fused", dict(q=BF16, g=F32, beta=F32, initial_state=F32)),
    ("fused_generalized", dict(q=BF16, g=F32, initial_state=F32)),
    ("fused_generalized", dict(q=F16, g=F16)),
]
REFUSED = [  # (op, dtypes, message)
    ("generalized", dict(q=BF16, k=F32), "k has dtype torch.float32; expected q's dtype torch.bfloat16"),
    ("generalized", dict(q=F32, v=BF16), "v has dtype torch.bfloat16; expected q's dtype torch.float32"),
    ("generalized", dict(q=F32, a=F64), "a has dtype torch.float64; expected q's dtype torch.float32"),
    ("generalized", dict(q=BF16, b=F16), "b has dtype torch.float16; expected q's dtype torch.bfloat16"),
    ("generalized", dict(q=BF16, g=F16), "g has dtype torch.float16; expected q's dtype torch.bfloat16 or torch.float32"),
    ("generalized", dict(q=F32, g=F64), "g has dtype torch.float64; expected torch.float32"),
    ("fused", dict(q=BF16, v=F32), "v has dtype torch.float32; expected q's dtype torch.bfloat16"),
    ("fused_generalized", dict(q=BF16, a=F32), "a has dtype torch.float32; expected q's dtype torch.bfloat16"),
    ("fused_generalized", dict(q=F32, g=F64), "g has dtype torch.float64; expected torch.float32"),
]
OPS = {"generalized": (chunk_generalized, _generalized),
       "fused": (fused_recurrent_hdla, _hdla), "fused_generalized": (fused_recurrent_generalized, _generalized)}


@pytest.mark.parametrize("op,dtypes", ACCEPTED)
def test_dtype_rule_accepts(op, dtypes):
    fn, make = OPS[op]
    p = make(dtypes)
    o, _ = fn(**p)
    assert torch.isfinite(o.float()).all()
    ref, _ = fn(**{n: x.double() for n, x in p.items()})
    assert rel_err(o, ref) < 2e-2  # bf16 inputs, fp32 (or wider) compute


@pytest.mark.parametrize("op,dtypes,message", REFUSED)
def test_dtype_rule_refuses_naming_the_argument(op, dtypes, message):
    fn, make = OPS[op]
    with pytest.raises(ValueError) as info:
        fn(**make(dtypes))
    assert message in str(info.value)


# ----------------------------------------------------------------------------- r_ab = 0
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("use", ["output", "state"])
def test_empty_rank_inputs_get_empty_gradients(reverse, use):
    p = {n: x.float().requires_grad_() for n, x in generalized_problem(1, 20, 2, 8, 8, 1, 0).items()}
    o, s = chunk_generalized(**p, output_final_state=True, reverse=reverse)
    (o if use == "output" else s).square().sum().backward()
    for name in ("a", "b"):
        assert p[name].grad is not None, f"{name}.grad is None"
        assert p[name].grad.shape == p[name].shape == (1, 20, 2, 0, 8)
