"""mixer_prologue, the fused activations between a mixer's projections and its scan op, on every backend
(tests/backends.py: the PyTorch definition, the Triton kernels under the interpreter, on CUDA) against
``naive_mixer_prologue`` in float64: outputs and both input gradients, one and two directions, head dims
that are not powers of two, a head whose SiLU'd k is below the norm's eps, padding columns (gradient 0),
q normalised or not; bad input raising ValueError; the custom op under opcheck and torch.compile."""
import pytest
import torch

from hdla_vision.kernels import mixer_prologue, naive_mixer_prologue
from hdla_vision.kernels.prologue import fused
from tests.backends import CUDA_TOL, backend_cases, backends, device_of
from tests.ops.compiled import assert_compiled_equals_eager

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def prologue_problem(batch, seq_len, heads, dk, dv, directions, pad=3, dtype=F32, device="cpu", seed=0):
    """Random ``proj [B, N, 2HK + HV + DH + pad]`` and ``decay_logits [D, B, N, HK]``: logits of a few units
    (every activation's curved part), and token 1's first k head at -30 (SiLU ~ 1e-12: its norm below eps)."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * heads * dk + heads * dv + directions * heads + pad
    proj = 3 * torch.randn(batch, seq_len, width, generator=gen)
    proj[:, min(1, seq_len - 1), heads * dk:heads * dk + dk] = -30.0
    logits = 4 * torch.randn(directions, batch, seq_len, heads * dk, generator=gen)
    return proj.to(device=device, dtype=dtype), logits.to(device=device, dtype=dtype)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def outputs_and_grads(fn, proj, logits, options, cotangents):
    proj, logits = (t.detach().requires_grad_() for t in (proj, logits))
    outs = fn(proj, logits, *options)
    grads = torch.autograd.grad(outs, (proj, logits), [c.to(o.dtype) for c, o in zip(cotangents, outs)])
    return outs, grads


CASES = {  # (B, N, H, K, V, D, normalize_q)
    "torch": [(2, 7, 3, 16, 16, 2, False), (1, 5, 2, 12, 20, 1, True)],
    "interpreter": [(2, 37, 3, 16, 24, 2, False), (1, 19, 2, 12, 20, 1, True), (1, 3, 1, 64, 64, 2, True)],
    "cuda": [(4, 196, 3, 64, 64, 2, False), (2, 1000, 4, 128, 96, 1, True)],
}


def _case_id(case):
    return "B{}_N{}_H{}_K{}_V{}_D{}_normq{}".format(*case)


@pytest.mark.parametrize("backend,case", backend_cases(_case_id, **CASES), indirect=["backend"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_matches_float64_definition(backend, case, dtype):
    """q, k, v, beta, g and d proj, d decay_logits against the definition in float64."""
    batch, seq_len, heads, dk, dv, directions, normalize_q = case
    proj, logits = prologue_problem(batch, seq_len, heads, dk, dv, directions, device=device_of(backend))
    proj, logits = proj.to(dtype), logits.to(dtype)
    options = (heads, dk, dv, 2.0)
    ref_outs = naive_mixer_prologue(proj.double(), logits.double(), *options, 1 / 1.5, 1e-5, normalize_q)
    gen = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(o.shape, generator=gen, dtype=F64).to(proj.device) for o in ref_outs]
    ref_outs, ref_grads = outputs_and_grads(
        lambda p, g, *o: naive_mixer_prologue(p, g, *o, 1 / 1.5, 1e-5, normalize_q), proj.double(), logits.double(),
        options, cotangents)
    outs, grads = outputs_and_grads(lambda p, g, *o: mixer_prologue(p, g, *o, tau=1.5, normalize_q=normalize_q),
                                    proj, logits, options, cotangents)
    assert [o.dtype for o in outs] == [dtype] * 3 + [F32] * 2
    assert [g.dtype for g in grads] == [dtype, dtype]
    tol = (1e-5 if backend != "cuda" else 1e-4) if dtype == F32 else CUDA_TOL
    errors = {name: rel(a, b) for name, a, b in zip(("q", "k", "v", "beta", "g", "dproj", "dlogits"),
                                                       (*outs, *grads), (*ref_outs, *ref_grads))}
    assert all(e < tol for e in errors.values()), errors
    assert torch.all(grads[0][..., 2 * heads * dk + heads * dv + directions * heads:] == 0)
    assert all(torch.isfinite(t).all() for t in (*outs, *grads))


@pytest.mark.parametrize("backend", backends("torch", "interpreter"), indirect=True)
def test_strided_proj(backend):
    """proj as a column slice of a wider projection (rows not contiguous): the same outputs and gradients as
    from a contiguous copy."""
    proj, logits = prologue_problem(2, 6, 2, 8, 8, 2, pad=0, device=device_of(backend))
    wide = torch.cat([proj, torch.randn(2, 6, 5, device=proj.device)], dim=-1)
    runs = []
    for x in (wide[..., :proj.shape[-1]], proj.clone()):
        leaf = x.detach().requires_grad_() if x.is_contiguous() else None
        source = wide.detach().clone().requires_grad_() if leaf is None else leaf
        arg = source[..., :proj.shape[-1]] if leaf is None else leaf
        outs = mixer_prologue(arg, logits, 2, 8, 8, 2.0)
        sum(o.float().square().sum() for o in outs).backward()
        runs.append(([o.detach() for o in outs], source.grad[..., :proj.shape[-1]]))
    for a, b in zip(runs[0][0] + [runs[0][1]], runs[1][0] + [runs[1][1]]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", backends("torch", "interpreter"), indirect=True)
def test_small_norm_takes_eps(backend):
    """A k head whose SiLU is ~1e-12 is divided by eps, not by its norm (F.normalize's rule), and its
    gradient is dk / eps times SiLU' (no term through the norm)."""
    proj, logits = prologue_problem(1, 3, 1, 8, 8, 1, pad=0, device=device_of(backend))
    _, k, *_ = mixer_prologue(proj, logits, 1, 8, 8, 1.0, eps=1e-5)
    silu = torch.nn.functional.silu(proj[0, 1, 8:16].double())
    assert torch.allclose(k[0, 1, 0].double(), silu / 1e-5, rtol=1e-5, atol=0)


def test_bad_input_raises_before_any_launch():
    proj, logits = prologue_problem(1, 4, 2, 8, 8, 2)
    cases = [
        ((proj[0], logits, 2, 8, 8, 2.0), "proj must have shape"),
        ((proj, logits[:, :, :3], 2, 8, 8, 2.0), "decay_logits must have shape"),
        ((proj, torch.cat([logits, logits[:1]]), 2, 8, 8, 2.0), "decay_logits must have shape"),
        ((proj[..., :40], logits, 2, 8, 8, 2.0), "at least"),
        ((proj, logits, 0, 8, 8, 2.0), "heads must be a positive int"),
        ((proj.long(), logits, 2, 8, 8, 2.0), "proj must be a floating-point tensor"),
        ((proj, logits, 2, 8, 8, 2.0, -1.0), "tau must be > 0"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            mixer_prologue(*args)


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_opcheck(backend):
    proj, logits = prologue_problem(2, 5, 2, 8, 12, 2, device=device_of(backend))
    args = (proj.requires_grad_(), logits.requires_grad_(), 2, 8, 12, 2.0, 0.5, 1e-5, False)
    torch.library.opcheck(fused.mixer_prologue_op, args)
    outs = fused.mixer_prologue_op(*args)
    torch.library.opcheck(fused.mixer_prologue_backward_op,
                          (*(torch.randn_like(o) for o in outs), proj.detach(), logits.detach(), *args[2:]))


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_compiled_equals_eager(backend):
    """The op under torch.compile(fullgraph=True): every output and gradient as in eager."""
    proj, logits = prologue_problem(1, 9, 2, 8, 8, 2, device=device_of(backend))

    def op(proj, decay_logits):  # -> (the three bf16-or-proj-dtype outputs, the two gates), flattened
        q, k, v, beta, g = mixer_prologue(proj, decay_logits, 2, 8, 8, 2.0)
        return torch.cat([q.flatten(), k.flatten(), v.flatten()]), torch.cat([beta.flatten(), g.flatten()])

    assert_compiled_equals_eager(op, dict(proj=proj, decay_logits=logits))
