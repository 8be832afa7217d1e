"""HDLA decoding: a few recurrent steps on a fixed-size state (one Triton program per (b, h, V-block)).

Per token t and head (paper eq. 27):

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) (I - beta_t k_t k_t^T) S_{t-1} + k_t v_t^T,
    o_t = scale * S_t^T q_t

Each column of S evolves on its own, so the value dimension is split across programs and
each program keeps a ``[K, BV]`` block of the state in registers for all T steps. The state
is read and written in fp32; T is a compile-time constant (decoding uses T = 1), so the
kernel also runs under ``TRITON_INTERPRET=1``.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..utils import check_hdla_inputs, per_batch_slice


def torch_fused_recurrent_hdla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """PyTorch token loop with the same contract as the Triton kernel.

    Args:
        q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
        initial_state: ``[B, H, K, V]`` or None (zeros).
    Returns:
        ``o [B, T, H, V]`` in q's dtype and the new state ``[B, H, K, V]`` in fp32 (float64 for
        float64 inputs).
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 if scale is None else float(scale)
    batch, seq_len, heads, dk = q.shape
    out_dtype = v.dtype
    q, k, v, beta, g = (x.to(compute) for x in (q, k, v, beta, g))
    q = q * scale
    state = q.new_zeros(batch, heads, dk, v.shape[-1])
    if initial_state is not None:
        state = state + initial_state.to(compute)
    outputs = []
    for t in range(seq_len):
        kt, bt = k[:, t].unsqueeze(-1), beta[:, t, :, None, None]  # [B, H, K, 1], [B, H, 1, 1]
        state = state - bt * kt * (kt * state).sum(-2, keepdim=True)
        state = g[:, t].exp().unsqueeze(-1) * state
        state = state - bt * kt * (kt * state).sum(-2, keepdim=True)
        state = state + kt * v[:, t].unsqueeze(-2)
        outputs.append((q[:, t].unsqueeze(-1) * state).sum(-2))
    return torch.stack(outputs, dim=1).to(out_dtype), state


if triton is not None:

    @triton.jit
    def _fused_recurrent_hdla_kernel(
        q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, s0_ptr, o_ptr, s_ptr,
        scale,
        T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr,
    ):
        i_v, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        offs_k = tl.arange(0, BK)
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_k, mask_v = offs_k < K, offs_v < V
        mask_s = mask_k[:, None] & mask_v[None, :]
        s_offs = i_bh * K * V + offs_k[:, None] * V + offs_v[None, :]
        state = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_S0:
            state += tl.load(s0_ptr + s_offs, mask=mask_s, other=0.0).to(tl.float32)
        for t in tl.static_range(T):
            row = (i_b * T + t) * H + i_h  # token t of head h in the [B, T, H, *] layout
            k_t = tl.load(k_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            q_t = tl.load(q_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            g_t = tl.load(g_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            v_t = tl.load(v_ptr + row * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
            b_t = tl.load(beta_ptr + row).to(tl.float32)
            # (I - b k k^T) S, then Diag(exp g), then (I - b k k^T) again, then the write k v^T
            state -= b_t * k_t[:, None] * tl.sum(k_t[:, None] * state, axis=0)[None, :]
            state *= tl.exp(g_t)[:, None]
            state -= b_t * k_t[:, None] * tl.sum(k_t[:, None] * state, axis=0)[None, :]
            state += k_t[:, None] * v_t[None, :]
            o_t = tl.sum(q_t[:, None] * state, axis=0) * scale
            tl.store(o_ptr + row * V + offs_v, o_t.to(o_ptr.dtype.element_ty), mask=mask_v)
        tl.store(s_ptr + s_offs, state, mask=mask_s)


def triton_fused_recurrent_hdla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton path; shapes as :func:`torch_fused_recurrent_hdla`, state always fp32."""
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    q, k, v, beta, g = (x.contiguous() for x in (q, k, v, beta, g))
    o = torch.empty_like(v)
    state = torch.empty(batch, heads, dk, dv, device=q.device, dtype=torch.float32)
    s0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else state
    block_k = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), 64 if block_k <= 64 else 32)
    grid = (triton.cdiv(dv, block_v), batch * heads)
    _fused_recurrent_hdla_kernel[grid](
        q, k, v, beta, g, s0, o, state,
        1.0 if scale is None else float(scale),
        T=seq_len, H=heads, K=dk, V=dv, BK=block_k, BV=block_v, HAS_S0=initial_state is not None,
    )
    return o, state


def fused_recurrent_hdla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Advance the HDLA state by T (small) tokens: the decoding counterpart of ``chunk_hdla``.

    Args:
        q, k, g: ``[B, T, H, K]`` (k L2-normalised by the caller, ``g = log lambda <= 0``).
        v: ``[B, T, H, V]``; beta: ``[B, T, H]`` in [0, 2].
        scale: output scale, None means 1.
        initial_state: ``[B, H, K, V]`` (kept in fp32 by decoders, any float dtype) or None for zeros.

    Dtypes and the log-decay's domain as :func:`~hdla_vision.kernels.chunk_hdla`: k, v have q's
    dtype, beta and g q's dtype or float32; ``g = -inf`` resets the state's channel exactly
    (exp(-inf) = 0; the PyTorch loop's gradient there is 0); ``g > 0`` raises ValueError for CPU
    tensors and is unchecked on CUDA.

    Returns:
        ``(o [B, T, H, V] in v's dtype, new_state [B, H, K, V] fp32)``. Triton runs CUDA tensors
        (and CPU tensors under ``TRITON_INTERPRET=1``); float64 inputs and other CPU tensors use
        the PyTorch loop, which keeps float64 for float64 inputs. The cost is linear in T: for
        prompts use ``chunk_hdla`` with ``output_final_state=True``. A custom op
        (``hdla_vision::fused_recurrent_hdla``, ``custom_ops.py``): one node under ``torch.compile``;
        its gradients are autograd's through the PyTorch loop, recomputed in the backward on any
        device (the Triton kernel has no backward of its own).
    """
    check_hdla_inputs(q, k, v, beta, g, initial_state, scale)
    from ..custom_ops import fused_recurrent_hdla_op  # noqa: PLC0415 (custom_ops loads this module lazily)

    def op(q, k, v, beta, g, initial_state):
        return fused_recurrent_hdla_op(q, k, v, beta, g, 1.0 if scale is None else float(scale), initial_state)

    return per_batch_slice(op, dict(q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state), q.shape[2])
