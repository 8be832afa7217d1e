"""Causal token mixers for the language models: HDLA, Gated DeltaNet and Gated DeltaProduct.

All three share one block (projections, optional short causal conv, per-head output RMSNorm,
output gate, output projection) and differ in the recurrence they scan with; the mixers on
``chunk_generalized`` (Gated DeltaNet/DeltaProduct here, the seed mixers of
:mod:`hdla_vision.lm.seed_mixers`) share :class:`GeneralizedCausalMixer`. Every mixer is
registered with ``register_mixer(name, kind="causal")`` and built by name from ``HDLAConfig.mixer``.

Padding. A token whose attention-mask entry is 0 becomes an identity step of the recurrence:
its key, value, beta and log-decay (or its generalized factors k, v, a, b, g) are zeroed, so ``P_t = I`` and the write ``k v^T = 0``. With
left padding the state therefore stays exactly zero until the first real token; with right
padding the final state is the state after the last real token. The short conv sees the
masked (zeroed) inputs, so its window never reaches across into pad tokens' features either.
"""
import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init

from ..kernels import (chunk_generalized, chunk_hdla, fused_recurrent_generalized, fused_recurrent_hdla,
                       hdla_decay_factors, torch_chunk_generalized)
from ..layers.registry import register_mixer
from ..layers.seed_mixers import gated_deltaproduct_factors
from .cache import read_conv_window, read_recurrent_state, write_recurrent_state
from .configuration_hdla import GATE_ACTIVATIONS

# A forward of at most this many new tokens on top of a cached state uses the recurrent step.
RECURRENT_MAX_TOKENS = 4
# "auto": the public ops (Triton on CUDA); "torch": the vectorised PyTorch chunk form on any device
# (differentiable by autograd), e.g. to train on a GPU before the Triton backward is available.
CHUNK_BACKENDS = ("auto", "torch")
_chunk_backend = "auto"


def set_chunk_backend(name: str) -> None:
    """Choose how the mixers run prefill/training scans: ``"auto"`` or ``"torch"``."""
    global _chunk_backend
    if name not in CHUNK_BACKENDS:
        raise ValueError(f"chunk backend must be one of {CHUNK_BACKENDS}, got {name!r}")
    _chunk_backend = name


def _chunk_generalized(q, k, v, a, b, g, scale, initial_state):
    fn = torch_chunk_generalized if _chunk_backend == "torch" else chunk_generalized
    return fn(q, k, v, a, b, g, scale, initial_state, True)


class PerHeadRMSNorm(nn.Module):
    """RMSNorm over the last dim of ``[..., H, V]`` with one weight vector shared by the heads."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class CausalLinearMixer(nn.Module):
    """Shared scaffolding; subclasses define ``projection_sizes``, ``features`` and ``scan``.

    ``forward(x [B, T, C], attention_mask [B, T] or None, cache or None) -> [B, T, C]``; the
    layer's states live at ``layer_idx`` in the cache.
    """

    # "silu": SiLU after the in-projection (and short conv); "identity": keep them linear (GLA, RWKV-7)
    projection_activation = "silu"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        head_dim_v: Optional[int] = None,
        short_conv_size: int = 0,
        gate_act: str = "silu",
        norm_eps: float = 1e-6,
        layer_idx: int = 0,
    ):
        super().__init__()
        if gate_act not in GATE_ACTIVATIONS:
            raise ValueError(f"gate_act must be one of {GATE_ACTIVATIONS}, got {gate_act!r}")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.short_conv_size, self.gate_act, self.layer_idx = short_conv_size, gate_act, layer_idx
        self.proj_sizes = {name: num_heads * size for name, size in self.projection_sizes().items()}
        total = sum(self.proj_sizes.values())
        self.in_proj = nn.Linear(hidden_size, total, bias=False)
        if short_conv_size > 0:
            self.conv = nn.Conv1d(total, total, short_conv_size, groups=total, bias=False)
        self.gate_proj = nn.Linear(hidden_size, num_heads * self.head_dim_v, bias=False)
        self.out_norm = PerHeadRMSNorm(self.head_dim_v, norm_eps)
        self.out_proj = nn.Linear(num_heads * self.head_dim_v, hidden_size, bias=False)

    # -- hooks -------------------------------------------------------------------------------
    def projection_sizes(self) -> Dict[str, int]:
        """Per-head sizes of the projections that go through the short conv and the projection activation."""
        raise NotImplementedError

    def features(self, proj: Dict[str, torch.Tensor], x: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Recurrence inputs ``[B, T, H, ...]`` from the activated projections and the input x."""
        raise NotImplementedError

    def scan(self, feats: Dict[str, torch.Tensor], state: Optional[torch.Tensor], recurrent: bool):
        """Run the recurrence: ``(o [B, T, H, V], final_state [B, H, K, V])``."""
        raise NotImplementedError

    # -- shared forward ----------------------------------------------------------------------
    def _short_conv(self, proj: torch.Tensor, cache) -> torch.Tensor:
        """Depthwise causal conv over time of ``proj [B, T, C]``, continuing a cached window."""
        width = self.short_conv_size - 1
        seq = proj.transpose(1, 2)  # [B, C, T]
        if cache is None or read_conv_window(cache, self.layer_idx) is None:
            seq = F.pad(seq, (width, 0))  # a fresh sequence: zeros before the first token
        if cache is not None:  # returns [cached window, seq] when continuing, and keeps the last `width` inputs
            seq = cache.update_conv_state(seq, self.layer_idx, conv_kernel_size=width)
        return F.conv1d(seq, self.conv.weight, groups=seq.shape[1]).transpose(1, 2)

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.gate_act == "silu":
            return F.silu(gate)
        if self.gate_act == "sigmoid":
            return torch.sigmoid(gate)
        return gate

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, cache=None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        state = read_recurrent_state(cache, self.layer_idx) if cache is not None else None
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(x.dtype)[..., None]
            x = x * mask
        proj = self.in_proj(x)
        if self.short_conv_size > 0:
            proj = self._short_conv(proj, cache)
        if self.projection_activation == "silu":
            proj = F.silu(proj)
        groups = torch.split(proj, list(self.proj_sizes.values()), dim=-1)
        proj = {name: t.reshape(batch, seq_len, self.num_heads, -1) for name, t in zip(self.proj_sizes, groups)}
        feats = self.features(proj, x)
        if mask is not None:
            feats = {name: t if name == "q" else _mask_time(t, attention_mask) for name, t in feats.items()}
        recurrent = state is not None and seq_len <= RECURRENT_MAX_TOKENS
        o, final_state = self.scan(feats, state, recurrent)
        if cache is not None:
            write_recurrent_state(cache, self.layer_idx, final_state.float())
        o = self.out_norm(o.to(x.dtype)).reshape(batch, seq_len, -1) * self._gate(x)
        return self.out_proj(o)


def _mask_time(t: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Zero ``t [B, T, ...]`` where ``attention_mask [B, T]`` is 0 (a select, so no 0 * inf)."""
    keep = attention_mask.bool().reshape(*attention_mask.shape, *([1] * (t.dim() - 2)))
    return torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))


class DecayProjection(nn.Linear):
    """Linear map to the decay logits; ``sigmoid(bias)`` starts uniform in ``decay_init`` (near 1: long memory)."""

    def __init__(self, in_features: int, out_features: int, decay_init: Tuple[float, float] = (0.9, 0.999)):
        super().__init__(in_features, out_features, bias=True)
        self.decay_init = decay_init
        self.reset_decay_parameters()

    def reset_decay_parameters(self) -> None:
        lo, hi = self.decay_init
        init.normal_(self.weight, std=0.02)
        init.copy_(self.bias, torch.logit(torch.empty_like(self.bias).uniform_(lo, hi)))


@register_mixer("hdla", kind="causal")
class HDLAMixer(CausalLinearMixer):
    """Causal HDLA token mixer (HDLA paper appendix C.1, eq. 23-30).

    q, k, v = SiLU(linear(x)) (optionally after a short conv), k L2-normalised,
    beta = beta_range * sigmoid(linear(x)) (paper: beta in (0, 2)),
    lambda = sigmoid(linear(x)) per key channel with g = logsigmoid(.) <= 0 computed in fp32 (the op's
    domain by construction; the op takes fp32 g and beta with bf16 q, k, v),
    S_t = (I - beta k k^T) Diag(lambda) (I - beta k k^T) S_{t-1} + k v^T, y_t = S_t^T q_t (no scale),
    o_t = W_o (RMSNorm(y_t) * act(W_g x_t)).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, beta_range: float = 2.0,
                 decay_init: Tuple[float, float] = (0.9, 0.999), **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)
        self.beta_range = beta_range
        self.beta_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.decay_proj = DecayProjection(hidden_size, num_heads * head_dim, decay_init)

    def projection_sizes(self):
        return {"q": self.head_dim, "k": self.head_dim, "v": self.head_dim_v}

    def features(self, proj, x):
        batch, seq_len = x.shape[:2]
        g = F.logsigmoid(self.decay_proj(x).float()).reshape(batch, seq_len, self.num_heads, self.head_dim)
        beta = self.beta_range * torch.sigmoid(self.beta_proj(x).float())
        k = F.normalize(proj["k"].float(), dim=-1).to(proj["k"].dtype)
        return {"q": proj["q"], "k": k, "v": proj["v"], "beta": beta.to(k.dtype), "g": g}

    def scan(self, feats, state, recurrent):
        q, k, v, beta, g = (feats[n] for n in ("q", "k", "v", "beta", "g"))
        # g stays fp32 (a bf16 log-decay would lose the small values that encode long memory)
        if recurrent:
            return fused_recurrent_hdla(q, k, v, beta, g, initial_state=state)
        init = None if state is None else state.to(q.dtype)
        if _chunk_backend == "torch":
            a, b = hdla_decay_factors(k, beta, g)
            return _chunk_generalized(q, k.unsqueeze(-2), v.unsqueeze(-2), a, b, g, None, init)
        return chunk_hdla(q, k, v, beta, g, initial_state=init, output_final_state=True)


class GeneralizedCausalMixer(CausalLinearMixer):
    """A mixer whose ``features`` are already the generalized step of ``chunk_generalized``.

    ``features`` returns ``q [B, T, H, K]``, ``k [B, T, H, r_kv, K]``, ``v [B, T, H, r_kv, V]``,
    ``a, b [B, T, H, r_ab, K]`` and ``g`` (fp32): ``[B, T, H, K]`` per key channel or ``[B, T, H]`` per
    head, as ``chunk_generalized`` takes it; so the padding mask of
    :meth:`CausalLinearMixer.forward` zeroes ``k, v, a, b, g`` of pad tokens: ``S_t = I S_{t-1}``, no write.
    Prefill runs the chunk op with the cached state as initial state; up to ``RECURRENT_MAX_TOKENS``
    decoding tokens run the decoding op ``fused_recurrent_generalized`` on the fp32 cached state, with
    the same inputs as the chunk op (k, v, a, b in q's dtype, g fp32). Output ``scale * S_t^T q_t`` with
    ``scale = K^-1/2`` (fla).
    """

    def scan(self, feats, state, recurrent):
        q, k, v, a, b, g = (feats[n] for n in ("q", "k", "v", "a", "b", "g"))
        scale = self.head_dim ** -0.5
        dt = q.dtype
        k, v, a, b = k.to(dt), v.to(dt), a.to(dt), b.to(dt)
        if recurrent:
            return fused_recurrent_generalized(q, k, v, a, b, g, scale, state, output_final_state=True)
        init = None if state is None else state.to(q.dtype)
        return _chunk_generalized(q, k, v, a, b, g, scale, init)


class ScalarGateMixin:
    """Mamba-2's per-head gate ``log alpha = -exp(A_log) softplus(w_a x + dt_bias)`` ``[B, T, H]`` (fp32)."""

    def build_scalar_gate(self, hidden_size: int, num_heads: int) -> None:
        self.alpha_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(num_heads))

    def reset_decay_parameters(self) -> None:
        """A ~ U[1, 16], softplus(dt_bias) log-uniform in [1e-3, 1e-1] (Mamba-2 / fla init)."""
        init.copy_(self.A_log, torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        init.copy_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def log_alpha(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]``, ``<= 0`` by construction (-exp(.) * softplus(.)): inside the ops' domain."""
        dt = F.softplus(self.alpha_proj(x).float() + self.dt_bias.float())
        return -self.A_log.float().exp() * dt


class GatedDeltaMixer(ScalarGateMixin, GeneralizedCausalMixer):
    """Gated DeltaNet / DeltaProduct family (Yang et al. 2025; Siems et al. 2025) on ``chunk_generalized``.

    Per token: a scalar gate ``alpha = exp(-exp(A_log) softplus(w_a x + dt_bias))`` per head (Mamba-2
    style), then ``num_householder`` delta-rule sub-steps ``S <- (I - b_j k_j k_j^T) S + b_j k_j v_j^T``
    with q, k_j L2-normalised and ``b_j = beta_range * sigmoid(.)``. Output ``scale * S_t^T q_t`` with
    ``scale = K^-1/2`` as in fla. The sub-steps merge into one step of the generalized recurrence
    (see :func:`gated_deltaproduct_factors`).
    """

    num_householder = 1

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, beta_range: float = 1.0, **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)
        self.beta_range = beta_range
        self.beta_proj = nn.Linear(hidden_size, num_heads * self.num_householder, bias=False)
        self.build_scalar_gate(hidden_size, num_heads)

    def projection_sizes(self):
        n = self.num_householder
        return {"q": self.head_dim, "k": n * self.head_dim, "v": n * self.head_dim_v}

    def features(self, proj, x):
        batch, seq_len = x.shape[:2]
        n, heads = self.num_householder, self.num_heads
        g = self.log_alpha(x)  # [B, T, H]: one log-decay per head, as chunk_generalized takes it
        beta = self.beta_range * torch.sigmoid(self.beta_proj(x).float()).reshape(batch, seq_len, heads, n)
        q = F.normalize(proj["q"].float(), dim=-1).to(proj["q"].dtype)
        k = F.normalize(proj["k"].float().reshape(batch, seq_len, heads, n, self.head_dim), dim=-1)
        v = proj["v"].float().reshape(batch, seq_len, heads, n, self.head_dim_v)
        a, b, kw, vw = gated_deltaproduct_factors(k, v, beta, g)
        return {"q": q, "k": kw, "v": vw, "a": a, "b": b, "g": g}


@register_mixer("gated_deltanet", kind="causal")
class GatedDeltaNetMixer(GatedDeltaMixer):
    """Gated DeltaNet: ``S_t = alpha_t (I - b k k^T) S_{t-1} + b k v^T`` (r_ab = r_kv = 1)."""

    num_householder = 1


@register_mixer("gated_deltaproduct", kind="causal")
class GatedDeltaProductMixer(GatedDeltaMixer):
    """Gated DeltaProduct with ``num_householder`` (n_h, default 2) sub-steps per token (rank n_h)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_householder: int = 2, **kwargs):
        if not isinstance(num_householder, int) or num_householder < 1:
            raise ValueError(f"num_householder must be an int >= 1, got {num_householder!r}")
        self.num_householder = num_householder
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)


class LowRankProjection(nn.Sequential):
    """``x -> (x U) V``, ``U`` in_features x rank and ``V`` rank x out_features, no bias (the authors'
    gate and decay projections). With transformers' normal(0, 0.02) init the output is near 0."""

    def __init__(self, in_features: int, rank: int, out_features: int):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        super().__init__(nn.Linear(in_features, rank, bias=False), nn.Linear(rank, out_features, bias=False))


class AllHeadsRMSNorm(nn.Module):
    """One RMSNorm over all heads' features of ``[..., H, V]`` (weight of size H * V), shape kept."""

    def __init__(self, num_heads: int, head_dim_v: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim_v))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1).float()
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return flat.reshape(x.shape).to(x.dtype)


@register_mixer("hdla_authors", kind="causal")
class AuthorsHDLAMixer(HDLAMixer):
    """HDLA as the authors' layer builds it, beside :class:`HDLAMixer`'s deliberate choices.

    Same recurrence (eq. 27-28, beta in (0, beta_range)); it differs in three places:
      * decay: ``lambda = sigmoid(x U_l V_l)`` from a bias-free rank-``decay_rank`` projection, so
        lambda is about 0.5 at init (HDLAMixer: full rank with a bias starting lambda in (0.9, 0.999));
      * output: ``o = W_o RMSNorm_all(y * act(x U_g V_g))``: a rank-``gate_rank`` gate (``gate_act``,
        the authors use sigmoid) multiplies y *before* one RMSNorm over all heads' features
        (HDLAMixer: per-head RMSNorm, then a full-rank gate);
      * no short convolution is implied by the name: set ``short_conv_size=0`` (HDLAConfig) for that.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, decay_rank: int = 16, gate_rank: int = 16,
                 **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)
        self.decay_rank, self.gate_rank = decay_rank, gate_rank
        self.decay_proj = LowRankProjection(hidden_size, decay_rank, num_heads * head_dim)
        self.gate_proj = LowRankProjection(hidden_size, gate_rank, num_heads * self.head_dim_v)
        self.out_norm = AllHeadsRMSNorm(num_heads, self.head_dim_v, kwargs.get("norm_eps", 1e-6))

    def features(self, proj, x):
        """HDLAMixer's features plus ``out_gate [B, T, H, V]``, applied to y inside :meth:`scan`."""
        feats = super().features(proj, x)
        gate = super()._gate(x)
        feats["out_gate"] = gate.reshape(*x.shape[:2], self.num_heads, self.head_dim_v)
        return feats

    def scan(self, feats, state, recurrent):
        """HDLAMixer's scan, then ``y * gate`` (the all-heads norm follows in ``forward``)."""
        o, final_state = super().scan(feats, state, recurrent)
        return o * feats["out_gate"].to(o.dtype), final_state

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        """The gate already multiplied y before the norm: nothing is left to multiply after it."""
        return torch.ones((), dtype=x.dtype, device=x.device)
