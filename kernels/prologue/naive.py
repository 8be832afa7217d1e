"""The mixer prologue in plain PyTorch: the definition the fused kernels (``prologue/fused.py``) are
tested against, and their path for CPU tensors without the interpreter and for float64.

From one projection ``proj [B, N, P]`` whose columns are ``q (H*K) | k (H*K) | v (H*V) | beta logits
(D*H, direction-major) | padding`` and the decay logits ``[D, B, N, H*K]`` (D scan directions):

    q    = SiLU(q_cols)                       (L2-normalised per head too where normalize_q)
    k    = SiLU(k_cols) / max(||SiLU(k_cols)||_2, eps)      per head
    v    = SiLU(v_cols)
    beta = beta_range * sigmoid(beta_cols)    [D, B, N, H]      fp32 (float64 stays float64)
    g    = logsigmoid(decay_logits) / tau     [D, B, N, H, K]   fp32 (float64 stays float64)

q, k, v in proj's dtype, ``[B, N, H, K]`` / ``[B, N, H, V]``: what the HDLA mixer's unfused prologue
computes (``layers/mixer.py: projections``, ``layers/gates.py: BetaGate, VectorLogDecay``).
"""
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def gate_dtype(x: Tensor) -> torch.dtype:
    """The gates' dtype: fp32, float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def naive_mixer_prologue(proj: Tensor, decay_logits: Tensor, heads: int, head_dim: int, head_dim_v: int,
                         beta_range: float, inv_tau: float = 1.0, eps: float = 1e-5, normalize_q: bool = False
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, k, v, beta, g)`` of the module docstring, differentiable by autograd."""
    batch, seq_len, _ = proj.shape
    directions = decay_logits.shape[0]
    hk, hv = heads * head_dim, heads * head_dim_v
    q, k, v, beta = proj[..., :2 * hk + hv + directions * heads].split([hk, hk, hv, directions * heads], dim=-1)
    q = F.silu(q).reshape(batch, seq_len, heads, head_dim)
    k = F.silu(k).reshape(batch, seq_len, heads, head_dim)
    v = F.silu(v).reshape(batch, seq_len, heads, head_dim_v)
    if normalize_q:
        q = F.normalize(q.to(gate_dtype(q)), p=2.0, dim=-1, eps=eps).to(proj.dtype)
    k = F.normalize(k.to(gate_dtype(k)), p=2.0, dim=-1, eps=eps).to(proj.dtype)
    beta = beta_range * torch.sigmoid(beta.to(gate_dtype(beta)))
    beta = beta.reshape(batch, seq_len, directions, heads).permute(2, 0, 1, 3)
    g = F.logsigmoid(decay_logits.to(gate_dtype(decay_logits))) * inv_tau
    g = g.reshape(directions, batch, seq_len, heads, head_dim)
    return q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), g.contiguous()
