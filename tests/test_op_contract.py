"""fused_recurrent_generalized's contract at its edges, on CPU tensors (the other ops' are in
tests/ops/ on every backend):

* g = -inf (lambda = 0) is the exact reset, with finite outputs and gradients;
* the dtype rule: k, v, a, b have q's dtype; g has q's dtype or float32.
"""
import pytest
import torch

from hdla_vision.kernels import fused_recurrent_generalized
from tests.oracle import compare_with_loop, generalized_problem, rel_err

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


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


# ----------------------------------------------------------------------------- dtypes
def _generalized(dtypes):
    p = generalized_problem(1, 5, 2, 8, 8, 1, 2)
    return {n: x.to(dtypes.get(n, dtypes["q"])) for n, x in p.items()}


ACCEPTED = [  # (op, dtypes): the rule's allowed mixes
    ("fused_generalized", dict(q=BF16, g=F32, initial_state=F32)),
    ("fused_generalized", dict(q=F16, g=F16)),
]
REFUSED = [  # (op, dtypes, message)
    ("fused_generalized", dict(q=BF16, a=F32), "a has dtype torch.float32; expected q's dtype torch.bfloat16"),
    ("fused_generalized", dict(q=F32, g=F64), "g has dtype torch.float64; expected torch.float32"),
]
OPS = {"fused_generalized": (fused_recurrent_generalized, _generalized)}


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
