"""causal_conv1d, the causal mixers' short convolution and Zoology's BaseConv, on every backend (tests/backends.py:
the PyTorch definition, the Triton kernels under the interpreter, on CUDA) against ``naive_causal_conv1d`` in
float64: the output and the gradients of x, the filter and the bias, with and without a bias, 1 to 5 taps, fewer
tokens than taps, token and channel counts that are not multiples of the kernels' blocks; the definition against
``nn.Conv1d`` as Zoology and the mixers ran it; bad input raising ValueError; the custom op under opcheck and
torch.compile; a mixer with a short convolution and the BaseConv equal to their nn.Conv1d form."""
import pytest
import torch
import torch.nn.functional as F

from hdla_vision.kernels import causal_conv1d, naive_causal_conv1d
from hdla_vision.kernels.short_conv import fused
from hdla_vision.layers import create_mixer
from hdla_vision.lm.zoology_lm import BaseConv
from tests.backends import CUDA_TOL, backend_cases, backends, device_of
from tests.oracle import rel_err
from tests.ops.compiled import assert_compiled_equals_eager

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def conv_problem(batch, seq_len, channels, taps, device="cpu", seed=0):
    """Random x ``[B, T, C]``, weight ``[C, K]`` and bias ``[C]``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen) / taps ** 0.5
    bias = torch.randn(channels, generator=gen)
    return [t.to(device) for t in (x, weight, bias)]


CASES = {  # (B, T, C, K, bias)
    "torch": [(2, 7, 12, 4, False), (1, 5, 6, 3, True)],
    "interpreter": [(2, 45, 200, 4, False), (1, 3, 130, 5, True), (1, 33, 64, 1, True), (3, 70, 24, 3, False),
                    (2, 300, 20, 4, True)],  # T > 256: two segments of the backward's programs
    "cuda": [(256, 256, 384, 4, False), (256, 256, 128, 3, True), (1, 4097, 200, 4, True)],
}


@pytest.mark.parametrize("backend,case", backend_cases(lambda c: "B{}_T{}_C{}_K{}_bias{}".format(*c), **CASES),
                         indirect=["backend"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_matches_float64_definition(backend, case, dtype):
    batch, seq_len, channels, taps, with_bias = case
    x, weight, bias = conv_problem(batch, seq_len, channels, taps, device_of(backend))
    bias = bias if with_bias else None
    leaves = [t.detach().requires_grad_() for t in (x.to(dtype), weight, bias) if t is not None]
    exact = [t.detach().double().requires_grad_() for t in leaves]
    out = causal_conv1d(*leaves)
    ref = naive_causal_conv1d(*exact)
    cotangent = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(ref.device)
    grads = torch.autograd.grad(out, leaves, cotangent.to(out.dtype))
    refs = torch.autograd.grad(ref, exact, cotangent)
    assert out.dtype == dtype and [g.dtype for g in grads] == [t.dtype for t in leaves]
    tol = (1e-5 if backend != "cuda" else 1e-4) if dtype == F32 else CUDA_TOL
    names = ("out", "dx", "dweight", "dbias")
    errors = {name: rel_err(a, b) for name, a, b in zip(names, (out, *grads), (ref, *refs))}
    assert all(e < tol for e in errors.values()), errors  # NaN fails


@pytest.mark.parametrize("taps", [1, 3, 4])
def test_definition_is_the_padded_depthwise_conv(taps):
    """naive_causal_conv1d is ``nn.Conv1d(C, C, K, groups=C, padding=K - 1)`` with the right end dropped (how
    Zoology's BaseConv computes it) and the mixers' ``F.conv1d`` on the sequence padded with K - 1 zeros in front,
    in float64."""
    x, weight, bias = (t.double() for t in conv_problem(2, 9, 6, taps))
    conv = torch.nn.Conv1d(6, 6, taps, groups=6, padding=taps - 1).double()
    with torch.no_grad():
        conv.weight.copy_(weight[:, None])
        conv.bias.copy_(bias)
    zoology = conv(x.transpose(1, 2))[..., :9].transpose(1, 2)
    mixer = F.conv1d(F.pad(x.transpose(1, 2), (taps - 1, 0)), weight[:, None], groups=6).transpose(1, 2)
    assert rel_err(naive_causal_conv1d(x, weight, bias), zoology) < 1e-14
    assert rel_err(naive_causal_conv1d(x, weight), mixer) < 1e-14


def test_bad_input_raises():
    x, weight, bias = conv_problem(1, 4, 6, 3)
    cases = [((x[0], weight), "x must have shape"), ((x, weight[:4]), "weight must have shape"),
             ((x, weight[:, None]), "weight must have shape"), ((x, torch.randn(6, 17)), "weight must have shape"),
             ((x, weight, bias[:2]), "bias must have shape"), ((x.long(), weight), "x must be a floating"),
             ((x, weight.int()), "weight must be a floating"), ((x, weight, "zeros"), "bias must be a floating")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            causal_conv1d(*args)


@pytest.mark.parametrize("backend", backends(), indirect=True)
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck(backend, with_bias):
    """The custom ops' fakes (shapes, dtypes, strides) and autograd against their implementations, the Triton
    ones included (interpreter, CUDA)."""
    x, weight, bias = conv_problem(2, 5, 8, 4, device_of(backend))
    args = (x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_() if with_bias else None)
    torch.library.opcheck(fused.causal_conv1d_op, args)
    torch.library.opcheck(fused.causal_conv1d_backward_op, (torch.randn_like(x), x.detach(), weight.detach()))


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_compiled_equals_eager(backend):
    x, weight, bias = conv_problem(1, 9, 8, 4, device_of(backend))
    assert_compiled_equals_eager(lambda x, weight, bias: (causal_conv1d(x, weight, bias), weight),
                                 dict(x=x, weight=weight, bias=bias))


def test_mixer_short_conv_equals_its_conv1d_form():
    """A causal mixer's short convolution without a cache (the op) against ``F.conv1d`` over the sequence padded
    in front, which it replaced, and against its own cached form (a window of zeros): the output and the
    filter's gradient in float64."""
    torch.manual_seed(0)
    mixer = create_mixer("gated_deltanet", dim=24, num_heads=2, directions=("fwd",), short_conv_size=4).double()
    proj = torch.randn(2, 7, mixer.conv.weight.shape[0], dtype=F64)
    out = mixer.short_conv(proj, None)
    ref = F.conv1d(F.pad(proj.transpose(1, 2), (3, 0)), mixer.conv.weight, groups=proj.shape[-1]).transpose(1, 2)
    assert rel_err(out, ref) < 1e-14
    grad, = torch.autograd.grad(mixer.short_conv(proj, None).square().sum(), mixer.conv.weight)
    grad_ref, = torch.autograd.grad(
        F.conv1d(F.pad(proj.transpose(1, 2), (3, 0)), mixer.conv.weight, groups=proj.shape[-1]).square().sum(),
        mixer.conv.weight)
    assert rel_err(grad, grad_ref) < 1e-12


def test_base_conv_equals_zoologys_form():
    """Zoology's BaseConv (conv(u) * (u W + b) + u, the conv padded on both sides and its right end dropped) with
    the op in place of nn.Conv1d: output and every parameter's gradient in float64."""
    torch.manual_seed(0)
    layer = BaseConv(16, 3).double()
    u = torch.randn(2, 11, 16, dtype=F64)

    def zoology(u):
        conv = layer.conv(u.transpose(1, 2))[..., :u.shape[1]].transpose(1, 2)
        return conv * layer.projection(u) + u

    runs = []
    for fn in (layer, zoology):
        out = fn(u)
        runs.append((out.detach(), torch.autograd.grad(out.square().sum(), list(layer.parameters()))))
    (out, grads), (ref, refs) = runs
    assert rel_err(out, ref) < 1e-14 and all(rel_err(a, b) < 1e-12 for a, b in zip(grads, refs))
