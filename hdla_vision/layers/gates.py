"""The gate modules of the token mixers, defined once for the vision and the language-model uses.

Each maps the mixer input ``x [B, N, C]`` to one gate of one scan direction. Gates are computed in
fp32 (float64 inputs stay float64): the ops accept fp32 gates with bf16 q, k, v, and a bf16
log-decay would lose the small values that encode long memory. Every log-decay here is ``<= 0`` by
construction (logsigmoid, ``-exp(.) softplus(.)``, ``-e^{-1/2} sigmoid(.)``), inside the ops' domain;
``-inf`` (a reset) is allowed.

Initialisation: :class:`GateModule` subclasses give their special starting values through
:meth:`GateModule.initial_values`; ``init_weights()`` copies them (the vision backbones call it after
their generic linear init), and the language model copies them with transformers' flag-aware
``init.copy_`` so that weights loaded from a checkpoint are never overwritten. The linear maps inside
the modules keep whatever generic init their model gives linears (timm's truncated normal, or
transformers' normal(0, initializer_range)).
"""
import math
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import seed_mixers as sm


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Gates are computed in fp32 (fp64 inputs stay fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def memory_lengths(min_memory: float, max_memory: float, count: int) -> torch.Tensor:
    """``count`` memory lengths (tokens) spaced geometrically over [min_memory, max_memory] (fp32, CPU)."""
    return torch.logspace(math.log10(min_memory), math.log10(max_memory), count, device="cpu")


def check_memory_range(min_memory: float, max_memory: float) -> None:
    if not 1.0 < min_memory <= max_memory:
        raise ValueError(f"expected 1 < min_memory <= max_memory, got {min_memory}, {max_memory}")


def check_rank(name: str, rank: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{name} must be a positive int, got {rank!r}")


class GateModule(nn.Module):
    """A gate whose parameters may have special starting values (see the module docstring)."""

    def initial_values(self) -> Dict[str, torch.Tensor]:
        """``{parameter name: starting value}`` for the parameters that do not keep the generic init."""
        return {}

    @torch.no_grad()
    def init_weights(self) -> None:
        for name, value in self.initial_values().items():
            self.get_parameter(name).copy_(value)


class LowRankProjection(nn.Module):
    """``x [..., C_in] -> x U V (+ b) [..., C_out]`` with ``U`` C_in x r and ``V`` r x C_out (GLA's gate form)."""

    def __init__(self, in_features: int, rank: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        check_rank("rank", rank)
        self.down = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class BetaGate(GateModule):
    """``x [B, N, C] -> beta [B, N, H, n]`` in ``(0, beta_range)`` (n writes per token).

    Starts at ``beta_range / 2`` (bias 0)."""

    def __init__(self, dim: int, num_heads: int, num_steps: int = 1, beta_range: float = 1.0, device=None, dtype=None):
        super().__init__()
        if not beta_range > 0:
            raise ValueError(f"beta_range must be > 0, got {beta_range!r}")
        self.num_heads, self.num_steps, self.beta_range = num_heads, num_steps, beta_range
        self.proj = nn.Linear(dim, num_heads * num_steps, device=device, dtype=dtype)

    def initial_values(self):
        return {"proj.bias": torch.zeros_like(self.proj.bias)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        beta = self.beta_range * torch.sigmoid(at_least_fp32(self.proj(x)))
        return beta.view(*x.shape[:2], self.num_heads, self.num_steps)


class VectorLogDecay(GateModule):
    """Per-key-channel log decay ``g = logsigmoid(x U V + b) / tau`` (HDLA, GLA, KDA): ``[B, N, C] -> [B, N, H, K]``.

    ``b`` starts so that ``exp(g) = 1 - 1/L`` with memory lengths L spaced geometrically over
    [min_memory, max_memory] across each head's K channels (the multi-timescale start of S4 / Mamba):
    some channels forget within a few tokens, others span the sequence. Without the bias
    (``bias=False``, the HDLA authors' layer) ``sigmoid(.)`` starts near 1/2.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, rank: int, tau: float = 1.0,
                 min_memory: float = 2.0, max_memory: float = 256.0, bias: bool = True, device=None, dtype=None):
        super().__init__()
        check_memory_range(min_memory, max_memory)
        self.num_heads, self.head_dim, self.tau = num_heads, head_dim, tau
        self.min_memory, self.max_memory = min_memory, max_memory
        self.logits = LowRankProjection(dim, rank, num_heads * head_dim, bias=bias, device=device, dtype=dtype)

    def initial_values(self):
        if self.logits.up.bias is None:
            return {}
        lam = 1.0 - 1.0 / memory_lengths(self.min_memory, self.max_memory, self.head_dim)
        return {"logits.up.bias": torch.logit(lam ** self.tau).repeat(self.num_heads)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.logsigmoid(at_least_fp32(self.logits(x))) / self.tau
        return g.view(*x.shape[:2], self.num_heads, self.head_dim)


class ScalarLogDecay(GateModule):
    """Mamba-2's per-head gate: ``log alpha = -exp(A_log) softplus(x w + dt_bias)``, ``[B, N, C] -> [B, N, H]``.

    Init as in Mamba-2 / fla: ``A ~ U[1, 16]``, ``softplus(dt_bias)`` log-uniform in [1e-3, 1e-1].
    """

    def __init__(self, dim: int, num_heads: int, device=None, dtype=None):
        super().__init__()
        self.proj = nn.Linear(dim, num_heads, bias=False, device=device, dtype=dtype)
        self.A_log = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))

    def initial_values(self):
        a_log = torch.empty(self.A_log.shape).uniform_(1, 16).log()
        dt = torch.exp(torch.empty(self.dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        return {"A_log": a_log, "dt_bias": dt + torch.log(-torch.expm1(-dt))}  # dt_bias: inverse softplus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(at_least_fp32(self.proj(x)) + self.dt_bias)
        return -self.A_log.exp() * dt


class RWKV7Gates(GateModule):
    """RWKV-7's gates: decay ``w``, in-context rate ``a`` and the key mixing ``k_k``, ``k_a`` (``[H * K]`` each)."""

    W_SCALE = math.exp(-0.5)  # RWKV-7: w = exp(-e^-0.5 sigmoid(.)), so w in [0.545, 1]

    def __init__(self, dim: int, num_heads: int, head_dim: int, rank: int, min_memory: float = 2.0,
                 max_memory: float = 256.0, device=None, dtype=None):
        super().__init__()
        check_memory_range(min_memory, max_memory)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.min_memory, self.max_memory = min_memory, max_memory
        width = num_heads * head_dim
        self.decay = LowRankProjection(dim, rank, width, device=device, dtype=dtype)
        self.icl_rate = LowRankProjection(dim, rank, width, device=device, dtype=dtype)
        self.k_k = nn.Parameter(torch.full((width,), 0.85, device=device, dtype=dtype))
        self.k_a = nn.Parameter(torch.ones(width, device=device, dtype=dtype))

    def initial_values(self):
        """``w`` starts at ``1 - 1/L`` (memory lengths as :class:`VectorLogDecay`), ``a`` at 1/2,
        ``k_k = 0.85``, ``k_a = 1``."""
        lam = 1.0 - 1.0 / memory_lengths(self.min_memory, self.max_memory, self.head_dim)
        s = (-torch.log(lam) / self.W_SCALE).clamp(1e-4, 1 - 1e-4)
        return {"decay.up.bias": torch.logit(s).repeat(self.num_heads),
                "icl_rate.up.bias": torch.zeros_like(self.icl_rate.up.bias),
                "k_k": torch.full_like(self.k_k, 0.85), "k_a": torch.ones_like(self.k_a)}

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> Dict[str, torch.Tensor]:
        """x ``[B, N, C]``, k ``[B, N, H, K]`` -> log_w, a, kappa_hat, replacement key (all ``[B, N, H, K]``);
        ``log_w = -e^{-1/2} sigmoid(.)`` lies in [-0.61, 0]."""
        shape = k.shape
        log_w = (-self.W_SCALE * torch.sigmoid(at_least_fp32(self.decay(x)))).view(shape)
        a = torch.sigmoid(self.icl_rate(x)).view(shape)
        kappa_hat = F.normalize(k * self.k_k.view(shape[2:]), p=2.0, dim=-1)
        k_new = k * (1 + (a - 1) * self.k_a.view(shape[2:]))
        return {"log_w": log_w, "a": a, "kappa_hat": kappa_hat, "k": k_new}


class HeadInHeadMask(GateModule):
    """Logits of Head-in-Head's ``M_org`` per head.

    Static ``[H, r, r]`` parameters, or data-dependent ``x W -> [B, N, H, r, r]``."""

    def __init__(self, dim: int, num_heads: int, groups: int, data_dependent: bool, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.groups, self.data_dependent = num_heads, groups, data_dependent
        if data_dependent:
            self.proj = nn.Linear(dim, num_heads * groups * groups, device=device, dtype=dtype)
        else:
            self.logits = nn.Parameter(torch.zeros(num_heads, groups, groups, device=device, dtype=dtype))

    def initial_values(self):
        """A random positive ``M_org`` (the paper's section 3.3); softplus keeps it positive."""
        name = "proj.bias" if self.data_dependent else "logits"
        return {name: torch.randn(self.get_parameter(name).shape)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``M_org`` in fp32: ``[H, r, r]`` (static) or ``[B, N, H, r, r]`` (data-dependent)."""
        if not self.data_dependent:
            return sm.head_in_head_mask(at_least_fp32(self.logits))
        r = self.groups
        return sm.head_in_head_mask(at_least_fp32(self.proj(x)).view(*x.shape[:2], self.num_heads, r, r))


class LevelScales(GateModule):
    """The per-level weights of log-linear attention (log-linear paper §3; kernels/README.md §7):
    ``lambda_t^(l) = softplus(L_{h,l} (x_t W_lambda)_{h,l})``, ``x [B, N, C] -> [B, N, H, num_levels]``
    in fp32 (float64 inputs stay float64).

    ``W_lambda`` (``proj``) has no bias and ``L`` (``level_gain``, ``[H, num_levels]``) starts at
    ones, as the authors' layer: with the generic small init of ``proj`` every weight starts near
    ``softplus(0) = ln 2``, the same on every level (a scaled linear mixer)."""

    def __init__(self, dim: int, num_heads: int, num_levels: int, device=None, dtype=None):
        super().__init__()
        check_rank("num_levels", num_levels)
        self.num_heads, self.num_levels = num_heads, num_levels
        self.proj = nn.Linear(dim, num_heads * num_levels, bias=False, device=device, dtype=dtype)
        self.level_gain = nn.Parameter(torch.ones(num_heads, num_levels, device=device, dtype=dtype))

    def initial_values(self):
        return {"level_gain": torch.ones(self.level_gain.shape)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = at_least_fp32(self.proj(x)).view(*x.shape[:2], self.num_heads, self.num_levels)
        return F.softplus(at_least_fp32(self.level_gain) * logits)
