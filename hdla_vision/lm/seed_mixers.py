"""Causal seed mixers for the language models: GLA, DeltaNet, KDA, RWKV-7 and Head-in-Head (Gated) DeltaNet.

Each is a :class:`~hdla_vision.lm.mixers.GeneralizedCausalMixer`: the shared block (in-projection,
optional short causal conv, per-head output RMSNorm, output gate, output projection) with
``features`` mapping the mixer's per-token gates to ``chunk_generalized``'s ``(k, v, a, b, g)``
through the factor functions of :mod:`hdla_vision.layers.seed_mixers`. Padding, the cache and
decoding are those of the shared block (see :mod:`hdla_vision.lm.mixers`).

Activations follow the bidirectional versions (:mod:`hdla_vision.layers.seed_vision`):
- GLA: q, k, v linear; ``g = logsigmoid(linear(x)) / 16`` per key channel.
- DeltaNet, KDA, Head-in-Head: q, k, v after SiLU, q and k L2-normalised, ``beta = sigmoid(.)``;
  KDA's per-channel ``g = logsigmoid(linear(x))``; the gated Head-in-Head variant uses Mamba-2's
  scalar gate (as Gated DeltaNet does).
- RWKV-7: r (= q), k, v linear; ``w = exp(-e^{-1/2} sigmoid(.))``, ``a = sigmoid(.)``,
  ``kappa_hat = normalize(k * k_k)``, replacement key ``k * (1 + (a - 1) k_a)``. Token shift, the
  bonus term and the group norm are replaced by the shared short conv, output norm and gate.
The decay projections are full-rank linears (fla's GLA and RWKV-7 use a rank-16 bottleneck).
Every log-decay above (logsigmoid, ``-e^{-1/2} sigmoid``, Mamba-2's ``-exp(.) softplus(.)``) is
``<= 0`` by construction, inside the ops' domain, and is kept in fp32 (the ops accept fp32 g with
q, k, v, a, b in the model's dtype).
"""
import math
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init

from ..layers import seed_mixers as sm
from ..layers.registry import register_mixer
from .mixers import DecayProjection, GeneralizedCausalMixer, ScalarGateMixin

RWKV7_W_SCALE = math.exp(-0.5)  # RWKV-7: w = exp(-e^-0.5 sigmoid(.)), so w in [0.545, 1]


def _step_features(q: torch.Tensor, step: sm.GeneralizedStep) -> dict:
    """The generalized step as the feature dict of :class:`GeneralizedCausalMixer` (g in fp32)."""
    return {"q": q, "k": step.k, "v": step.v, "a": step.a, "b": step.b, "g": step.g.float()}


def _l2(t: torch.Tensor) -> torch.Tensor:
    return F.normalize(t.float(), dim=-1).to(t.dtype)


class _QKVMixer(GeneralizedCausalMixer):
    """q, k ``[B, T, H, K]`` and v ``[B, T, H, V]`` from the in-projection."""

    def projection_sizes(self):
        return {"q": self.head_dim, "k": self.head_dim, "v": self.head_dim_v}

    def _heads(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """A per-head linear output ``[B, T, H * D] -> [B, T, H, D]``."""
        return t.reshape(*x.shape[:2], self.num_heads, -1)


class _DeltaRuleMixer(_QKVMixer):
    """SiLU q, k, v with L2-normalised q, k and a per-head ``beta = sigmoid(linear(x))``."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)
        self.beta_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def delta_inputs(self, proj, x) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (unit rows), v and beta ``[B, T, H]`` (fp32)."""
        return _l2(proj["q"]), _l2(proj["k"]), proj["v"], torch.sigmoid(self.beta_proj(x).float())


@register_mixer("gla", kind="causal")
class GLAMixer(_QKVMixer):
    """GLA (Yang et al. 2024): ``S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T``, ``log alpha = logsigmoid(.) / 16``.

    ``decay_init`` is the range of ``alpha`` at init (the bias is set for ``sigmoid = alpha^16``).
    """

    projection_activation = "identity"
    gate_logit_normalizer = 16.0

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int,
                 decay_init: Tuple[float, float] = (0.9, 0.999), **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)
        tau = self.gate_logit_normalizer
        self.decay_proj = DecayProjection(hidden_size, num_heads * head_dim, (decay_init[0] ** tau, decay_init[1] ** tau))

    def features(self, proj, x):
        g = self._heads(x, F.logsigmoid(self.decay_proj(x).float()) / self.gate_logit_normalizer)
        step = sm.gla_factors(proj["k"].float(), proj["v"], g)
        return _step_features(proj["q"], step)


@register_mixer("deltanet", kind="causal")
class DeltaNetMixer(_DeltaRuleMixer):
    """DeltaNet: ``S_t = (I - beta k k^T) S_{t-1} + beta k v^T``."""

    def features(self, proj, x):
        q, k, v, beta = self.delta_inputs(proj, x)
        return _step_features(q, sm.deltanet_factors(k.float(), v, beta))


@register_mixer("kda", kind="causal")
class KDAMixer(_DeltaRuleMixer):
    """KDA: ``S_t = (I - beta k k^T) Diag(alpha_t) S_{t-1} + beta k v^T``, ``log alpha = logsigmoid(.)`` per channel."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int,
                 decay_init: Tuple[float, float] = (0.9, 0.999), **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)
        self.decay_proj = DecayProjection(hidden_size, num_heads * head_dim, decay_init)

    def features(self, proj, x):
        q, k, v, beta = self.delta_inputs(proj, x)
        g = self._heads(x, F.logsigmoid(self.decay_proj(x).float()))
        return _step_features(q, sm.kda_factors(k.float(), v, beta, g))


@register_mixer("rwkv7", kind="causal")
class RWKV7Mixer(_QKVMixer):
    """RWKV-7: ``S_t = (Diag(w_t) - (a_t * kappa_hat) kappa_hat^T) S_{t-1} + k~_t v_t^T`` (state = wkv^T).

    ``decay_init`` is the range of ``w`` at init.
    """

    projection_activation = "identity"

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int,
                 decay_init: Tuple[float, float] = (0.9, 0.999), **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)
        # w = exp(-e^-1/2 s) with s = sigmoid(logit): s = -log(w) / e^-1/2
        s_range = tuple(-math.log(w) / RWKV7_W_SCALE for w in reversed(decay_init))
        self.decay_proj = DecayProjection(hidden_size, num_heads * head_dim, s_range)
        self.icl_proj = nn.Linear(hidden_size, num_heads * head_dim)
        self.k_k = nn.Parameter(torch.full((num_heads, head_dim), 0.85))
        self.k_a = nn.Parameter(torch.ones(num_heads, head_dim))

    def reset_decay_parameters(self) -> None:
        """RWKV-7's key mixing starts at ``k_k = 0.85``, ``k_a = 1``; the in-context rate at ``sigmoid(0) = 1/2``."""
        init.constant_(self.k_k, 0.85)
        init.constant_(self.k_a, 1.0)
        init.zeros_(self.icl_proj.bias)

    def features(self, proj, x):
        k = proj["k"].float()
        log_w = self._heads(x, -RWKV7_W_SCALE * torch.sigmoid(self.decay_proj(x).float()))
        icl_rate = self._heads(x, torch.sigmoid(self.icl_proj(x).float()))
        kappa_hat = F.normalize(k * self.k_k.float(), dim=-1)
        replacement_key = k * (1 + (icl_rate - 1) * self.k_a.float())
        return _step_features(proj["q"], sm.rwkv7_factors(replacement_key, proj["v"], kappa_hat, icl_rate, log_w))


class _HeadInHeadMixer(_DeltaRuleMixer):
    """Head-in-Head (Gated) DeltaNet: ``S_t = alpha (I - beta (k k^T) o M) S_{t-1} + beta k v^T``.

    ``M = M_org M_org^T`` with ``M_org = normalize(softplus(logits))`` (the paper's section 3.3) over
    ``groups`` r equal feature groups of each head's keys (r must divide head_dim). ``mask``:
    ``"static"`` (learnable logits ``[H, r, r]``) or ``"data"`` (``linear(x) -> [B, T, H, r, r]``).
    """

    gated = False  # True: also a ScalarGateMixin (listed after this class, so the reset below chains to it)

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, groups: int = 4, mask: str = "static",
                 **kwargs):
        if not isinstance(groups, int) or groups < 1 or head_dim % groups:
            raise ValueError(f"groups must be a positive int dividing head_dim={head_dim}, got {groups!r}")
        if mask not in ("static", "data"):
            raise ValueError(f"mask must be 'static' or 'data', got {mask!r}")
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)
        self.groups, self.mask_kind = groups, mask
        if mask == "data":
            self.mask_proj = nn.Linear(hidden_size, num_heads * groups * groups)
        else:
            self.mask_logits = nn.Parameter(torch.zeros(num_heads, groups, groups))
        if self.gated:
            self.build_scalar_gate(hidden_size, num_heads)

    def reset_decay_parameters(self) -> None:
        """A random positive ``M_org`` at init (section 3.3); the scalar gate as Gated DeltaNet's."""
        init.normal_(self.mask_proj.bias if self.mask_kind == "data" else self.mask_logits)
        if self.gated:
            super().reset_decay_parameters()

    def mask_org(self, x: torch.Tensor) -> torch.Tensor:
        """``[H, r, r]`` (static) or ``[B, T, H, r, r]`` (data-dependent), fp32."""
        if self.mask_kind == "static":
            return sm.head_in_head_mask(self.mask_logits.float())
        r = self.groups
        return sm.head_in_head_mask(self.mask_proj(x).float().reshape(*x.shape[:2], self.num_heads, r, r))

    def features(self, proj, x):
        q, k, v, beta = self.delta_inputs(proj, x)
        log_alpha = self.log_alpha(x) if self.gated else None
        return _step_features(q, sm.head_in_head_factors(k.float(), v, beta, self.mask_org(x), log_alpha))


@register_mixer("hih_deltanet", kind="causal")
class HeadInHeadDeltaNetMixer(_HeadInHeadMixer):
    """Head-in-Head DeltaNet (no gate)."""


@register_mixer("hih_gated_deltanet", kind="causal")
class HeadInHeadGatedDeltaNetMixer(_HeadInHeadMixer, ScalarGateMixin):
    """Head-in-Head Gated DeltaNet (Mamba-2 scalar gate ``alpha`` per head)."""

    gated = True
