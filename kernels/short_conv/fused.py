"""The causal depthwise convolution over time as two Triton kernels and the custom op ``hdla_vision::causal_conv1d``:
the causal mixers' short convolution and Zoology's BaseConv in one launch forward and one backward, read and
written in the token-major layout ``[B, T, C]`` of the projections (``nn.Conv1d`` needs ``[B, C, T]``: a copy
each way, and PyTorch's depthwise kernels are slow in 16 bits).

    causal_conv1d(x, weight, bias) -> [B, T, C]

is :func:`~hdla_vision.kernels.short_conv.naive.naive_causal_conv1d` (its docstring gives the math). The backward,
for the output's cotangent ``dy``:

    dx[b, s, c] = sum_{i < K} w[c, i] dy[b, s + (K - 1) - i, c]       (dy = 0 from t = T on)
    dw[c, i]    = sum_{b, t} dy[b, t, c] x[b, t - (K - 1) + i, c],    dbias[c] = sum_{b, t} dy[b, t, c]

with dw and dbias summed in fp32 per program over a segment of SEG_TILES tiles of tokens, then over the programs.
Every tap reads its shifted tile of the input (K loads of a tile, K <= MAX_TAPS, served by the cache). Paths: the
Triton kernels for CUDA tensors and, under ``TRITON_INTERPRET=1``, CPU tensors (fp32, bf16, fp16); the PyTorch
definition for CPU tensors otherwise, float64 and ONNX export. The decoding path of the mixers (a cached window before the new tokens) keeps
``F.conv1d``.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..custom_ops import NAMESPACE, _autograd_inside_op
from ..ops import exporting_to_onnx
from ..utils import cdiv, use_triton
from .naive import naive_causal_conv1d

# A [16, 128] tile on 4 warps: the backward in 152 registers without spills on sm_90a (a [32, 128] tile spilled
# 272 bytes; tests/test_aot_check.py)
BLOCK_T, BLOCK_C = 16, 128
MAX_TAPS = 16
SEG_TILES = 16  # time tiles per backward program (256 tokens): the filter gradient's sums over them in registers


@triton.jit
def _shifted(x, base, rows, shift, cols, mc, T, C):
    """x[b, rows + shift, cols] in fp32, 0 outside [0, T)."""
    src = rows + shift
    mask = ((src >= 0) & (src < T))[:, None] & mc[None, :]
    return tl.load(x + base + src[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def causal_conv_fwd_kernel(x, w, bias, y, T, C, K: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr,
                           BC: tl.constexpr):
    """y [B, T, C]: grid (cdiv(T, BT), cdiv(C, BC), B)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = cols < C
    base = tl.program_id(2).to(tl.int64) * T * C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(K):
        tap = tl.load(w + cols * K + i, mask=mc, other=0.0).to(tl.float32)
        acc += _shifted(x, base, rows, i - (K - 1), cols, mc, T, C) * tap[None, :]
    mask = (rows < T)[:, None] & mc[None, :]
    tl.store(y + base + rows[:, None] * C + cols[None, :], acc.to(y.dtype.element_ty), mask=mask)


@triton.jit
def causal_conv_bwd_kernel(x, w, dy, dx, dw_part, db_part, T, C, K: tl.constexpr, BT: tl.constexpr,
                           BC: tl.constexpr, SEG_TILES: tl.constexpr):
    """dx [B, T, C]; this program's partial sums dw_part [P, C, K] and db_part [P, C] (fp32) over its segment of
    SEG_TILES * BT tokens, P = B cdiv(T, SEG_TILES BT) programs along the rows: grid (cdiv(T, SEG_TILES BT),
    cdiv(C, BC), B). Each sum stays a [BT, BC] tile over the segment and is reduced over the rows once at its end
    (a reduction per tile and tap made the kernel a chain of short dependent steps: 6x the forward's time)."""
    i_s = tl.program_id(0)
    first = i_s * SEG_TILES * BT
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = cols < C
    base = tl.program_id(2).to(tl.int64) * T * C
    part = tl.program_id(2).to(tl.int64) * tl.num_programs(0) + i_s
    db = tl.zeros([BT, BC], dtype=tl.float32)
    for j in range(SEG_TILES):
        rows = first + j * BT + tl.arange(0, BT)
        db += _shifted(dy, base, rows, 0, cols, mc, T, C)
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for i in tl.static_range(K):
            tap = tl.load(w + cols * K + i, mask=mc, other=0.0).to(tl.float32)
            acc += _shifted(dy, base, rows, (K - 1) - i, cols, mc, T, C) * tap[None, :]
        mask = (rows < T)[:, None] & mc[None, :]
        tl.store(dx + base + rows[:, None] * C + cols[None, :], acc.to(dx.dtype.element_ty), mask=mask)
    tl.store(db_part + part * C + cols, tl.sum(db, axis=0), mask=mc)
    for i in tl.static_range(K):
        dw = tl.zeros([BT, BC], dtype=tl.float32)
        for j in range(SEG_TILES):
            rows = first + j * BT + tl.arange(0, BT)
            dw += _shifted(dy, base, rows, 0, cols, mc, T, C) * _shifted(x, base, rows, i - (K - 1), cols, mc, T, C)
        tl.store(dw_part + (part * C + cols) * K + i, tl.sum(dw, axis=0), mask=mc)


def _triton_runs(x: Tensor, weight: Tensor) -> bool:
    return use_triton(x) and torch.float64 not in (x.dtype, weight.dtype)


def _accumulation(x: Tensor) -> torch.dtype:
    """fp32, float64 for float64 x: what the sums run in."""
    return torch.promote_types(x.dtype, torch.float32)


def _grid(x: Tensor, tiles_per_program: int = 1) -> Tuple[int, int, int]:
    batch, seq_len, channels = x.shape
    return cdiv(seq_len, BLOCK_T * tiles_per_program), cdiv(channels, BLOCK_C), batch


@torch.library.custom_op(f"{NAMESPACE}::causal_conv1d", mutates_args=())
def causal_conv1d_op(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``y [B, T, C]`` in x's dtype on checked inputs (:func:`causal_conv1d`)."""
    if not _triton_runs(x, weight) or x.numel() == 0:
        return naive_causal_conv1d(x, weight, bias).contiguous()  # the fake's strides
    x = x.contiguous()
    y = torch.empty_like(x)
    causal_conv_fwd_kernel[_grid(x)](x, weight.contiguous(), x if bias is None else bias.contiguous(), y,
                                     x.shape[1], x.shape[2], K=weight.shape[1], HAS_BIAS=bias is not None,
                                     BT=BLOCK_T, BC=BLOCK_C, num_warps=4)
    return y


@causal_conv1d_op.register_fake
def _(x, weight, bias):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{NAMESPACE}::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward_op(dy: Tensor, x: Tensor, weight: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dx`` in x's dtype, ``dweight [C, K]`` in weight's dtype, ``dbias [C]`` in :func:`_accumulation`'s
    dtype (the caller casts it to the bias's dtype, or drops it without a bias)."""
    if not _triton_runs(x, weight) or x.numel() == 0:
        with _autograd_inside_op():
            inputs = [t.detach().requires_grad_() for t in (x, weight)]
            bias = x.new_zeros(x.shape[-1], dtype=_accumulation(x), requires_grad=True)
            grads = torch.autograd.grad(naive_causal_conv1d(*inputs, bias), [*inputs, bias], dy)
            return tuple(g.contiguous() for g in grads)
    x, dy = x.contiguous(), dy.contiguous()
    grid = _grid(x, SEG_TILES)
    channels, taps = weight.shape
    dx = torch.empty_like(x)
    dw_part = torch.empty(grid[0] * grid[2], channels, taps, dtype=torch.float32, device=x.device)
    db_part = torch.empty(grid[0] * grid[2], channels, dtype=torch.float32, device=x.device)
    causal_conv_bwd_kernel[grid](x, weight.contiguous(), dy, dx, dw_part, db_part, x.shape[1], channels, K=taps,
                                 BT=BLOCK_T, BC=BLOCK_C, SEG_TILES=SEG_TILES, num_warps=4)
    return dx, dw_part.sum(0).to(weight.dtype), db_part.sum(0)


@causal_conv1d_backward_op.register_fake
def _(dy, x, weight):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), weight.new_empty(weight.shape),
            x.new_empty(x.shape[-1], dtype=_accumulation(x)))


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(x, weight)


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dweight, dbias = causal_conv1d_backward_op(dy, x, weight)
    return dx, dweight, None if ctx.bias_dtype is None else dbias.to(ctx.bias_dtype)


causal_conv1d_op.register_autograd(_backward, setup_context=_setup_context)


def _check(x, weight, bias) -> None:
    for name, t in dict(x=x, weight=weight, bias=bias).items():
        if t is None and name == "bias":
            continue
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {type(t).__name__}"
                             f"{'' if not isinstance(t, Tensor) else ' of ' + str(t.dtype)}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape [B, T, C], got {list(x.shape)}")
    channels = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != channels or not 1 <= weight.shape[1] <= MAX_TAPS:
        raise ValueError(f"weight must have shape [C, K] with C = {channels} and 1 <= K <= {MAX_TAPS}, "
                         f"got {list(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias must have shape [C] = [{channels}], got {list(bias.shape)}")
    for name, t in dict(weight=weight, bias=bias).items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``y[b, t, c] = bias[c] + sum_i weight[c, i] x[b, t - (K - 1) + i, c]``: x ``[B, T, C]``, weight ``[C, K]``
    (``nn.Conv1d(C, C, K, groups=C).weight[:, 0]``), bias ``[C]`` or None -> ``[B, T, C]`` in x's dtype (module
    docstring). Raises ValueError on bad shapes, dtypes or devices."""
    _check(x, weight, bias)
    if exporting_to_onnx():  # ONNX cannot know the custom op: the same math in exportable ops
        return naive_causal_conv1d(x, weight, bias)
    return causal_conv1d_op(x, weight, bias)
