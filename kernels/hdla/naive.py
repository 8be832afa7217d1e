"""HDLA in its own terms (paper eq. 5, 27): a reference loop and its A/B factors."""
from typing import Optional, Tuple

import torch


def hdla_decay_factors(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A_t, B_t with ``Diag(lambda) - A B^T = (I - beta k k^T) Diag(lambda) (I - beta k k^T)``.

    With ``u = lambda * k`` and ``s = k^T Diag(lambda) k`` (kernels/README.md §2):
    ``A = [beta u, k]``, ``B = [k, beta u - beta^2 s k]``.

    Args:
        k, g: ``[B, T, H, K]``; beta: ``[B, T, H]``.
    Returns:
        a, b: ``[B, T, H, 2, K]``.
    """
    beta = beta.unsqueeze(-1)
    u = g.exp() * k
    s = (u * k).sum(-1, keepdim=True)
    a = torch.stack([beta * u, k], dim=-2)
    b = torch.stack([k, beta * u - beta * beta * s * k], dim=-2)
    return a, b


def naive_hdla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token loop of paper eq. 27 with explicit Householder products (no A/B factorisation).

    q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``; state ``[B, H, K, V]``.
    ``g <= 0``; ``g = -inf`` (lambda = 0) is the exact reset of that channel (gradient 0 there).
    """
    batch, seq_len, heads, dk = q.shape
    scale = 1.0 if scale is None else scale
    state = q.new_zeros(batch, heads, dk, v.shape[-1])
    if initial_state is not None:
        state = state + initial_state.to(q.dtype)
    outputs = [None] * seq_len
    steps = range(seq_len - 1, -1, -1) if reverse else range(seq_len)
    for t in steps:
        kt, bt = k[:, t], beta[:, t, :, None, None]

        def householder(x):  # (I - beta k k^T) x
            return x - bt * kt.unsqueeze(-1) * torch.einsum("bhk,bhkv->bhv", kt, x).unsqueeze(-2)

        state = householder(g[:, t].exp().unsqueeze(-1) * householder(state))
        state = state + kt.unsqueeze(-1) * v[:, t].unsqueeze(-2)
        outputs[t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state)
    return torch.stack(outputs, dim=1), (state if output_final_state else None)
