"""The decoding ops' contract at its edges, on CPU tensors (the Triton kernels get the same cases under
TRITON_INTERPRET=1 in test_fused_recurrent*.py; the chunk ops' are in tests/ops/ on every backend):

* g = -inf (lambda = 0) is the exact reset, with finite outputs and gradients (dL/dg = 0 there);
* g > 0 is outside the domain and refused for CPU tensors;
* the dtype rule: k, v, a, b have q's dtype; g and beta have q's dtype or float32.
"""
import pytest
import torch

from hdla_vision.kernels import fused_recurrent_generalized, fused_recurrent_hdla
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


@pytest.mark.parametrize("op", ["fused"])
def test_gradient_at_minus_inf_is_zero_and_all_finite(op):
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
@pytest.mark.parametrize("op", ["fused"])
def test_positive_log_decay_is_refused_on_cpu(op):
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
    ("fused", dict(q=BF16, g=F32, beta=F32, initial_state=F32)),
    ("fused_generalized", dict(q=BF16, g=F32, initial_state=F32)),
    ("fused_generalized", dict(q=F16, g=F16)),
]
REFUSED = [  # (op, dtypes, message)
    ("fused", dict(q=BF16, v=F32), "v has dtype torch.float32; expected q's dtype torch.bfloat16"),
    ("fused_generalized", dict(q=BF16, a=F32), "a has dtype torch.float32; expected q's dtype torch.bfloat16"),
    ("fused_generalized", dict(q=F32, g=F64), "g has dtype torch.float64; expected torch.float32"),
]
OPS = {"fused": (fused_recurrent_hdla, _hdla), "fused_generalized": (fused_recurrent_generalized, _generalized)}


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
