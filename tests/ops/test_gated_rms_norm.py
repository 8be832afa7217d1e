"""gated_rms_norm, every mixer's output stage (per-head RMS norm times the activated gate), on every backend
(tests/backends.py: the PyTorch definition, the Triton kernels under the interpreter, on CUDA) against
``naive_gated_rms_norm`` in float64: the output and the gradients of y, the gate and the norm's weight for
each activation, head dims that are not powers of two, a head of zeros (the norm's eps), token counts
that are not multiples of the kernels' block; bad input raising ValueError; the custom op under opcheck
and torch.compile; the mixers' output stage equal to the composition of PyTorch ops it replaces."""
import pytest
import torch
import torch.nn.functional as F

from hdla_vision.kernels import gated_rms_norm, naive_gated_rms_norm
from hdla_vision.kernels.gated_norm import fused
from hdla_vision.layers import create_mixer
from tests.backends import CUDA_TOL, backend_cases, backends, device_of
from tests.ops.compiled import assert_compiled_equals_eager

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def norm_problem(batch, seq_len, heads, dv, device="cpu", seed=0):
    """Random y ``[B, N, H, V]`` (token 0's first head all zeros), gate ``[B, N, H*V]``, weight ``[V]`` near 1."""
    gen = torch.Generator().manual_seed(seed)
    y = 2 * torch.randn(batch, seq_len, heads, dv, generator=gen)
    y[0, 0, 0] = 0.0
    gate = 2 * torch.randn(batch, seq_len, heads * dv, generator=gen)
    weight = 1 + 0.3 * torch.randn(dv, generator=gen)
    return [t.to(device) for t in (y, gate, weight)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CASES = {  # (B, N, H, V, act)
    "torch": [(2, 7, 3, 16, "silu"), (1, 5, 2, 12, "sigmoid")],
    "interpreter": [(2, 37, 3, 16, "silu"), (1, 19, 2, 20, "sigmoid"), (1, 33, 1, 64, "identity")],
    "cuda": [(64, 196, 3, 64, "silu"), (2, 1000, 4, 96, "sigmoid")],
}


@pytest.mark.parametrize("backend,case", backend_cases(lambda c: "B{}_N{}_H{}_V{}_{}".format(*c), **CASES),
                         indirect=["backend"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_matches_float64_definition(backend, case, dtype):
    batch, seq_len, heads, dv, act = case
    y, gate, weight = norm_problem(batch, seq_len, heads, dv, device_of(backend))
    y, gate = y.to(dtype), gate.to(dtype)
    leaves = [t.detach().requires_grad_() for t in (y, gate, weight)]
    exact = [t.detach().double().requires_grad_() for t in (y, gate, weight)]
    out = gated_rms_norm(*leaves, 1e-5, act)
    ref = naive_gated_rms_norm(*exact, 1e-5, act)
    cotangent = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(ref.device)
    grads = torch.autograd.grad(out, leaves, cotangent.to(out.dtype))
    refs = torch.autograd.grad(ref, exact, cotangent)
    assert out.dtype == dtype and [g.dtype for g in grads] == [dtype, dtype, F32]
    tol = (1e-5 if backend != "cuda" else 1e-4) if dtype == F32 else CUDA_TOL
    errors = {name: rel(a, b) for name, a, b in zip(("out", "dy", "dgate", "dweight"), (out, *grads), (ref, *refs))}
    assert all(e < tol for e in errors.values()), errors
    assert all(torch.isfinite(t).all() for t in (out, *grads))


def test_bad_input_raises():
    y, gate, weight = norm_problem(1, 4, 2, 8)
    cases = [((y[0], gate, weight), "y must have shape"), ((y, gate[..., :8], weight), "gate must have shape"),
             ((y, gate, weight[:4]), "weight must have shape"), ((y.long(), gate, weight), "y must be a floating"),
             ((y, gate, weight, 1e-5, "gelu"), "act must be one of")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            gated_rms_norm(*args)


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_opcheck(backend):
    y, gate, weight = norm_problem(2, 5, 2, 8, device_of(backend))
    args = (y.requires_grad_(), gate.requires_grad_(), weight.requires_grad_(), 1e-5, "silu")
    torch.library.opcheck(fused.gated_rms_norm_op, args)
    torch.library.opcheck(fused.gated_rms_norm_backward_op, (torch.randn_like(gate), y.detach(), gate.detach(),
                                                             weight.detach(), 1e-5, "silu"))


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_compiled_equals_eager(backend):
    y, gate, weight = norm_problem(1, 9, 2, 8, device_of(backend))
    assert_compiled_equals_eager(lambda y, gate, weight: (gated_rms_norm(y, gate, weight), weight),
                                 dict(y=y, gate=gate, weight=weight))


@pytest.mark.parametrize("gate_act", ["silu", "sigmoid", "identity"])
def test_mixer_output_stage_equals_its_composition(gate_act):
    """The mixers' gated_norm (the op) against the PyTorch composition it replaced: F.rms_norm per head
    times act(x W_g), output and every gradient in float64."""
    torch.manual_seed(0)
    mixer = create_mixer("gla", dim=24, num_heads=2, directions=("fwd",), gate_act=gate_act).double()
    y = torch.randn(2, 7, 2, 12, dtype=F64, requires_grad=True)
    x = torch.randn(2, 7, 24, dtype=F64, requires_grad=True)
    runs = []
    for composed in (False, True):
        mixer.zero_grad(set_to_none=True)
        if composed:
            normed = F.rms_norm(y, (12,), mixer.norm.weight, mixer.norm_eps).reshape(2, 7, 24)
            out = normed * mixer.gate_activation(mixer.gate(x))
        else:
            out = mixer.gated_norm(y, x)
        grads = torch.autograd.grad(out.square().sum(), [y, x, mixer.norm.weight, mixer.gate.weight])
        runs.append((out.detach(), grads))
    (out, grads), (ref, refs) = runs
    assert rel(out, ref) < 1e-12 and all(rel(a, b) < 1e-12 for a, b in zip(grads, refs))
