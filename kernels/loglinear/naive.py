"""Float64 reference loops of log-linear attention, written from the definition (the test oracle).

Every past token ``s`` keeps its own state ``X_s(t) = Phi(t, s) K_s V_s^T`` with
``Phi(t, s) = C_t ... C_{s+1}`` (the linear op's transitions), and is read at time ``t`` with the
weight of its bucket (log-linear paper, eq. 3 and 4; kernels/README.md §7):

    o_t = scale * sum_s lambda_t^(level(t, s)) X_s(t)^T q_t,   level(t, s) = min(bit_length(t XOR s), L - 1)

with absolute positions ``t = offset + i``. No Fenwick bookkeeping: the chunk ops and the decoding
step are checked against this. Level ``j`` of an initial state is one more such entry, read at the
level ``levels.initial_level`` gives. Cost O(T^2) states: for tests only.
"""
from typing import Callable, List, Optional, Tuple

import torch

from .levels import initial_level, token_level


def generalized_transition(state: torch.Tensor, g_t: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``(Diag(exp g_t) - A_t B_t^T) X`` for a stack of states ``X`` ``[B, H, N, K, V]``;
    ``g_t`` ``[B, H, K]`` (or ``[B, H]``, one decay per head, as the generalized op takes it),
    ``a_t, b_t`` ``[B, H, r_ab, K]``."""
    if g_t.dim() == 2:
        g_t = g_t.unsqueeze(-1)
    read = torch.einsum("bhrk,bhnkv->bhnrv", b_t, state)
    return g_t.exp()[:, :, None, :, None] * state - torch.einsum("bhrk,bhnrv->bhnkv", a_t, read)


def hdla_transition(state: torch.Tensor, k_t: torch.Tensor, beta_t: torch.Tensor, g_t: torch.Tensor) -> torch.Tensor:
    """``(I - beta k k^T) Diag(exp g) (I - beta k k^T) X`` (HDLA paper eq. 27) for ``X`` ``[B, H, N, K, V]``;
    ``k_t, g_t`` ``[B, H, K]``, ``beta_t`` ``[B, H]``."""
    k_col, beta = k_t[:, :, None, :, None], beta_t[:, :, None, None, None]

    def householder(x):
        return x - beta * k_col * (k_col * x).sum(-2, keepdim=True)

    return householder(g_t.exp()[:, :, None, :, None] * householder(state))


def _naive_loglinear(
    q: torch.Tensor,
    level_scales: torch.Tensor,
    transition: Callable[[torch.Tensor, int], torch.Tensor],
    write: Callable[[int], torch.Tensor],
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    offset: int,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The loop over tokens, shared by both ops: ``transition(X, i)`` advances a stack of states
    ``[B, H, N, K, V]`` through token ``i``, ``write(i)`` is ``K_i V_i^T`` ``[B, H, K, V]``."""
    batch, seq_len, heads, dk = q.shape
    num_levels = level_scales.shape[-1]
    scale = 1.0 if scale is None else scale
    first = write(0)
    states = first.new_zeros(batch, heads, 0, dk, first.shape[-1])
    levels: List[Callable[[int], int]] = []  # entry n -> its level at absolute time t
    if initial_state is not None:
        states = initial_state.to(first.dtype)
        levels = [lambda t, j=j: initial_level(t, offset, j, num_levels) for j in range(num_levels)]
    outputs, final = [], None
    for i in range(seq_len):
        t = offset + i
        states = torch.cat([transition(states, i), write(i).unsqueeze(2)], dim=2)
        levels.append(lambda t_read, s=t: token_level(t_read, s, num_levels))
        level_of = torch.tensor([level(t) for level in levels], device=q.device)
        weight = level_scales[:, i].to(states.dtype)[..., level_of]  # [B, H, N]
        outputs.append(scale * torch.einsum("bhn,bhk,bhnkv->bhv", weight, q[:, i].to(states.dtype), states))
    if output_final_state:
        one_hot = torch.nn.functional.one_hot(level_of, num_levels).to(states.dtype)  # [N, L]
        final = torch.einsum("nl,bhnkv->bhlkv", one_hot, states)
    return torch.stack(outputs, dim=1), final


def _flip(*xs):
    return [x.flip(1) for x in xs]


def naive_loglinear_generalized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
    offset: int = 0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-linear generalized attention from its definition (module docstring).

    Args:
        q, g: ``[B, T, H, K]``; k ``[B, T, H, r_kv, K]``; v ``[B, T, H, r_kv, V]``;
            a, b ``[B, T, H, r_ab, K]``: the linear op's inputs (:func:`naive_generalized`).
        level_scales: ``[B, T, H, L]``, lambda_t^(l); levels ``>= L`` use the last one.
        initial_state: ``[B, H, L, K, V]``, the levels of a cache after ``offset`` tokens, or None.
        reverse: run on the time-reversed sequence (levels relative to the reversed order).
        offset: absolute position of token 0.

    Returns:
        ``o [B, T, H, V]`` and, if asked, the levels after the last token ``[B, H, L, K, V]``.
    """
    if reverse:
        o, final = naive_loglinear_generalized(*_flip(q, k, v, a, b, g, level_scales), scale=scale,
                                               initial_state=initial_state, output_final_state=output_final_state,
                                               offset=offset)
        return o.flip(1), final

    def transition(states, i):
        return generalized_transition(states, g[:, i], a[:, i], b[:, i])

    def write(i):
        return torch.einsum("bhrk,bhrv->bhkv", k[:, i], v[:, i])

    return _naive_loglinear(q, level_scales, transition, write, scale, initial_state, output_final_state, offset)


def naive_loglinear_hdla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
    offset: int = 0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-linear HDLA from its definition, with explicit Householder products.

    q, k, g: ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; the rest as
    :func:`naive_loglinear_generalized`.
    """
    if reverse:
        o, final = naive_loglinear_hdla(*_flip(q, k, v, beta, g, level_scales), scale=scale,
                                        initial_state=initial_state, output_final_state=output_final_state,
                                        offset=offset)
        return o.flip(1), final

    def transition(states, i):
        return hdla_transition(states, k[:, i], beta[:, i], g[:, i])

    def write(i):
        return k[:, i].unsqueeze(-1) * v[:, i].unsqueeze(-2)

    return _naive_loglinear(q, level_scales, transition, write, scale, initial_state, output_final_state, offset)
