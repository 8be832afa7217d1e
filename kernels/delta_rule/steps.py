"""HDLA as the delta rule over two steps per token (kernels/README.md §2): ``H S``, then ``H Diag(lambda) S + k v^T``
with ``H = I - beta k k^T``; the token's output is the second step's."""
from typing import Tuple

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
