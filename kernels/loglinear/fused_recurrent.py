"""Log-linear decoding: the Fenwick form on ``L`` states (log-linear paper §3.2; kernels/README.md §7).

At each absolute position ``t`` (``offset + i`` for token ``i``):

    1. merge:      add levels ``0 .. target-1`` into level ``target`` and zero them,
                   ``target = min(lssb(t) + 1, L - 1)`` (``lssb(0) = inf``: position 0 sends
                   everything to the top level);
    2. transition: ``S^(l) <- C_t S^(l)`` for every level (a merge is a sum, and C_t is linear);
    3. write:      ``S^(0) += K_t V_t^T`` (level 0 is empty after the merge unless L = 1);
    4. read:       ``o_t = scale * sum_l lambda_t^(l) S^(l)^T q_t``.

A PyTorch loop (cost linear in T): for decoding a few tokens from a cache; prompts go through the
chunk ops with ``output_final_state=True``. The state is kept in fp32 (float64 for float64 inputs).
"""
from typing import Callable, Optional, Tuple

import torch

from ..utils import check_generalized_inputs, check_hdla_inputs
from .checks import check_loglinear_inputs
from .levels import merge_target
from .naive import generalized_transition, hdla_transition


def fenwick_merge(state: torch.Tensor, t: int) -> torch.Tensor:
    """Step 1 above on ``state`` ``[B, H, L, K, V]``: levels ``0..target-1`` added into ``target``."""
    target = merge_target(t, state.shape[2])
    if target == 0:
        return state
    merged = state[:, :, : target + 1].sum(2, keepdim=True)
    return torch.cat([torch.zeros_like(state[:, :, :target]), merged, state[:, :, target + 1:]], dim=2)


def _fenwick_loop(
    q: torch.Tensor,
    level_scales: torch.Tensor,
    transition: Callable[[torch.Tensor, int], torch.Tensor],
    write: Callable[[int], torch.Tensor],
    dv: int,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    offset: int,
    compute: torch.dtype,
) -> Tuple[torch.Tensor, torch.Tensor]:
    batch, seq_len, heads, dk = q.shape
    scale = 1.0 if scale is None else float(scale)
    state = q.new_zeros(batch, heads, level_scales.shape[-1], dk, dv, dtype=compute)
    if initial_state is not None:
        state = state + initial_state.to(compute)
    outputs = []
    for i in range(seq_len):
        state = transition(fenwick_merge(state, offset + i), i)
        state = torch.cat([state[:, :, :1] + write(i).unsqueeze(2), state[:, :, 1:]], dim=2)
        weight = level_scales[:, i].to(compute)  # [B, H, L]
        outputs.append(scale * torch.einsum("bhl,bhk,bhlkv->bhv", weight, q[:, i].to(compute), state))
    return torch.stack(outputs, dim=1).to(q.dtype), state


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def fused_recurrent_loglinear_generalized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    offset: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Advance a log-linear generalized cache by T (small) tokens.

    Args:
        q, g: ``[B, T, H, K]``; k ``[B, T, H, r_kv, K]``; v ``[B, T, H, r_kv, V]``;
            a, b ``[B, T, H, r_ab, K]`` (as :func:`~hdla_vision.kernels.chunk_generalized`).
        level_scales: ``[B, T, H, L]``; L fixes the number of levels of the state.
        initial_state: ``[B, H, L, K, V]``, the cache after ``offset`` tokens, or None (zeros).
        offset: absolute position of token 0 (the number of tokens the cache has seen).

    Returns:
        ``(o [B, T, H, V] in q's dtype, state [B, H, L, K, V] fp32, float64 for float64 inputs)``;
        pass the state back with ``offset + T`` to continue.
    """
    check_generalized_inputs(q, k, v, a, b, g, None, scale)
    check_loglinear_inputs(q, v.shape[-1], level_scales, initial_state, offset)
    compute = _compute_dtype(q)
    k, v, a, b, g = (x.to(compute) for x in (k, v, a, b, g))

    def transition(state, i):
        return generalized_transition(state, g[:, i], a[:, i], b[:, i])

    def write(i):
        return torch.einsum("bhrk,bhrv->bhkv", k[:, i], v[:, i])

    return _fenwick_loop(q, level_scales, transition, write, v.shape[-1], scale, initial_state, offset, compute)


def fused_recurrent_loglinear_hdla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    offset: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Advance a log-linear HDLA cache by T (small) tokens.

    q, k, g: ``[B, T, H, K]`` (k L2-normalised); v ``[B, T, H, V]``; beta ``[B, T, H]``; the rest
    as :func:`fused_recurrent_loglinear_generalized`.
    """
    check_hdla_inputs(q, k, v, beta, g, None, scale)
    check_loglinear_inputs(q, v.shape[-1], level_scales, initial_state, offset)
    compute = _compute_dtype(q)
    k, v, beta, g = (x.to(compute) for x in (k, v, beta, g))

    def transition(state, i):
        return hdla_transition(state, k[:, i], beta[:, i], g[:, i])

    def write(i):
        return k[:, i].unsqueeze(-1) * v[:, i].unsqueeze(-2)

    return _fenwick_loop(q, level_scales, transition, write, v.shape[-1], scale, initial_state, offset, compute)
