"""The unfused bidirectional path's elementwise combination in one Triton kernel each way (kernels/README.md
§9): where the two scans run as two single-direction ops (the chunk16 family), their outputs and the
gradients of the shared inputs are summed and the own write subtracted here instead of by a dozen
PyTorch kernels each way (issue 12: glue per block).

With ``own_t = scale sum_l (q_t . K_t,l) V_t,l`` (q ``[B, T, H, K]``, K ``[B, T, H, r, K]``, V ``[B, T, H, r, V]``
shared by the directions) and ``c_t,l = scale (dy_t . V_t,l)``:

    y     = o_fwd + o_bwd - own
    dq    = dq_fwd + dq_bwd - sum_l c_l K_l
    dK_l  = dK_fwd,l + dK_bwd,l - c_l q
    dV_l  = dV_fwd,l + dV_bwd,l - scale (q . K_l) dy

each accumulated in fp32 and rounded once to the output's dtype (the PyTorch code it replaces,
``bidirectional_ops._unfused_outputs``, ``own_write_vjp``, ``_sum_shared``, ``_minus``, does the same).
"""
from typing import Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .utils import cdiv, next_power_of_2

BLOCK_TOKENS = 16


@triton.jit
def _tile(ptr, rows, n_heads, h, width: tl.constexpr, cols, mask):
    """Rows ``rows`` of head h of a ``[M, H, width]`` tensor, as fp32."""
    return tl.load(ptr + (rows[:, None] * n_heads + h) * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def combine_outputs_kernel(o_f, o_b, q, k, v, y, n_rows, n_heads, scale, R: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr):
    pid, h = tl.program_id(0), tl.program_id(1)
    rows = pid * BM + tl.arange(0, BM)
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    mk = (rows[:, None] < n_rows) & (ck[None, :] < DK)
    mv = (rows[:, None] < n_rows) & (cv[None, :] < DV)
    acc = _tile(o_f, rows, n_heads, h, DV, cv, mv) + _tile(o_b, rows, n_heads, h, DV, cv, mv)
    qt = _tile(q, rows, n_heads, h, DK, ck, mk)
    for r in tl.static_range(R):
        kt = _tile(k + r * DK, rows, n_heads, h, R * DK, ck, mk)
        vt = _tile(v + r * DV, rows, n_heads, h, R * DV, cv, mv)
        acc -= scale * tl.sum(qt * kt, axis=1)[:, None] * vt
    tl.store(y + (rows[:, None] * n_heads + h) * DV + cv[None, :], acc.to(y.dtype.element_ty), mask=mv)


@triton.jit
def combine_grads_kernel(dy, q, k, v, dq_f, dq_b, dk_f, dk_b, dv_f, dv_b, dq, dk, dv, n_rows, n_heads, scale,
                         R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         BM: tl.constexpr):
    pid, h = tl.program_id(0), tl.program_id(1)
    rows = pid * BM + tl.arange(0, BM)
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    mk = (rows[:, None] < n_rows) & (ck[None, :] < DK)
    mv = (rows[:, None] < n_rows) & (cv[None, :] < DV)
    dyt = _tile(dy, rows, n_heads, h, DV, cv, mv)
    qt = _tile(q, rows, n_heads, h, DK, ck, mk)
    dqt = _tile(dq_f, rows, n_heads, h, DK, ck, mk) + _tile(dq_b, rows, n_heads, h, DK, ck, mk)
    for r in tl.static_range(R):
        kt = _tile(k + r * DK, rows, n_heads, h, R * DK, ck, mk)
        vt = _tile(v + r * DV, rows, n_heads, h, R * DV, cv, mv)
        c = scale * tl.sum(dyt * vt, axis=1)[:, None]  # scale (dy . V_l)
        dqt -= c * kt
        dkt = _tile(dk_f + r * DK, rows, n_heads, h, R * DK, ck, mk) + \
            _tile(dk_b + r * DK, rows, n_heads, h, R * DK, ck, mk) - c * qt
        tl.store(dk + (rows[:, None] * n_heads + h) * (R * DK) + r * DK + ck[None, :], dkt.to(dk.dtype.element_ty),
                 mask=mk)
        dvt = _tile(dv_f + r * DV, rows, n_heads, h, R * DV, cv, mv) + \
            _tile(dv_b + r * DV, rows, n_heads, h, R * DV, cv, mv) - scale * tl.sum(qt * kt, axis=1)[:, None] * dyt
        tl.store(dv + (rows[:, None] * n_heads + h) * (R * DV) + r * DV + cv[None, :], dvt.to(dv.dtype.element_ty),
                 mask=mv)
    tl.store(dq + (rows[:, None] * n_heads + h) * DK + ck[None, :], dqt.to(dq.dtype.element_ty), mask=mk)


def _meta(k: Tensor, v: Tensor) -> dict:
    r, dk, dv = k.shape[-2], k.shape[-1], v.shape[-1]
    return dict(R=r, DK=dk, DV=dv, BK=next_power_of_2(dk), BV=next_power_of_2(dv), BM=BLOCK_TOKENS,
                num_warps=4)


def _grid(q: Tensor):
    batch, seq_len, heads, _ = q.shape
    return (cdiv(batch * seq_len, BLOCK_TOKENS), heads)


def combine_outputs(o_f: Tensor, o_b: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``y = o_fwd + o_bwd - own`` in q's dtype: o ``[B, T, H, V]``, q ``[B, T, H, K]``, k ``[B, T, H, r, K]``,
    v ``[B, T, H, r, V]`` (Triton tensors: CUDA, or CPU under the interpreter)."""
    batch, seq_len, heads, _ = q.shape
    y = torch.empty(o_f.shape, dtype=q.dtype, device=q.device)
    combine_outputs_kernel[_grid(q)](o_f.contiguous(), o_b.contiguous(), q.contiguous(), k.contiguous(),
                                     v.contiguous(), y, batch * seq_len, heads, float(scale), **_meta(k, v))
    return y


def combine_grads(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, grads_f, grads_b, scale: float
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the module docstring in q's, k's, v's dtypes and shapes from the two directions'
    ``(dq, dk, dv)`` (k, v and their gradients ``[B, T, H, r, K|V]``)."""
    batch, seq_len, heads, _ = q.shape
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    parts = [t.contiguous() for pair in zip(grads_f, grads_b) for t in pair]
    combine_grads_kernel[_grid(q)](dy.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), *parts,
                                   dq, dk, dv, batch * seq_len, heads, float(scale), **_meta(k, v))
    return dq, dk, dv
