"""The gated per-head RMS norm as two Triton kernels and the custom op ``hdla_vision::gated_rms_norm``:
every mixer's output stage before ``W_o`` in one launch forward and two backward (issue 12 part 2: fuse
the output RMSNorm and the gate where the tile holds whole heads).

    gated_rms_norm(y, gate, weight, eps, act) -> [B, N, H*V]

is :func:`~hdla_vision.kernels.gated_norm.naive.naive_gated_rms_norm` (its docstring gives the math). The
backward recomputes the norm from y: with ``r = rsqrt(mean(y^2) + eps)``, ``n = w y r``, ``a = act(z)``,

    dz = dout n act'(z),   c = w (dout a),   dy = r c - y r^3 mean(c y),   dw = sum over rows of dout a y r

``act'``: ``s (1 + z (1 - s))`` (SiLU), ``s (1 - s)`` (sigmoid), 1. dw is summed per program in fp32, then
over the programs. Paths: the Triton kernels for CUDA tensors and, under ``TRITON_INTERPRET=1``, CPU
tensors (fp32, bf16, fp16); the PyTorch definition for CPU tensors otherwise, float64, and ONNX export.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..custom_ops import NAMESPACE, _autograd_inside_op
from ..ops import exporting_to_onnx
from ..utils import cdiv, next_power_of_2, use_triton
from .naive import ACTIVATIONS, naive_gated_rms_norm

BLOCK_ROWS = 32
ACT_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}  # constexpr ACT of the kernels


@triton.jit
def _activation(z, ACT: tl.constexpr):
    """act(z) and act'(z) for fp32 z (ACT: 0 SiLU, 1 sigmoid, 2 identity)."""
    if ACT == 0:
        s = tl.sigmoid(z)
        return z * s, s * (1.0 + z * (1.0 - s))
    elif ACT == 1:
        s = tl.sigmoid(z)
        return s, s * (1.0 - s)
    else:
        return z, tl.full(z.shape, 1.0, tl.float32)


@triton.jit
def _tiles(y, gate, w, rows, n_rows, h, n_heads, eps, DV: tl.constexpr, BV: tl.constexpr):
    """y, z tiles of head h (fp32), the mask, the weight row, r = rsqrt(mean(y^2) + eps) and the offsets."""
    cv = tl.arange(0, BV)
    mask = (rows[:, None] < n_rows) & (cv[None, :] < DV)
    offs = (rows[:, None] * n_heads + h) * DV + cv[None, :]  # y [M, H, V] and z [M, H*V] share this layout
    yt = tl.load(y + offs, mask=mask, other=0.0).to(tl.float32)
    zt = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
    wt = tl.load(w + cv, mask=cv < DV, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(yt * yt, axis=1) / DV + eps)
    return yt, zt, wt, r, mask, offs


@triton.jit
def gated_norm_fwd_kernel(y, gate, w, out, n_rows, n_heads, eps, ACT: tl.constexpr, DV: tl.constexpr,
                          BV: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    yt, zt, wt, r, mask, offs = _tiles(y, gate, w, rows, n_rows, tl.program_id(1), n_heads, eps, DV, BV)
    a, _ = _activation(zt, ACT)
    tl.store(out + offs, (yt * r[:, None] * wt[None, :] * a).to(out.dtype.element_ty), mask=mask)


@triton.jit
def gated_norm_bwd_kernel(dout, y, gate, w, dy, dgate, dw_part, n_rows, n_heads, eps, ACT: tl.constexpr,
                          DV: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr):
    pid, h = tl.program_id(0), tl.program_id(1)
    rows = pid * BM + tl.arange(0, BM)
    yt, zt, wt, r, mask, offs = _tiles(y, gate, w, rows, n_rows, h, n_heads, eps, DV, BV)
    a, da = _activation(zt, ACT)
    go = tl.load(dout + offs, mask=mask, other=0.0).to(tl.float32)
    normed = yt * r[:, None]
    tl.store(dgate + offs, (go * normed * wt[None, :] * da).to(dgate.dtype.element_ty), mask=mask)
    c = go * a * wt[None, :]
    dyt = r[:, None] * c - yt * (r * r * r * tl.sum(c * yt, axis=1) / DV)[:, None]
    tl.store(dy + offs, dyt.to(dy.dtype.element_ty), mask=mask)
    cv = tl.arange(0, BV)
    tl.store(dw_part + (pid * n_heads + h) * BV + cv, tl.sum(go * a * normed, axis=0), mask=cv < DV)


def _launch_meta(act: str, head_dim_v: int) -> dict:
    return dict(ACT=ACT_CODES[act], DV=head_dim_v, BV=next_power_of_2(head_dim_v), BM=BLOCK_ROWS, num_warps=4)


def _triton_runs(y: Tensor) -> bool:
    return use_triton(y) and y.dtype != torch.float64


@torch.library.custom_op(f"{NAMESPACE}::gated_rms_norm", mutates_args=())
def gated_rms_norm_op(y: Tensor, gate: Tensor, weight: Tensor, eps: float, act: str) -> Tensor:
    """``out [B, N, H*V]`` on checked inputs (:func:`gated_rms_norm`)."""
    if not _triton_runs(y) or gate.dtype == torch.float64:
        return naive_gated_rms_norm(y, gate, weight, eps, act)
    batch, seq_len, heads, head_dim_v = y.shape
    out = torch.empty(gate.shape, dtype=torch.promote_types(y.dtype, gate.dtype), device=y.device)
    n_rows = batch * seq_len
    gated_norm_fwd_kernel[(cdiv(n_rows, BLOCK_ROWS), heads)](
        y.contiguous(), gate.contiguous(), weight.contiguous(), out, n_rows, heads, float(eps),
        **_launch_meta(act, head_dim_v))
    return out


@gated_rms_norm_op.register_fake
def _(y, gate, weight, eps, act):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(y.dtype, gate.dtype))


@torch.library.custom_op(f"{NAMESPACE}::gated_rms_norm_backward", mutates_args=())
def gated_rms_norm_backward_op(dout: Tensor, y: Tensor, gate: Tensor, weight: Tensor, eps: float, act: str
                               ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dy, dgate, dweight)`` in the inputs' dtypes."""
    if not _triton_runs(y) or gate.dtype == torch.float64:
        with _autograd_inside_op():
            inputs = [t.detach().requires_grad_() for t in (y, gate, weight)]
            out = naive_gated_rms_norm(*inputs, eps, act)
            return torch.autograd.grad(out, inputs, dout)
    batch, seq_len, heads, head_dim_v = y.shape
    n_rows = batch * seq_len
    programs = cdiv(n_rows, BLOCK_ROWS)
    meta = _launch_meta(act, head_dim_v)
    dy, dgate = torch.empty_like(y, memory_format=torch.contiguous_format), torch.empty_like(
        gate, memory_format=torch.contiguous_format)
    dw_part = torch.empty(programs * heads, meta["BV"], dtype=torch.float32, device=y.device)
    gated_norm_bwd_kernel[(programs, heads)](dout.contiguous(), y.contiguous(), gate.contiguous(),
                                             weight.contiguous(), dy, dgate, dw_part, n_rows, heads, float(eps),
                                             **meta)
    return dy, dgate, dw_part[:, :head_dim_v].sum(0).to(weight.dtype)


@gated_rms_norm_backward_op.register_fake
def _(dout, y, gate, weight, eps, act):
    return torch.empty_like(y), torch.empty_like(gate), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    y, gate, weight, ctx.eps, ctx.act = inputs
    ctx.save_for_backward(y, gate, weight)


def _backward(ctx, dout):
    y, gate, weight = ctx.saved_tensors
    return (*gated_rms_norm_backward_op(dout, y, gate, weight, ctx.eps, ctx.act), None, None)


gated_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def _check(y, gate, weight, act) -> None:
    for name, x in dict(y=y, gate=gate, weight=weight).items():
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {type(x).__name__}"
                             f"{'' if not isinstance(x, Tensor) else ' of ' + str(x.dtype)}")
    if y.dim() != 4:
        raise ValueError(f"y must have shape [B, N, H, V], got {list(y.shape)}")
    batch, seq_len, heads, head_dim_v = y.shape
    if tuple(gate.shape) != (batch, seq_len, heads * head_dim_v):
        raise ValueError(f"gate must have shape [B, N, H*V] = {[batch, seq_len, heads * head_dim_v]}, "
                         f"got {list(gate.shape)}")
    if tuple(weight.shape) != (head_dim_v,):
        raise ValueError(f"weight must have shape [V] = [{head_dim_v}], got {list(weight.shape)}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    if gate.device != y.device or weight.device != y.device:
        raise ValueError(f"gate and weight must be on y's device {y.device}, got {gate.device} and {weight.device}")


def gated_rms_norm(y: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-5, act: str = "silu") -> Tensor:
    """``(weight * y * rsqrt(mean(y^2) + eps)) * act(gate)`` per head: y ``[B, N, H, V]``, gate ``[B, N, H*V]``
    (the gate's pre-activation), weight ``[V]`` -> ``[B, N, H*V]`` in ``promote_types(y.dtype, gate.dtype)``
    (module docstring). Raises ValueError on bad shapes, dtypes, devices or ``act``."""
    _check(y, gate, weight, act)
    if exporting_to_onnx():  # ONNX cannot know the custom op: the same math in exportable ops
        return naive_gated_rms_norm(y, gate, weight, eps, act)
    return gated_rms_norm_op(y, gate, weight, float(eps), act)
