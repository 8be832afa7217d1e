"""Bidirectional vision mixers for the seed family on ``chunk_generalized``.

One module, :class:`BidirectionalSeedMixer`, follows the structure of the bidirectional HDLA
mixer (:mod:`hdla_vision.layers.hdla`): shared q, k, v projections, one set of gates per scan
direction, a forward scan (t = 1..N) and a reversed one (t = N..1, inside the kernel), then
``o = W_o (RMSNorm_head(y) * SiLU(x W_g))``. Subclasses give the mixer's activations, its
per-direction gate modules and the factor function of :mod:`hdla_vision.layers.seed_mixers`
that turns them into the generalized op's ``(k, v, a, b, g)``.

The token's own write. Both scans contain ``scale * q_t^T K_t V_t^T``; with per-direction
gates (beta, RWKV-7's in-context rate) the two writes differ, so the mixer subtracts the
backward scan's own write:

    y_t = y^fwd_t + y^bwd_t - scale * sum_i (q_t . K_t[i]) V_t[i]   (backward K, V)

i.e. the backward scan reads the later tokens through token t's own (backward) transition and
the token itself is read once, through the forward scan's write.

Activations, from each paper (no short convolution: the backbone has a position embedding):
- GLA: q, k, v linear; ``g = logsigmoid(x W_1 W_2 + b) / 16`` per channel; no delta term.
- DeltaNet, Gated DeltaNet, Gated DeltaProduct, KDA, Head-in-Head: q, k, v after SiLU, q and k
  L2-normalised, ``beta = sigmoid(.)`` (times 2 for Gated DeltaProduct, whose paper allows
  negative eigenvalues). Scalar gates are Mamba-2's ``alpha = exp(-exp(A_log) softplus(x w + dt_bias))``;
  KDA's per-channel gate is GLA's low-rank form with logsigmoid.
- RWKV-7: r, k, v linear; ``w = exp(-e^{-1/2} sigmoid(.))``, in-context rate ``a = sigmoid(.)``,
  ``kappa_hat = normalize(k * k_k)``, replacement key ``k * (1 + (a - 1) k_a)``. Token shift,
  the bonus term and the group norm of RWKV-7 are replaced by the shared output norm and gate.
All use ``scale = D^-1/2`` (fla's default) before the per-head RMS norm.
"""
import math
from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from hdla_vision.kernels import chunk_generalized

from . import seed_mixers as sm
from .hdla import GatedOutputMixer, LowRankDecay, at_least_fp32
from .registry import register_mixer


def memory_lengths(min_memory: float, max_memory: float, count: int) -> torch.Tensor:
    """``count`` memory lengths (tokens) spaced geometrically over [min_memory, max_memory]."""
    return torch.logspace(math.log10(min_memory), math.log10(max_memory), count)


class BetaGate(nn.Module):
    """``x [B, N, C] -> beta [B, N, H, n]`` in ``(0, beta_range)``; starts at ``beta_range / 2``."""

    def __init__(self, dim: int, num_heads: int, num_steps: int = 1, beta_range: float = 1.0, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.num_steps, self.beta_range = num_heads, num_steps, beta_range
        self.proj = nn.Linear(dim, num_heads * num_steps, device=device, dtype=dtype)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        beta = self.beta_range * torch.sigmoid(at_least_fp32(self.proj(x)))
        return beta.view(*x.shape[:2], self.num_heads, self.num_steps)


class VectorLogDecay(nn.Module):
    """Per-channel log decay ``g = logsigmoid(x U V + b) / tau`` (GLA, KDA): ``[B, N, C] -> [B, N, H, D]``.

    ``b`` starts so that ``exp(g) = 1 - 1/L`` with memory lengths L spaced geometrically over each
    head's channels (as the HDLA mixer does).
    """

    def __init__(self, dim: int, num_heads: int, rank: int, tau: float, min_memory: float, max_memory: float,
                 device=None, dtype=None):
        super().__init__()
        self.num_heads, self.head_dim, self.tau = num_heads, dim // num_heads, tau
        self.min_memory, self.max_memory = min_memory, max_memory
        self.logits = LowRankDecay(dim, rank, device=device, dtype=dtype)

    @torch.no_grad()
    def init_weights(self) -> None:
        lam = 1.0 - 1.0 / memory_lengths(self.min_memory, self.max_memory, self.head_dim)
        self.logits.up.bias.copy_(torch.logit(lam ** self.tau).repeat(self.num_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``g <= 0`` by construction (logsigmoid): inside the ops' domain; -inf (a reset) is allowed."""
        g = F.logsigmoid(at_least_fp32(self.logits(x))) / self.tau
        return g.view(*x.shape[:2], self.num_heads, self.head_dim)


class ScalarLogDecay(nn.Module):
    """Mamba-2's per-head gate: ``log alpha = -exp(A_log) softplus(x w + dt_bias)``, ``[B, N, C] -> [B, N, H]``.

    Init as in Mamba-2 / fla: ``A ~ U[1, 16]``, ``softplus(dt_bias)`` log-uniform in [1e-3, 1e-1].
    """

    def __init__(self, dim: int, num_heads: int, device=None, dtype=None):
        super().__init__()
        self.proj = nn.Linear(dim, num_heads, bias=False, device=device, dtype=dtype)
        self.A_log = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))

    @torch.no_grad()
    def init_weights(self) -> None:
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``log alpha <= 0`` by construction (-exp(.) * softplus(.)): inside the ops' domain."""
        dt = F.softplus(at_least_fp32(self.proj(x)) + self.dt_bias)
        return -self.A_log.exp() * dt


class BidirectionalSeedMixer(GatedOutputMixer):
    """Generic bidirectional mixer, ``forward(x [B, N, C]) -> [B, N, C]``.

    Subclasses set ``num_keys`` (key/value pairs per token, n_h for Gated DeltaProduct),
    ``qkv_activation`` ("silu_l2" or "linear"), implement ``make_direction`` (the gate modules of one
    scan direction, its parameters created with ``**self.factory_kwargs``: timm's ``device`` and
    ``dtype``) and ``step`` (the factor function applied to one direction's gates).
    """

    num_keys = 1
    qkv_activation = "silu_l2"
    mixer_name = "seed"

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False, proj_drop: float = 0.0,
                 norm_eps: float = 1e-5, device=None, dtype=None, **kw):
        super().__init__()
        if not isinstance(dim, int) or not isinstance(num_heads, int) or num_heads < 1 or dim % num_heads:
            raise ValueError(f"dim must be a positive multiple of num_heads, got dim={dim}, num_heads={num_heads}")
        self.dim, self.num_heads, self.head_dim, self.norm_eps = dim, num_heads, dim // num_heads, norm_eps
        self.scale = self.head_dim ** -0.5
        self.factory_kwargs = dd = dict(device=device, dtype=dtype)
        self.configure(**kw)
        self.qkv = nn.Linear(dim, (1 + 2 * self.num_keys) * dim, bias=qkv_bias, **dd)
        self.directions = nn.ModuleList([self.make_direction(), self.make_direction()])  # forward, backward
        self.gate = nn.Linear(dim, dim, **dd)
        self.norm = nn.RMSNorm(self.head_dim, eps=norm_eps, **dd)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.init_weights()

    # -- hooks -------------------------------------------------------------------------------------
    def configure(self, **kw) -> None:
        """Take the mixer's own keyword arguments; unknown ones raise."""
        if kw:
            raise ValueError(f"unknown arguments for the {self.mixer_name!r} mixer: {sorted(kw)}")

    def make_direction(self) -> nn.ModuleDict:
        raise NotImplementedError

    def step(self, x, q, k, v, gates: nn.ModuleDict) -> sm.GeneralizedStep:
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """Gate initialisations; the backbone calls this after its generic linear init."""
        for module in self.directions.modules():
            if hasattr(module, "init_weights"):
                module.init_weights()

    def projections(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[B, N, H, D]``; k, v ``[B, N, H, n, D]`` (n = ``num_keys``), activated."""
        batch, seq_len, _ = x.shape
        heads, hd, n = self.num_heads, self.head_dim, self.num_keys
        q, k, v = self.qkv(x).split([self.dim, n * self.dim, n * self.dim], dim=-1)
        q = q.reshape(batch, seq_len, heads, hd)
        k = k.reshape(batch, seq_len, heads, n, hd)
        v = v.reshape(batch, seq_len, heads, n, hd)
        if self.qkv_activation == "silu_l2":
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
            q = F.normalize(q, p=2.0, dim=-1, eps=self.norm_eps)
            k = F.normalize(k, p=2.0, dim=-1, eps=self.norm_eps)
        return q.contiguous(), k, v

    def scan(self, x, q, k, v, gates, reverse: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """One direction: ``(y [B, N, H, D], own write [B, N, H, D])``."""
        step = self.step(x, q, k, v, gates)
        kw, vw, a, b = (t.to(q.dtype).contiguous() for t in (step.k, step.v, step.a, step.b))
        y, _ = chunk_generalized(q, kw, vw, a, b, step.g.contiguous(), scale=self.scale, reverse=reverse)
        own = self.scale * ((q.unsqueeze(-2) * kw).sum(-1, keepdim=True) * vw).sum(-2)
        return y, own

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """The bidirectional sum before norm and gate: ``x [B, N, C] -> y [B, N, H, D]``."""
        q, k, v = self.projections(x)
        y_fwd, _ = self.scan(x, q, k, v, self.directions[0], reverse=False)
        y_bwd, own_bwd = self.scan(x, q, k, v, self.directions[1], reverse=True)
        return y_fwd + y_bwd - own_bwd


class _DecayOptions:
    """Keyword arguments shared by mixers with a per-channel decay."""

    def configure(self, decay_rank: int = 16, min_memory: float = 2.0, max_memory: float = 256.0, **kw):
        if decay_rank < 1:
            raise ValueError(f"decay_rank must be >= 1, got {decay_rank}")
        if not 1.0 < min_memory <= max_memory:
            raise ValueError(f"expected 1 < min_memory <= max_memory, got {min_memory}, {max_memory}")
        self.decay_rank, self.min_memory, self.max_memory = decay_rank, min_memory, max_memory
        super().configure(**kw)

    def vector_decay(self, tau: float) -> VectorLogDecay:
        return VectorLogDecay(self.dim, self.num_heads, self.decay_rank, tau, self.min_memory, self.max_memory,
                              **self.factory_kwargs)


@register_mixer("gla", kind="vision")
class BidirectionalGLA(_DecayOptions, BidirectionalSeedMixer):
    """GLA: ``S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T``, ``alpha = sigmoid(.)^(1/16)`` (GLA's tau = 16)."""

    qkv_activation, mixer_name = "linear", "gla"

    def make_direction(self):
        return nn.ModuleDict({"decay": self.vector_decay(tau=16.0)})

    def step(self, x, q, k, v, gates):
        return sm.gla_factors(k[..., 0, :], v[..., 0, :], gates["decay"](x))


@register_mixer("deltanet", kind="vision")
class BidirectionalDeltaNet(BidirectionalSeedMixer):
    """DeltaNet: ``S_t = (I - beta k k^T) S_{t-1} + beta k v^T``, ``beta = sigmoid(.)``."""

    mixer_name = "deltanet"

    def make_direction(self):
        return nn.ModuleDict({"beta": BetaGate(self.dim, self.num_heads, **self.factory_kwargs)})

    def step(self, x, q, k, v, gates):
        return sm.deltanet_factors(k[..., 0, :], v[..., 0, :], gates["beta"](x)[..., 0])


@register_mixer("gated_deltanet", kind="vision")
class BidirectionalGatedDeltaNet(BidirectionalSeedMixer):
    """Gated DeltaNet: ``S_t = alpha (I - beta k k^T) S_{t-1} + beta k v^T`` (scalar Mamba-2 gate)."""

    mixer_name = "gated_deltanet"

    def make_direction(self):
        dd = self.factory_kwargs
        return nn.ModuleDict({"beta": BetaGate(self.dim, self.num_heads, **dd), "alpha": ScalarLogDecay(self.dim, self.num_heads, **dd)})

    def step(self, x, q, k, v, gates):
        return sm.gated_deltanet_factors(k[..., 0, :], v[..., 0, :], gates["beta"](x)[..., 0], gates["alpha"](x))


@register_mixer("kda", kind="vision")
class BidirectionalKDA(_DecayOptions, BidirectionalSeedMixer):
    """KDA: ``S_t = (I - beta k k^T) Diag(alpha_t) S_{t-1} + beta k v^T`` (per-channel alpha)."""

    mixer_name = "kda"

    def make_direction(self):
        return nn.ModuleDict({"beta": BetaGate(self.dim, self.num_heads, **self.factory_kwargs), "decay": self.vector_decay(tau=1.0)})

    def step(self, x, q, k, v, gates):
        return sm.kda_factors(k[..., 0, :], v[..., 0, :], gates["beta"](x)[..., 0], gates["decay"](x))


class RWKV7Gates(nn.Module):
    """One direction of RWKV-7: decay ``w``, in-context rate ``a`` and the key mixing ``k_k``, ``k_a``."""

    W_SCALE = math.exp(-0.5)  # RWKV-7: w = exp(-e^-0.5 sigmoid(.)), so w in [0.545, 1]

    def __init__(self, dim: int, num_heads: int, rank: int, min_memory: float, max_memory: float, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.min_memory, self.max_memory = min_memory, max_memory
        self.decay = LowRankDecay(dim, rank, device=device, dtype=dtype)
        self.icl_rate = LowRankDecay(dim, rank, device=device, dtype=dtype)
        self.k_k = nn.Parameter(torch.full((dim,), 0.85, device=device, dtype=dtype))
        self.k_a = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    @torch.no_grad()
    def init_weights(self) -> None:
        lam = 1.0 - 1.0 / memory_lengths(self.min_memory, self.max_memory, self.head_dim)
        s = (-torch.log(lam) / self.W_SCALE).clamp(1e-4, 1 - 1e-4)
        self.decay.up.bias.copy_(torch.logit(s).repeat(self.num_heads))
        nn.init.zeros_(self.icl_rate.up.bias)
        self.k_k.fill_(0.85)
        self.k_a.fill_(1.0)

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> Dict[str, torch.Tensor]:
        """x ``[B, N, C]``, k ``[B, N, H, D]`` -> log_w, a, kappa_hat, replacement key (all ``[B, N, H, D]``);
        ``log_w = -e^{-1/2} sigmoid(.)`` lies in [-0.61, 0] by construction (the ops' domain is g <= 0)."""
        shape = k.shape
        log_w = (-self.W_SCALE * torch.sigmoid(at_least_fp32(self.decay(x)))).view(shape)
        a = torch.sigmoid(self.icl_rate(x)).view(shape)
        kappa_hat = F.normalize(k * self.k_k.view(shape[2:]), p=2.0, dim=-1)
        k_new = k * (1 + (a - 1) * self.k_a.view(shape[2:]))
        return {"log_w": log_w, "a": a, "kappa_hat": kappa_hat, "k": k_new}


@register_mixer("rwkv7", kind="vision")
class BidirectionalRWKV7(_DecayOptions, BidirectionalSeedMixer):
    """RWKV-7: ``S_t = (Diag(w_t) - (a * kappa_hat) kappa_hat^T) S_{t-1} + k~ v^T`` (state = wkv^T)."""

    qkv_activation, mixer_name = "linear", "rwkv7"

    def make_direction(self):
        gates = RWKV7Gates(self.dim, self.num_heads, self.decay_rank, self.min_memory, self.max_memory, **self.factory_kwargs)
        return nn.ModuleDict({"rwkv": gates})

    def step(self, x, q, k, v, gates):
        p = gates["rwkv"](x, k[..., 0, :])
        return sm.rwkv7_factors(p["k"], v[..., 0, :], p["kappa_hat"], p["a"], p["log_w"])


class _GatedDeltaProduct(BidirectionalSeedMixer):
    """Gated DeltaProduct: per token ``S <- alpha S``, then n_h steps ``S <- (I - b k k^T) S + b k v^T``, b in (0, 2)."""

    def configure(self, beta_range: float = 2.0, **kw):
        self.beta_range = beta_range
        super().configure(**kw)

    def make_direction(self):
        return nn.ModuleDict({
            "beta": BetaGate(self.dim, self.num_heads, self.num_keys, self.beta_range, **self.factory_kwargs),
            "alpha": ScalarLogDecay(self.dim, self.num_heads, **self.factory_kwargs),
        })

    def step(self, x, q, k, v, gates):
        return sm.gated_deltaproduct_factors_5d(at_least_fp32(k), at_least_fp32(v), gates["beta"](x), gates["alpha"](x))


@register_mixer("gated_deltaproduct2", kind="vision")
class BidirectionalGatedDeltaProduct2(_GatedDeltaProduct):
    num_keys, mixer_name = 2, "gated_deltaproduct2"


@register_mixer("gated_deltaproduct3", kind="vision")
class BidirectionalGatedDeltaProduct3(_GatedDeltaProduct):
    num_keys, mixer_name = 3, "gated_deltaproduct3"


class HeadInHeadMask(nn.Module):
    """Logits of ``M_org`` per head: static ``[H, r, r]`` parameters or data-dependent ``x W -> [B, N, H, r, r]``."""

    def __init__(self, dim: int, num_heads: int, groups: int, data_dependent: bool, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.groups, self.data_dependent = num_heads, groups, data_dependent
        if data_dependent:
            self.proj = nn.Linear(dim, num_heads * groups * groups, device=device, dtype=dtype)
        else:
            self.logits = nn.Parameter(torch.zeros(num_heads, groups, groups, device=device, dtype=dtype))

    @torch.no_grad()
    def init_weights(self) -> None:
        # a random positive M_org (the paper's section 3.3); softplus keeps it positive
        target = self.proj.bias if self.data_dependent else self.logits
        target.copy_(torch.randn_like(target))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.data_dependent:
            return sm.head_in_head_mask(at_least_fp32(self.logits))
        r = self.groups
        return sm.head_in_head_mask(at_least_fp32(self.proj(x)).view(*x.shape[:2], self.num_heads, r, r))


class _HeadInHead(BidirectionalSeedMixer):
    """Head-in-Head (Gated) DeltaNet: ``S_t = alpha (I - beta (k k^T) o M) S_{t-1} + beta k v^T``.

    Keyword arguments: ``groups`` r (default 4, must divide the head dim), ``mask`` "static" (learnable
    ``M_org`` per head, the paper's MAD / MQAR setting) or "data" (from the input by a linear map).
    """

    gated = False

    def configure(self, groups: int = 4, mask: str = "static", **kw):
        if not isinstance(groups, int) or groups < 1 or self.head_dim % groups:
            raise ValueError(f"groups must be a positive int dividing the head dim {self.head_dim}, got {groups!r}")
        if mask not in ("static", "data"):
            raise ValueError(f"mask must be 'static' or 'data', got {mask!r}")
        self.groups, self.mask_kind = groups, mask
        super().configure(**kw)

    def make_direction(self):
        dd = self.factory_kwargs
        gates = {"beta": BetaGate(self.dim, self.num_heads, **dd),
                 "mask": HeadInHeadMask(self.dim, self.num_heads, self.groups, self.mask_kind == "data", **dd)}
        if self.gated:
            gates["alpha"] = ScalarLogDecay(self.dim, self.num_heads, **dd)
        return nn.ModuleDict(gates)

    def step(self, x, q, k, v, gates):
        log_alpha = gates["alpha"](x) if self.gated else None
        return sm.head_in_head_factors(k[..., 0, :], v[..., 0, :], gates["beta"](x)[..., 0], gates["mask"](x), log_alpha)


@register_mixer("hih_deltanet", kind="vision")
class BidirectionalHeadInHeadDeltaNet(_HeadInHead):
    mixer_name = "hih_deltanet"


@register_mixer("hih_gated_deltanet", kind="vision")
class BidirectionalHeadInHeadGatedDeltaNet(_HeadInHead):
    gated, mixer_name = True, "hih_gated_deltanet"
