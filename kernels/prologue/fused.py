"""The mixer prologue as two Triton kernels (forward and backward) and the custom op
``hdla_vision::mixer_prologue``: every activation between a mixer's input projections and the scan op,
in one launch each way instead of a dozen elementwise kernels (issue 12 part 2).

    mixer_prologue(proj, decay_logits, heads, head_dim, head_dim_v, beta_range, tau=1.0, eps=1e-5,
                   normalize_q=False) -> (q, k, v, beta, g)

is :func:`~hdla_vision.kernels.prologue.naive.naive_mixer_prologue` (its docstring gives the layout and
the math): q, k, v ``[B, N, H, K|V]`` in proj's dtype, beta ``[D, B, N, H]`` and g ``[D, B, N, H, K]`` in
fp32, stacked by scan direction as the bidirectional ops take them. The backward recomputes the
activations from ``proj`` and the logits (it saves nothing else) and returns ``d proj`` (zero in the
padding columns) and ``d decay_logits``:

    SiLU'(a)         = s (1 + a (1 - s)),  s = sigmoid(a)
    k = u / n (n = ||u|| > eps):  du = (dk - k (k . dk)) / n;   n <= eps:  du = dk / eps
    d beta_logit     = d beta * beta_range * s (1 - s)
    d decay_logit    = d g * sigmoid(-logit) / tau

Paths: the Triton kernels for CUDA tensors and, under ``TRITON_INTERPRET=1``, CPU tensors (fp32, bf16,
fp16); the PyTorch definition (autograd through it) for CPU tensors otherwise and for float64, and in
place of the custom op under ONNX export.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..custom_ops import NAMESPACE, _autograd_inside_op
from ..ops import exporting_to_onnx
from ..utils import cdiv, next_power_of_2, use_triton
from .naive import gate_dtype, naive_mixer_prologue

BLOCK_ROWS = 16  # tokens per program


@triton.jit
def _silu_parts(a):
    """SiLU(a) and its derivative, for fp32 ``a``."""
    s = tl.sigmoid(a)
    return a * s, s * (1.0 + a * (1.0 - s))


@triton.jit
def _head_tile(ptr, rows, cols, row_stride, mask):
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _program_tile(n_rows, heads, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  BM: tl.constexpr):
    """This program's head h and BM token rows: (h, rows, row_ok, key and value columns ck, cv, their masks
    mk, mv, the key width of all heads hk, the offsets out_k, out_v of the rows' head in q / k / g and v)."""
    pid_m, h = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < n_rows
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    mk = row_ok[:, None] & (ck[None, :] < DK)
    mv = row_ok[:, None] & (cv[None, :] < DV)
    hk = heads * DK
    out_k = rows[:, None] * hk + h * DK + ck[None, :]
    out_v = rows[:, None] * (heads * DV) + h * DV + cv[None, :]
    return h, rows, row_ok, ck, cv, mk, mv, hk, out_k, out_v


@triton.jit
def _normalized(u, eps):
    """``u / max(||u||, eps)`` per row."""
    return u / tl.maximum(tl.sqrt(tl.sum(u * u, axis=1)), eps)[:, None]


@triton.jit
def prologue_fwd_kernel(proj, logits, q, k, v, beta, g, n_rows, row_stride, heads, beta_range, inv_tau, eps,
                        DIRECTIONS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, NORM_Q: tl.constexpr, BM: tl.constexpr):
    """One program: BM tokens of one head. Columns of proj: q | k | v | beta (direction-major)."""
    h, rows, row_ok, ck, cv, mk, mv, hk, out_k, out_v = _program_tile(n_rows, heads, DK, DV, BK, BV, BM)

    aq, _ = _silu_parts(_head_tile(proj, rows, h * DK + ck, row_stride, mk))
    if NORM_Q:
        aq = _normalized(aq, eps)
    tl.store(q + out_k, aq.to(q.dtype.element_ty), mask=mk)
    ak, _ = _silu_parts(_head_tile(proj, rows, hk + h * DK + ck, row_stride, mk))
    ak = _normalized(ak, eps)
    tl.store(k + out_k, ak.to(k.dtype.element_ty), mask=mk)
    av, _ = _silu_parts(_head_tile(proj, rows, 2 * hk + h * DV + cv, row_stride, mv))
    tl.store(v + out_v, av.to(v.dtype.element_ty), mask=mv)

    beta_col = 2 * hk + heads * DV
    for d in tl.static_range(DIRECTIONS):
        logit = tl.load(proj + rows * row_stride + beta_col + d * heads + h, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(beta + (d * n_rows + rows) * heads + h, beta_range * tl.sigmoid(logit), mask=row_ok)
        x = _head_tile(logits + d * n_rows * hk, rows, h * DK + ck, hk, mk)
        # logsigmoid(x) = min(x, 0) - log(1 + e^{-|x|}), exact for large |x| of either sign
        log_sig = tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))
        tl.store(g + d * n_rows * hk + out_k, log_sig * inv_tau, mask=mk)


@triton.jit
def _normalized_vjp(u, dk, eps):
    """``d u`` of ``k = u / max(||u||, eps)`` (per row) for the cotangent ``dk``."""
    norm = tl.sqrt(tl.sum(u * u, axis=1))
    denom = tl.maximum(norm, eps)
    k = u / denom[:, None]
    along = tl.where(norm > eps, tl.sum(k * dk, axis=1), 0.0)
    return (dk - k * along[:, None]) / denom[:, None]


@triton.jit
def prologue_bwd_kernel(proj, logits, dq, dk, dv, dbeta, dg, dproj, dlogits, n_rows, row_stride, heads,
                        beta_range, inv_tau, eps, DIRECTIONS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, NORM_Q: tl.constexpr, BM: tl.constexpr):
    """The VJP of :func:`prologue_fwd_kernel` for BM tokens of one head (activations recomputed)."""
    h, rows, row_ok, ck, cv, mk, mv, hk, out_k, out_v = _program_tile(n_rows, heads, DK, DV, BK, BV, BM)
    dst = dproj + rows[:, None] * row_stride

    uq, sq = _silu_parts(_head_tile(proj, rows, h * DK + ck, row_stride, mk))
    gq = tl.load(dq + out_k, mask=mk, other=0.0).to(tl.float32)
    if NORM_Q:
        gq = _normalized_vjp(uq, gq, eps)
    tl.store(dst + h * DK + ck[None, :], (gq * sq).to(dproj.dtype.element_ty), mask=mk)
    uk, sk = _silu_parts(_head_tile(proj, rows, hk + h * DK + ck, row_stride, mk))
    gk = _normalized_vjp(uk, tl.load(dk + out_k, mask=mk, other=0.0).to(tl.float32), eps)
    tl.store(dst + hk + h * DK + ck[None, :], (gk * sk).to(dproj.dtype.element_ty), mask=mk)
    _, sv = _silu_parts(_head_tile(proj, rows, 2 * hk + h * DV + cv, row_stride, mv))
    gv = tl.load(dv + out_v, mask=mv, other=0.0).to(tl.float32)
    tl.store(dst + 2 * hk + h * DV + cv[None, :], (gv * sv).to(dproj.dtype.element_ty), mask=mv)

    beta_col = 2 * hk + heads * DV
    for d in tl.static_range(DIRECTIONS):
        logit = tl.load(proj + rows * row_stride + beta_col + d * heads + h, mask=row_ok, other=0.0).to(tl.float32)
        s = tl.sigmoid(logit)
        db = tl.load(dbeta + (d * n_rows + rows) * heads + h, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(dproj + rows * row_stride + beta_col + d * heads + h,
                 (db * beta_range * s * (1.0 - s)).to(dproj.dtype.element_ty), mask=row_ok)
        x = _head_tile(logits + d * n_rows * hk, rows, h * DK + ck, hk, mk)
        dgd = tl.load(dg + d * n_rows * hk + out_k, mask=mk, other=0.0).to(tl.float32)
        tl.store(dlogits + d * n_rows * hk + out_k, (dgd * tl.sigmoid(-x) * inv_tau).to(dlogits.dtype.element_ty),
                 mask=mk)


def _meta(heads: int, head_dim: int, head_dim_v: int, directions: int, normalize_q: bool) -> dict:
    return dict(DIRECTIONS=directions, DK=head_dim, DV=head_dim_v, BK=next_power_of_2(head_dim),
                BV=next_power_of_2(head_dim_v), NORM_Q=normalize_q, BM=BLOCK_ROWS, num_warps=4)


def _rows(proj: Tensor) -> Tuple[Tensor, int]:
    """proj as a contiguous ``[B*N, P]`` (a view of a contiguous proj, else a copy) and its row stride, P:
    the backward writes d proj with the same row stride."""
    flat = proj.reshape(-1, proj.shape[-1]).contiguous()
    return flat, flat.stride(0)


def _outputs(proj: Tensor, decay_logits: Tensor, heads: int, head_dim: int, head_dim_v: int):
    batch, seq_len, _ = proj.shape
    directions = decay_logits.shape[0]
    acc = gate_dtype(proj)
    q = proj.new_empty(batch, seq_len, heads, head_dim)
    return (q, torch.empty_like(q), proj.new_empty(batch, seq_len, heads, head_dim_v),
            proj.new_empty(directions, batch, seq_len, heads, dtype=acc),
            proj.new_empty(directions, batch, seq_len, heads, head_dim, dtype=acc))


def _triton_runs(proj: Tensor) -> bool:
    return use_triton(proj) and proj.dtype != torch.float64


@torch.library.custom_op(f"{NAMESPACE}::mixer_prologue", mutates_args=())
def mixer_prologue_op(proj: Tensor, decay_logits: Tensor, heads: int, head_dim: int, head_dim_v: int,
                      beta_range: float, inv_tau: float, eps: float, normalize_q: bool
                      ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, k, v, beta, g)`` on checked inputs (:func:`mixer_prologue`)."""
    if not _triton_runs(proj):
        with torch.no_grad():
            return naive_mixer_prologue(proj, decay_logits, heads, head_dim, head_dim_v, beta_range, inv_tau, eps,
                                        normalize_q)
    q, k, v, beta, g = _outputs(proj, decay_logits, heads, head_dim, head_dim_v)
    flat, row_stride = _rows(proj)
    n_rows = flat.shape[0]
    grid = (cdiv(n_rows, BLOCK_ROWS), heads)
    prologue_fwd_kernel[grid](flat, decay_logits.contiguous(), q, k, v, beta, g, n_rows, row_stride, heads,
                              float(beta_range), float(inv_tau), float(eps),
                              **_meta(heads, head_dim, head_dim_v, decay_logits.shape[0], normalize_q))
    return q, k, v, beta, g


@mixer_prologue_op.register_fake
def _(proj, decay_logits, heads, head_dim, head_dim_v, beta_range, inv_tau, eps, normalize_q):
    return _outputs(proj, decay_logits, heads, head_dim, head_dim_v)


@torch.library.custom_op(f"{NAMESPACE}::mixer_prologue_backward", mutates_args=())
def mixer_prologue_backward_op(dq: Tensor, dk: Tensor, dv: Tensor, dbeta: Tensor, dg: Tensor, proj: Tensor,
                               decay_logits: Tensor, heads: int, head_dim: int, head_dim_v: int, beta_range: float,
                               inv_tau: float, eps: float, normalize_q: bool) -> Tuple[Tensor, Tensor]:
    """``(d proj, d decay_logits)`` in the inputs' dtypes (d proj zero in the padding columns)."""
    if not _triton_runs(proj):
        with _autograd_inside_op():
            inputs = [proj.detach().requires_grad_(), decay_logits.detach().requires_grad_()]
            outputs = naive_mixer_prologue(*inputs, heads, head_dim, head_dim_v, beta_range, inv_tau, eps,
                                           normalize_q)
            grads = torch.autograd.grad(outputs, inputs, (dq, dk, dv, dbeta, dg), allow_unused=True)
        return tuple(torch.zeros_like(x) if gx is None else gx for x, gx in zip(inputs, grads))
    flat, row_stride = _rows(proj)
    n_rows = flat.shape[0]
    dproj = torch.zeros_like(flat) if flat.shape[1] > _used_columns(heads, head_dim, head_dim_v, dbeta.shape[0]) \
        else torch.empty_like(flat)
    dlogits = torch.empty_like(decay_logits, memory_format=torch.contiguous_format)
    grid = (cdiv(n_rows, BLOCK_ROWS), heads)
    prologue_bwd_kernel[grid](flat, decay_logits.contiguous(), dq.contiguous(), dk.contiguous(), dv.contiguous(),
                              dbeta.contiguous(), dg.contiguous(), dproj, dlogits, n_rows, row_stride, heads,
                              float(beta_range), float(inv_tau), float(eps),
                              **_meta(heads, head_dim, head_dim_v, decay_logits.shape[0], normalize_q))
    return dproj.view(proj.shape), dlogits


@mixer_prologue_backward_op.register_fake
def _(dq, dk, dv, dbeta, dg, proj, decay_logits, heads, head_dim, head_dim_v, beta_range, inv_tau, eps, normalize_q):
    return torch.empty_like(proj), torch.empty_like(decay_logits)


def _setup_context(ctx, inputs, output):
    proj, decay_logits, *ctx.options = inputs
    ctx.save_for_backward(proj, decay_logits)


def _backward(ctx, dq, dk, dv, dbeta, dg):
    proj, decay_logits = ctx.saved_tensors
    dproj, dlogits = mixer_prologue_backward_op(dq, dk, dv, dbeta, dg, proj, decay_logits, *ctx.options)
    return (dproj, dlogits) + (None,) * len(ctx.options)


mixer_prologue_op.register_autograd(_backward, setup_context=_setup_context)


def _used_columns(heads: int, head_dim: int, head_dim_v: int, directions: int) -> int:
    return 2 * heads * head_dim + heads * head_dim_v + directions * heads


def _check(proj, decay_logits, heads, head_dim, head_dim_v) -> None:
    for name, value in dict(heads=heads, head_dim=head_dim, head_dim_v=head_dim_v).items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, x in dict(proj=proj, decay_logits=decay_logits).items():
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {type(x).__name__}"
                             f"{'' if not isinstance(x, Tensor) else ' of ' + str(x.dtype)}")
    if proj.dim() != 3:
        raise ValueError(f"proj must have shape [B, N, P], got {list(proj.shape)}")
    batch, seq_len, width = proj.shape
    if decay_logits.dim() != 4 or decay_logits.shape[0] not in (1, 2) or \
            tuple(decay_logits.shape[1:]) != (batch, seq_len, heads * head_dim):
        raise ValueError(f"decay_logits must have shape [D, B, N, H*K] = [1 or 2, {batch}, {seq_len}, "
                         f"{heads * head_dim}] (D scan directions), got {list(decay_logits.shape)}")
    used = _used_columns(heads, head_dim, head_dim_v, decay_logits.shape[0])
    if width < used:
        raise ValueError(f"proj must have at least 2*H*K + H*V + D*H = {used} columns (q | k | v | beta logits), "
                         f"got {width}")
    if decay_logits.device != proj.device:
        raise ValueError(f"decay_logits must be on proj's device {proj.device}, got {decay_logits.device}")


def mixer_prologue(proj: Tensor, decay_logits: Tensor, heads: int, head_dim: int, head_dim_v: int,
                   beta_range: float, tau: float = 1.0, eps: float = 1e-5, normalize_q: bool = False
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The activations between a mixer's projections and its scan op (module docstring):
    ``proj [B, N, P]`` (q | k | v | beta logits by direction | any padding), ``decay_logits [D, B, N, H*K]``
    -> q, k ``[B, N, H, K]``, v ``[B, N, H, V]`` (proj's dtype), beta ``[D, B, N, H]``, g ``[D, B, N, H, K]``
    (fp32; float64 for float64 proj). Raises ValueError on bad shapes, dtypes or devices."""
    _check(proj, decay_logits, heads, head_dim, head_dim_v)
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau!r}")
    if exporting_to_onnx():  # ONNX cannot know the custom op: the same math in exportable ops
        return naive_mixer_prologue(proj, decay_logits, heads, head_dim, head_dim_v, beta_range, 1.0 / tau, eps,
                                    normalize_q)
    return mixer_prologue_op(proj, decay_logits, heads, head_dim, head_dim_v, float(beta_range), 1.0 / tau,
                             float(eps), bool(normalize_q))
