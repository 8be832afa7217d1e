"""Token-by-token reference of the generalized recurrence (HDLA paper, eq. 8).

    S_t = (Diag(exp g_t) - A_t B_t^T) S_{t-1} + K_t V_t^T,     o_t = scale * S_t^T q_t

It runs in the dtype of its inputs, so tests call it in float64 as the oracle.
"""
from typing import Optional, Tuple

import torch


def _decay(g_t: torch.Tensor) -> torch.Tensor:
    """exp of one token's log-decay, ``[B, H, K]`` or ``[B, H]``, shaped to scale the rows of
    ``S [B, H, K, V]``: ``[B, H, K, 1]`` or ``[B, H, 1, 1]``."""
    d = g_t.exp().unsqueeze(-1)
    return d if g_t.dim() == 3 else d.unsqueeze(-1)


def naive_generalized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reference loop over time.

    Args:
        q: ``[B, T, H, K]`` query.
        g: ``[B, T, H, K]`` log-decay per key channel, or ``[B, T, H]`` one per head (``d_t =
            exp(g_t) I``). ``g <= 0``; ``g = -inf`` is the reset: exp(-inf) = 0 multiplies the
            state, and autograd's gradient w.r.t. g is 0 there.
        k: ``[B, T, H, r_kv, K]``; v: ``[B, T, H, r_kv, V]`` (columns of K_t, V_t).
        a, b: ``[B, T, H, r_ab, K]`` (columns of A_t, B_t); ``r_ab`` may be 0.
        initial_state: ``[B, H, K, V]`` or None (zeros).
        reverse: scan from the last token to the first.

    Returns:
        ``o`` of shape ``[B, T, H, V]`` and the final state ``[B, H, K, V]`` (or None).
    """
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    scale = 1.0 if scale is None else scale
    state = q.new_zeros(batch, heads, dk, dv)
    if initial_state is not None:
        state = state + initial_state.to(q.dtype)
    outputs = [None] * seq_len
    steps = range(seq_len - 1, -1, -1) if reverse else range(seq_len)
    for t in steps:
        read = torch.einsum("bhrk,bhkv->bhrv", b[:, t], state)  # B_t^T S_{t-1}
        state = (
            _decay(g[:, t]) * state
            - torch.einsum("bhrk,bhrv->bhkv", a[:, t], read)
            + torch.einsum("bhrk,bhrv->bhkv", k[:, t], v[:, t])
        )
        outputs[t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state)
    o = torch.stack(outputs, dim=1)
    return o, (state if output_final_state else None)
