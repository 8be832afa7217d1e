"""Generalized decoding: a few recurrent steps on a fixed-size state (one Triton program per (b, h, V-block)).

Per token t and head (HDLA paper eq. 8, kernels/README.md §1):

    X_t = B_t^T S_{t-1}                                   (r_ab reads of the old state, [r_ab, V])
    S_t = Diag(exp g_t) S_{t-1} - A_t X_t + K_t V_t^T,    o_t = scale * S_t^T q_t

Each column of S evolves on its own, so the value dimension is split across programs and each
program keeps a ``[K, BV]`` block of the state in registers for all T steps. The r_ab reads are
taken from the old state before any of it changes and kept in a ``[R, BV]`` tile (R the rank
padded to a power of two), so no second ``[K, BV]`` tile is live. The state is read and written in
fp32; T and the ranks are compile-time constants (decoding uses T = 1), so the kernel also runs
under ``TRITON_INTERPRET=1``.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..utils import cdiv, check_generalized_inputs, next_power_of_2, per_batch_slice
from .naive import _decay as _decay_rows  # exp(g_t) shaped [B, H, K, 1] or [B, H, 1, 1]


def torch_fused_recurrent_generalized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """PyTorch token loop with the same contract as the Triton kernel.

    Args:
        q: ``[B, T, H, K]``; g: ``[B, T, H, K]`` or ``[B, T, H]``; k ``[B, T, H, r_kv, K]``;
            v ``[B, T, H, r_kv, V]``; a, b ``[B, T, H, r_ab, K]`` (``r_ab`` may be 0).
        initial_state: ``[B, H, K, V]`` or None (zeros).
    Returns:
        ``o [B, T, H, V]`` in v's dtype and the new state ``[B, H, K, V]`` in fp32 (float64 for
        float64 inputs).
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 if scale is None else float(scale)
    batch, seq_len, heads, dk = q.shape
    out_dtype = v.dtype
    q, k, v, a, b, g = (x.to(compute) for x in (q, k, v, a, b, g))
    state = q.new_zeros(batch, heads, dk, v.shape[-1])
    if initial_state is not None:
        state = state + initial_state.to(compute)
    outputs = []
    for t in range(seq_len):
        reads = torch.einsum("bhrk,bhkv->bhrv", b[:, t], state)  # X_t = B_t^T S_{t-1}
        state = (_decay_rows(g[:, t]) * state - torch.einsum("bhrk,bhrv->bhkv", a[:, t], reads)
                 + torch.einsum("bhrk,bhrv->bhkv", k[:, t], v[:, t]))
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1).to(out_dtype), state


@triton.jit
def _fused_recurrent_generalized_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, g_ptr, s0_ptr, o_ptr, s_ptr,
    scale,
    T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    R_KV: tl.constexpr, R_AB: tl.constexpr, BR: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PER_HEAD_G: tl.constexpr, HAS_S0: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_r = tl.arange(0, BR)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    s_offs = i_bh * K * V + offs_k[:, None] * V + offs_v[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        state += tl.load(s0_ptr + s_offs, mask=mask_s, other=0.0).to(tl.float32)
    for t in tl.static_range(T):
        row = (i_b * T + t) * H + i_h  # token t of head h in the [B, T, H, *] layout
        q_t = tl.load(q_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        # X_t = B_t^T S_{t-1}: every read sees the old state, so take all r_ab of them first
        reads = tl.zeros([BR, BV], dtype=tl.float32)
        for r in tl.static_range(R_AB):
            b_r = tl.load(b_ptr + (row * R_AB + r) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x_r = tl.sum(b_r[:, None] * state, axis=0)
            reads = tl.where(offs_r[:, None] == r, x_r[None, :], reads)
        if PER_HEAD_G:
            state *= tl.exp(tl.load(g_ptr + row).to(tl.float32))
        else:
            g_t = tl.load(g_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            state *= tl.exp(g_t)[:, None]
        for r in tl.static_range(R_AB):  # - A_t X_t
            a_r = tl.load(a_ptr + (row * R_AB + r) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x_r = tl.sum(tl.where(offs_r[:, None] == r, reads, 0.0), axis=0)
            state -= a_r[:, None] * x_r[None, :]
        for r in tl.static_range(R_KV):  # + K_t V_t^T
            k_r = tl.load(k_ptr + (row * R_KV + r) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            v_r = tl.load(v_ptr + (row * R_KV + r) * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
            state += k_r[:, None] * v_r[None, :]
        o_t = tl.sum(q_t[:, None] * state, axis=0) * scale
        tl.store(o_ptr + row * V + offs_v, o_t.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(s_ptr + s_offs, state, mask=mask_s)


def _value_block(block_k: int, dv: int) -> int:
    """Columns of the state per program: the ``[BK, BV]`` fp32 tile holds at most 4K elements
    (64 x 64, 128 x 32, 256 x 16), so it stays in registers next to the loaded vectors."""
    budget = 64 if block_k <= 64 else (32 if block_k <= 128 else 16)
    return min(next_power_of_2(dv), budget)


def triton_fused_recurrent_generalized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton path; shapes as :func:`torch_fused_recurrent_generalized`, state always fp32."""
    batch, seq_len, heads, dk = q.shape
    r_kv, dv = v.shape[-2], v.shape[-1]
    r_ab = a.shape[-2]
    q, k, v, a, b, g = (x.contiguous() for x in (q, k, v, a, b, g))
    if r_ab == 0:  # a, b are empty and never read; give the kernel a real pointer
        a = b = q
    o = v.new_empty(batch, seq_len, heads, dv)
    state = torch.empty(batch, heads, dk, dv, device=q.device, dtype=torch.float32)
    s0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else state
    block_k = next_power_of_2(dk)
    block_v = _value_block(block_k, dv)
    grid = (cdiv(dv, block_v), batch * heads)
    _fused_recurrent_generalized_kernel[grid](
        q, k, v, a, b, g, s0, o, state,
        1.0 if scale is None else float(scale),
        T=seq_len, H=heads, K=dk, V=dv, R_KV=r_kv, R_AB=r_ab, BR=next_power_of_2(max(r_ab, 1)),
        BK=block_k, BV=block_v, PER_HEAD_G=g.dim() == 3, HAS_S0=initial_state is not None,
    )
    return o, state


def fused_recurrent_generalized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Advance the generalized state by T (small) tokens: the decoding counterpart of ``chunk_generalized``.

    ``S_t = (Diag(exp g_t) - A_t B_t^T) S_{t-1} + K_t V_t^T``, ``o_t = scale * S_t^T q_t``.

    Args:
        q: ``[B, T, H, K]``.
        g: ``[B, T, H, K]`` (a log-decay per key channel) or ``[B, T, H]`` (one per head).
        k: ``[B, T, H, r_kv, K]``; v: ``[B, T, H, r_kv, V]``, ``r_kv >= 1``.
        a, b: ``[B, T, H, r_ab, K]``, ``r_ab >= 0`` (empty at ``r_ab = 0``).
        scale: output scale, None means 1.
        initial_state: ``[B, H, K, V]`` (kept in fp32 by decoders, any float dtype) or None for zeros.
        output_final_state: also return the state after the last token (decoders pass True).

    Shapes, dtypes and the log-decay's domain as :func:`~hdla_vision.kernels.chunk_generalized`
    (k, v, a, b have q's dtype, g q's dtype or float32; ``g = -inf`` is the exact reset of that
    channel, ``g > 0`` raises ValueError for CPU tensors and is unchecked on CUDA); anything else
    raises ValueError naming the argument before any launch.

    Returns:
        ``(o [B, T, H, V] in v's dtype, new_state [B, H, K, V] fp32 or None)``. Unlike
        ``chunk_generalized`` the state is not cast to q's dtype: a decoder keeps it in fp32.
        Triton runs CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``); float64 inputs and
        other CPU tensors use the PyTorch loop, which keeps float64 for float64 inputs. The cost is
        linear in T: for prompts use ``chunk_generalized`` with ``output_final_state=True``. A custom
        op (``hdla_vision::fused_recurrent_generalized``, ``custom_ops.py``): one node under
        ``torch.compile``; its gradients are autograd's through the PyTorch loop, recomputed in the
        backward on any device (the Triton kernel has no backward of its own).
    """
    check_generalized_inputs(q, k, v, a, b, g, initial_state, scale)
    if not isinstance(output_final_state, bool):
        raise ValueError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")
    from ..custom_ops import fused_recurrent_generalized_op  # noqa: PLC0415 (custom_ops loads this module lazily)

    def op(q, k, v, a, b, g, initial_state):
        return fused_recurrent_generalized_op(q, k, v, a, b, g, 1.0 if scale is None else float(scale), initial_state)

    o, state = per_batch_slice(op, dict(q=q, k=k, v=v, a=a, b=b, g=g, initial_state=initial_state), q.shape[2])
    return o, (state if output_final_state else None)
