"""Tokens as several delta-rule steps each (kernels/README.md §2, §12): HDLA's two (``H S``, then ``H Diag(lambda) S
+ k v^T`` with ``H = I - beta k k^T``; the token's output is the second step's), and the n sub-steps of the seed
mixers that are products of delta steps (:func:`chunk_delta_substeps`: Gated DeltaProduct's n_h, one for KDA,
(Gated) DeltaNet and GLA)."""
from typing import Optional, Tuple

import torch


def interleave(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, ...]`` twice -> ``[B, 2T, H, ...]``: step ``2t`` from ``first``, step ``2t + 1`` from ``second``."""
    return torch.stack([first, second], dim=2).flatten(1, 2)


def hdla_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
               g: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """HDLA's inputs (q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``) as the delta rule's over
    ``2T`` steps: ``(q, k, v, beta, g, write)``; the first step of each token has no query, no decay and no write,
    the second the token's query, decay and write ``k v^T`` (write scale 1, whatever beta)."""
    zeros = torch.zeros_like
    return (interleave(zeros(q), q), interleave(k, k), interleave(zeros(v), v), interleave(beta, beta),
            interleave(zeros(g), g), interleave(zeros(beta), torch.ones_like(beta)))


def _steps_of(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, n, ...]`` -> ``[B, T n, H, ...]``: token t's sub-step j at step ``t n + j``."""
    return x.transpose(2, 3).flatten(1, 2)


def substeps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, write: torch.Tensor,
             g: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Tokens of n sub-steps as the delta rule's ``T n`` steps: ``(q, k, v, beta, g, write)``, step shapes.

    Token t: ``S <- (I - beta_j k_j k_j^T) Diag(exp g_j) S + write_j k_j v_j^T`` for j = 1..n, with the token's decay
    on its first sub-step (``g_1 = g``, later ``g_j = 0``), then ``o_t = scale S^T q_t``: the query on the last
    sub-step. Inputs: q ``[B, T, H, K]``, k ``[B, T, H, n, K]``, v ``[B, T, H, n, V]``, beta and write
    ``[B, T, H, n]``, g ``[B, T, H, K]`` per channel or ``[B, T, H]`` per head (kept so: the kernels' per-head
    specialisation)."""
    n = k.shape[3]
    first = torch.arange(n, device=k.device) == 0
    last = torch.arange(n, device=k.device) == n - 1
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    if g.dim() == 4:  # per channel: [B, T, H, n, K]
        g_s = _steps_of(torch.where(first[:, None], g.unsqueeze(3), zero))
    else:  # per head: [B, T, H, n]
        g_s = _steps_of(torch.where(first, g.unsqueeze(-1), zero).unsqueeze(-1)).squeeze(-1)
    q_steps = torch.where(last[:, None], q.unsqueeze(3), torch.zeros((), dtype=q.dtype, device=q.device))
    q_s, k_s, v_s = (_steps_of(x) for x in (q_steps, k, v))
    beta_s, write_s = (_steps_of(x.unsqueeze(-1)).squeeze(-1) for x in (beta, write))
    return q_s, k_s, v_s, beta_s, g_s, write_s


def chunk_token_steps(make_steps, n: int, tokens, scale: Optional[float], initial_state: Optional[torch.Tensor],
                      output_final_state: bool, reverse: bool, precision: Optional[str] = None,
                      recompute: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Tokens of n delta-rule steps each on the delta rule's op (``chunk_delta_rule``: its Triton kernels where
    Triton runs, else its PyTorch chunk form): ``make_steps(*tokens)`` gives the steps' inputs, and a token's output
    is its last step's. ``(o [B, T, H, V]`` in q's dtype, the final state ``[B, H, K, V]`` fp32 (float64 for float64
    inputs on the CPU form) or None). ``reverse``: the scan from the last token to the first (the tokens flipped
    before they become steps, so each token's steps keep their order); ``recompute``: ``chunk_delta_rule``'s."""
    from .chunk import chunk_delta_rule  # imports triton

    tokens = [x.flip(1) if reverse else x for x in tokens]
    o, final = chunk_delta_rule(*make_steps(*tokens), scale, initial_state, output_final_state, precision,
                                recompute=recompute)
    o = o[:, n - 1::n]
    return (o.flip(1) if reverse else o), final


def chunk_delta_substeps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, write: torch.Tensor,
                         g: torch.Tensor, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                         output_final_state: bool = False, reverse: bool = False,
                         recompute: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The recurrence of :func:`substeps` on the delta rule's op (:func:`chunk_token_steps`; ``recompute``: the
    backward remakes the chunk terms, ``chunk_delta_rule``'s)."""
    return chunk_token_steps(substeps, k.shape[3], (q, k, v, beta, write, g), scale, initial_state,
                             output_final_state, reverse, recompute=recompute)
