"""Bidirectional HDLA token mixer for vision backbones (HDLA paper, appendix C.1, eq. 23-30).

Per head (head dim ``D = dim / num_heads`` for both keys and values), for each direction
``d`` in {forward, backward}:

    q, k, v = SiLU(x W_q), SiLU(x W_k), SiLU(x W_v)          (shared by both directions)
    k       = k / ||k||_2
    lambda  = sigmoid(x W_lambda_d)      (low rank: W_lambda_d = U_d V_d, plus a bias)
    beta    = 2 * sigmoid(x W_beta_d)    in (0, 2)
    S_t     = (I - beta k k^T) Diag(lambda) (I - beta k k^T) S_{t-1} + k v^T    (eq. 27)
    y^d_t   = S_t^T q_t                                                        (eq. 28)

The forward scan runs t = 1..N, the backward scan t = N..1 (``chunk_hdla(reverse=True)``:
the kernel walks the sequence from the end, no flipped copies). Both outputs contain the
token's own write ``(q_t . k_t) v_t``, so the mixer subtracts it once:

    y_t = y^fwd_t + y^bwd_t - (q_t . k_t) v_t

i.e. each token reads every other token exactly once (through the decays of the direction
that reaches it) and itself once.

Output (eq. 29-30 plus two choices the paper leaves open):
    o_t = W_o ( RMSNorm_head(y_t) * SiLU(x_t W_g) )
- ``RMSNorm_head``: an RMS norm over each head's D features (weight shared by heads), as in
  GLA / Gated DeltaNet. The scan has no 1/sqrt(D) scale and its output norm grows with the
  number of tokens that fit in the decay window, so without it the block's output scale would
  change with the input resolution.
- the gate ``g_t = x_t W_g`` (eq. 29) goes through SiLU, as the swish output gate of GLA and
  Gated DeltaNet; a purely linear gate would make the mixer output quadratic in x with no
  saturation.

Decay initialisation: the per-direction lambda bias starts at ``logit(1 - 1/L)`` with memory
lengths L spaced geometrically over [``min_memory``, ``max_memory``] tokens across each head's
channels (the multi-timescale start of S4/Mamba), so that at initialisation some channels
forget within a few patches and others span the image. The low-rank weights then make the
decay data-dependent.
"""
import math
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from hdla_vision.kernels import chunk_hdla

from .registry import register_mixer


class LowRankDecay(nn.Module):
    """``x [B, N, C] -> x U V + b  [B, N, C]`` with ``U`` C x r and ``V`` r x C (GLA's gate form)."""

    def __init__(self, dim: int, rank: int, device=None, dtype=None):
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(rank, dim, bias=True, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Gates are computed in fp32 (fp64 inputs stay fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def own_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The token's own contribution ``(q_t . k_t) v_t`` to both scans: ``[B, N, H, D]``."""
    return (q * k).sum(-1, keepdim=True) * v


class GatedOutputMixer(nn.Module):
    """Output stage shared by the bidirectional mixers: ``W_o (RMSNorm_head(mix(x)) * SiLU(x W_g))``.

    Subclasses define ``mix(x [B, N, C]) -> y [B, N, H, D]`` and the attributes ``dim``,
    ``head_dim``, ``norm``, ``norm_eps``, ``gate``, ``proj`` and ``proj_drop``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, N, C] -> [B, N, C]``."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape [B, N, {self.dim}], got {list(x.shape)}")
        batch, seq_len, _ = x.shape
        y = self.mix(x)
        # weight cast to y's dtype: under autocast y is bf16 and rms_norm's fused kernel (fp32
        # accumulation inside) needs matching dtypes
        y = F.rms_norm(y, (self.head_dim,), self.norm.weight.to(y.dtype), self.norm_eps)
        y = y.reshape(batch, seq_len, self.dim) * F.silu(self.gate(x))
        return self.proj_drop(self.proj(y))


@register_mixer("hdla", kind="vision")
class BidirectionalHDLA(GatedOutputMixer):
    """Bidirectional HDLA mixer, ``forward(x [B, N, C]) -> [B, N, C]``.

    Args:
        dim: channels C; must be divisible by ``num_heads``.
        num_heads: heads H; head dim ``D = C / H`` for keys and values.
        qkv_bias: bias on the shared q/k/v projection.
        proj_drop: dropout after the output projection.
        decay_rank: rank r of each direction's lambda projection.
        min_memory, max_memory: range of the initial decay memory lengths (tokens).
        norm_eps: epsilon of the per-head RMS norm and of the key L2 norm.
        device, dtype: where and in which dtype the parameters are created (timm's factory arguments).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = False,
        proj_drop: float = 0.0,
        decay_rank: int = 16,
        min_memory: float = 2.0,
        max_memory: float = 256.0,
        norm_eps: float = 1e-5,
        device=None,
        dtype=None,
        **kw,
    ):
        super().__init__()
        if kw:
            raise ValueError(f"unknown arguments for the 'hdla' mixer: {sorted(kw)}")
        if not isinstance(dim, int) or not isinstance(num_heads, int) or num_heads < 1 or dim % num_heads:
            raise ValueError(f"dim must be a positive multiple of num_heads, got dim={dim}, num_heads={num_heads}")
        if decay_rank < 1:
            raise ValueError(f"decay_rank must be >= 1, got {decay_rank}")
        if not 1.0 < min_memory <= max_memory:
            raise ValueError(f"expected 1 < min_memory <= max_memory, got {min_memory}, {max_memory}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.min_memory, self.max_memory, self.norm_eps = min_memory, max_memory, norm_eps
        dd = dict(device=device, dtype=dtype)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias, **dd)
        self.decay_fwd = LowRankDecay(dim, decay_rank, **dd)
        self.decay_bwd = LowRankDecay(dim, decay_rank, **dd)
        self.beta = nn.Linear(dim, 2 * num_heads, **dd)  # columns [:H] forward, [H:] backward
        self.gate = nn.Linear(dim, dim, **dd)
        self.norm = nn.RMSNorm(self.head_dim, eps=norm_eps, **dd)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise the decay biases (multi-timescale); the backbone calls this after its generic init."""
        memory = torch.logspace(math.log10(self.min_memory), math.log10(self.max_memory), self.head_dim)
        lam = 1.0 - 1.0 / memory
        bias = torch.log(lam) - torch.log1p(-lam)  # logit(lambda)
        for decay in (self.decay_fwd, self.decay_bwd):
            decay.up.bias.copy_(bias.repeat(self.num_heads))
        nn.init.zeros_(self.beta.bias)  # beta = 1 at the start: each write replaces its key's direction

    def projections(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """q, k, v ``[B, N, H, D]`` after SiLU (k L2-normalised), all in one dtype; g_fwd, g_bwd
        ``[B, N, H, D]`` log-decays; beta_fwd, beta_bwd ``[B, N, H]`` in (0, 2); gates in fp32 or
        wider (the ops accept fp32 gates with bf16 q, k, v). ``g = logsigmoid(.) <= 0`` always, so
        the gates are inside the ops' domain by construction (exp(g) = 0, a reset, is allowed)."""
        batch, seq_len, _ = x.shape
        heads, hd = self.num_heads, self.head_dim
        # SiLU per slice: each result is a fresh contiguous [B, N, H, D] tensor (the kernels' layout)
        q, k, v = (F.silu(t) for t in self.qkv(x).view(batch, seq_len, 3, heads, hd).unbind(2))
        # cast back: under CUDA autocast the norm runs in fp32, and the op wants k in q's dtype
        k = F.normalize(k, p=2.0, dim=-1, eps=self.norm_eps).to(q.dtype)
        g_fwd = F.logsigmoid(at_least_fp32(self.decay_fwd(x))).view(batch, seq_len, heads, hd)
        g_bwd = F.logsigmoid(at_least_fp32(self.decay_bwd(x))).view(batch, seq_len, heads, hd)
        beta_fwd, beta_bwd = (2.0 * torch.sigmoid(at_least_fp32(self.beta(x)))).split(heads, dim=-1)
        return q, k, v, g_fwd, g_bwd, beta_fwd, beta_bwd

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """The bidirectional scan sum before norm and gate: ``x [B, N, C] -> y [B, N, H, D]``."""
        q, k, v, g_fwd, g_bwd, beta_fwd, beta_bwd = self.projections(x)
        y_fwd, _ = chunk_hdla(q, k, v, beta_fwd.contiguous(), g_fwd, reverse=False)
        y_bwd, _ = chunk_hdla(q, k, v, beta_bwd.contiguous(), g_bwd, reverse=True)
        return y_fwd + y_bwd - own_write(q, k, v)
