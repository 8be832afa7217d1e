"""The seed mixers on ``chunk_generalized``, bidirectional for vision and causal for the LM.

Each mixer is the shared block of :mod:`hdla_vision.layers.mixer` with its activations, its gate
modules per scan direction (:mod:`hdla_vision.layers.gates`) and the factor function of
:mod:`hdla_vision.layers.seed_mixers` that turns them into the generalized op's ``(k, v, a, b, g)``:

    S_t = (Diag(exp g_t) - A_t B_t^T) S_{t-1} + K_t V_t^T,      y_t = scale * S_t^T q_t

with ``scale = K^-1/2`` (fla's default) before the per-head RMS norm. Activations and gates, from
each paper (no short convolution in the vision use: the backbone has a position embedding; the LM
may add one with ``short_conv_size``):

- GLA: q, k, v linear; ``g = logsigmoid(x U V + b) / 16`` per key channel; no delta term.
- DeltaNet, Gated DeltaNet, Gated DeltaProduct, KDA, Head-in-Head: q, k, v after SiLU, q and k
  L2-normalised, ``beta = beta_range * sigmoid(.)`` (``beta_range`` 1, and 2 for Gated DeltaProduct,
  whose paper allows negative eigenvalues). Scalar gates are Mamba-2's
  ``alpha = exp(-exp(A_log) softplus(x w + dt_bias))``; KDA's per-channel gate is GLA's low-rank form
  with logsigmoid.
- RWKV-7: r (= q), k, v linear; ``w = exp(-e^{-1/2} sigmoid(.))``, in-context rate ``a = sigmoid(.)``,
  ``kappa_hat = normalize(k * k_k)``, replacement key ``k * (1 + (a - 1) k_a)``. Token shift, the
  bonus term and the group norm of RWKV-7 are replaced by the shared output norm and gate.
The per-channel decays are low rank (rank ``decay_rank``, 16 by default, as fla's GLA and RWKV-7)
with a bias that starts at multi-timescale memory lengths in [``min_memory``, ``max_memory``].

Decays that are one scalar per head (DeltaNet, Gated DeltaNet, Gated DeltaProduct, Head-in-Head)
reach the ops as ``g [B, N, H]``, per-channel ones as ``g [B, N, H, K]``.
"""
from typing import Optional

import torch
import torch.nn as nn

from hdla_vision.kernels import (chunk_delta_substeps, chunk_generalized, chunk_generalized_bidirectional,
                                 chunk_loglinear_generalized, fused_recurrent_generalized,
                                 fused_recurrent_loglinear_generalized, on_delta_rule, torch_chunk_generalized)

from . import seed_mixers as sm
from .gates import (BetaGate, HeadInHeadMask, RWKV7Gates, ScalarLogDecay, VectorLogDecay, at_least_fp32,
                    check_memory_range, check_rank)
from .mixer import LinearAttentionMixer, activation_recompute, check_positive_int, chunk_backend
from .registry import register_mixer


def once_per_object(groups: list, convert) -> list:
    """``[convert(*group) for group in groups]``, computed once per distinct group of tensor objects (by
    identity, ``is``: a tensor that fills two fields is converted once, so the op saves it once). Not
    ``id()``: torch.compile cannot trace the id of a tensor made inside a traced region."""
    done, out = [], []
    for group in groups:
        match = None
        for seen, result in done:
            if len(seen) == len(group) and all(a is b for a, b in zip(seen, group)):
                match = result
        if match is None:
            match = convert(*group)
            done.append((group, match))
        out.append(match)
    return out


class GeneralizedMixer(LinearAttentionMixer):
    """A mixer whose ``features`` are one step of the generalized recurrence
    (:class:`~hdla_vision.layers.seed_mixers.GeneralizedStep`).

    Subclasses set ``mixer_name``, ``qkv_activation`` and ``normalize_q`` and implement ``make_gates``
    and ``features``. The ops get k, v, a, b in q's dtype and g as the gates give it (fp32 or wider).
    ``shared_fields`` names the step's fields that do not depend on the gates, equal in both scan
    directions: the bidirectional op reads them once (the others, and g, are stacked by direction).
    """

    normalize_q = True
    shared_fields = ("v",)  # v = the projection's values in every seed mixer
    # whether HDLA_VISION_KERNELS=auto (the default) scans on the delta rule's op (delta_route) for 16-bit inputs of
    # enough sequences (kernels.ops.DELTA_DEFAULT_MIN_PROGRAMS): set for the mixers with one decay per head, where it
    # was faster than chunk_generalized in every measured use (H200, bf16, fwd+bwd of the op,
    # benchmarks/results/delta_routes_h200: DeltaNet 12.1 -> 5.3 ms at (4, 4096, 16, 128), 3.3 -> 2.2 at
    # (128, 196, 3, 64); Gated DeltaNet 9.3 -> 5.3 and 3.5 -> 2.2; Gated DeltaProduct n_h = 2 18.2 -> 11.4 and
    # 4.5 -> 2.1), and for KDA (2.96 -> 2.27 at the vision shape; at the LM shape its route took 12.6 against 12.3
    # with kernels summing to 11.8 ms, and stage 5 of the kernels, benchmarks/README.md, took them to 8.3 ms); GLA
    # (4.8 on chunk_generalized against 12.3: rank 0 has no inverse to pay for) stays there
    delta_by_default = False

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def kernel_inputs(self, q: torch.Tensor, step: sm.GeneralizedStep):
        """k, v, a, b of ``step`` in q's dtype, contiguous (the ops' layout); a tensor that fills two of
        them (KDA's and DeltaNet's ``beta k`` is both k and a) is converted once, so the op saves it once."""
        return tuple(once_per_object([(t,) for t in (step.k, step.v, step.a, step.b)],
                                     lambda t: t.to(q.dtype).contiguous()))

    def delta_route(self, q: torch.Tensor) -> bool:
        """Whether a mixer whose step is a product of delta steps (GLA, DeltaNet, Gated DeltaNet / DeltaProduct,
        KDA: their :meth:`features` give :class:`~hdla_vision.layers.seed_mixers.DeltaSteps` then) scans on the
        delta rule's op (``chunk_delta_substeps``, kernels/README.md §12): under ``HDLA_VISION_KERNELS=delta``, and
        under ``auto`` (the default) where :attr:`delta_by_default`; where its kernels run q, not log-linear, not
        under :func:`set_chunk_backend` ``("torch")``."""
        return on_delta_rule(q, self.delta_by_default) and not self.log_linear and chunk_backend() != "torch"

    def op_inputs(self, q, feats):
        if isinstance(feats, sm.DeltaSteps):
            return feats
        return sm.GeneralizedStep(*self.kernel_inputs(q, feats), feats.g.contiguous())

    def scan(self, q, feats, reverse=False, initial_state=None, output_final_state=False, recurrent=False):
        if isinstance(feats, sm.DeltaSteps):
            if not recurrent:
                return chunk_delta_substeps(q, *feats, scale=self.scale, initial_state=initial_state,
                                            output_final_state=output_final_state, reverse=reverse,
                                            recompute=activation_recompute())
            feats = sm.generalized_step(feats)  # decoding: the generalized recurrence's step
        k, v, a, b = self.kernel_inputs(q, feats)
        g = feats.g.contiguous()
        if recurrent:
            return fused_recurrent_generalized(q, k, v, a, b, g, self.scale, initial_state, output_final_state=True)
        init = None if initial_state is None else initial_state.to(q.dtype)
        op = torch_chunk_generalized if chunk_backend() == "torch" else chunk_generalized
        return op(q, k, v, a, b, g, scale=self.scale, initial_state=init, output_final_state=output_final_state,
                  reverse=reverse)

    def loglinear_scan(self, q, feats, level_scales, offset=0, initial_state=None, output_final_state=False,
                       recurrent=False):
        k, v, a, b = self.kernel_inputs(q, feats)
        g = feats.g.contiguous()
        if recurrent:
            return fused_recurrent_loglinear_generalized(q, k, v, a, b, g, level_scales, self.scale, initial_state,
                                                         offset=offset)
        init = None if initial_state is None else initial_state.to(q.dtype)
        return chunk_loglinear_generalized(q, k, v, a, b, g, level_scales, scale=self.scale, initial_state=init,
                                           output_final_state=output_final_state, offset=offset)

    def own_write(self, q, feats):
        if isinstance(feats, sm.DeltaSteps):
            feats = sm.generalized_step(feats)
        k, v, _, _ = self.kernel_inputs(q, feats)
        return self.scale * ((q.unsqueeze(-2) * k).sum(-1, keepdim=True) * v).sum(-2)

    def bidirectional_scan(self, q, fwd, bwd):
        """:meth:`two_scans` as one ``chunk_generalized_bidirectional``: the ``shared_fields`` once (the
        forward step's), the other fields and g stacked ``[2, ...]`` (forward, reversed); a tensor that
        fills two fields in both directions (:meth:`kernel_inputs`) is stacked once."""
        if chunk_backend() == "torch" or isinstance(fwd, sm.DeltaSteps):
            return self.two_scans(q, fwd, bwd)
        names = ("k", "v", "a", "b")
        pairs = [(x_fwd,) if name in self.shared_fields else (x_fwd, x_bwd)
                 for name, x_fwd, x_bwd in zip(names, fwd[:4], bwd[:4])]

        def op_input(*pair):  # a shared field once, the others stacked [2, ...] by direction
            return pair[0].to(q.dtype).contiguous() if len(pair) == 1 else torch.stack([x.to(q.dtype) for x in pair])

        inputs = dict(zip(names, once_per_object(pairs, op_input)))  # KDA's and DeltaNet's beta k: k and a
        g = torch.stack([fwd.g, bwd.g])
        return chunk_generalized_bidirectional(q, **inputs, g=g, scale=self.scale)[0]


class _DecayOptions:
    """Keyword arguments of the mixers with a per-channel decay: ``decay_rank``, ``min_memory``, ``max_memory``."""

    def configure(self, decay_rank: int = 16, min_memory: float = 2.0, max_memory: float = 256.0, **options):
        check_rank("decay_rank", decay_rank)
        check_memory_range(min_memory, max_memory)
        self.decay_rank, self.min_memory, self.max_memory = decay_rank, min_memory, max_memory
        super().configure(**options)

    def vector_decay(self, tau: float) -> VectorLogDecay:
        return VectorLogDecay(self.dim, self.num_heads, self.head_dim, self.decay_rank, tau, self.min_memory,
                              self.max_memory, **self.factory_kwargs)


@register_mixer("gla")
class GLAMixer(_DecayOptions, GeneralizedMixer):
    """GLA (Yang et al. 2024): ``S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T``, ``alpha = sigmoid(.)^(1/16)``
    (GLA's tau = 16)."""

    mixer_name, qkv_activation, normalize_q = "gla", "identity", False
    shared_fields = ("k", "v", "a", "b")  # the gates reach only g

    def make_gates(self):
        return nn.ModuleDict({"decay": self.vector_decay(tau=16.0)})

    def features(self, x, q, k, v, gates):
        factors = sm.gla_steps if self.delta_route(q) else sm.gla_factors
        return factors(k[..., 0, :], v[..., 0, :], gates["decay"](x))


@register_mixer("deltanet")
class DeltaNetMixer(GeneralizedMixer):
    """DeltaNet: ``S_t = (I - beta k k^T) S_{t-1} + beta k v^T``, ``beta = sigmoid(.)``."""

    mixer_name = "deltanet"
    shared_fields = ("v", "b")  # B = k
    delta_by_default = True

    def make_gates(self):
        return nn.ModuleDict({"beta": BetaGate(self.dim, self.num_heads, **self.factory_kwargs)})

    def features(self, x, q, k, v, gates):
        factors = sm.deltanet_steps if self.delta_route(q) else sm.deltanet_factors
        return factors(k[..., 0, :], v[..., 0, :], gates["beta"](x)[..., 0])


class _GatedDelta(GeneralizedMixer):
    """Gated DeltaNet / DeltaProduct (Yang et al. 2025; Siems et al. 2025): per token ``S <- alpha S`` with
    Mamba-2's scalar gate per head, then ``num_keys`` delta-rule sub-steps ``S <- (I - b k k^T) S + b k v^T``
    with ``b = beta_range * sigmoid(.)``, merged into one generalized step
    (:func:`~hdla_vision.layers.seed_mixers.gated_deltaproduct_factors`)."""

    default_beta_range = 1.0
    delta_by_default = True

    def configure(self, beta_range: Optional[float] = None, **options):
        self.beta_range = self.default_beta_range if beta_range is None else beta_range
        super().configure(**options)

    def make_gates(self):
        dd = self.factory_kwargs
        return nn.ModuleDict({
            "beta": BetaGate(self.dim, self.num_heads, self.num_keys, self.beta_range, **dd),
            "alpha": ScalarLogDecay(self.dim, self.num_heads, **dd),
        })

    def features(self, x, q, k, v, gates):
        if self.delta_route(q):  # the sub-steps as they are: the kernels read k, v in their own dtype
            return sm.gated_deltaproduct_steps(k, v, gates["beta"](x), gates["alpha"](x))
        return sm.gated_deltaproduct_factors_5d(at_least_fp32(k), at_least_fp32(v), gates["beta"](x), gates["alpha"](x))


@register_mixer("gated_deltanet")
class GatedDeltaNetMixer(_GatedDelta):
    """Gated DeltaNet: ``S_t = alpha (I - beta k k^T) S_{t-1} + beta k v^T``, beta in (0, ``beta_range`` = 1)."""

    mixer_name = "gated_deltanet"


@register_mixer("gated_deltaproduct")
class GatedDeltaProductMixer(_GatedDelta):
    """Gated DeltaProduct with ``num_householder`` (n_h, default 2) sub-steps per token (rank n_h), beta in
    (0, ``beta_range`` = 2): the paper's negative eigenvalues."""

    mixer_name, default_beta_range = "gated_deltaproduct", 2.0

    def configure(self, num_householder: int = 2, **options):
        check_positive_int("num_householder", num_householder)
        self.num_householder = self.num_keys = num_householder
        super().configure(**options)


@register_mixer("kda")
class KDAMixer(_DecayOptions, GeneralizedMixer):
    """KDA: ``S_t = (I - beta k k^T) Diag(alpha_t) S_{t-1} + beta k v^T`` (per-channel alpha)."""

    mixer_name = "kda"
    delta_by_default = True

    def make_gates(self):
        return nn.ModuleDict({"beta": BetaGate(self.dim, self.num_heads, **self.factory_kwargs),
                              "decay": self.vector_decay(tau=1.0)})

    def features(self, x, q, k, v, gates):
        factors = sm.kda_steps if self.delta_route(q) else sm.kda_factors
        return factors(k[..., 0, :], v[..., 0, :], gates["beta"](x)[..., 0], gates["decay"](x))


@register_mixer("rwkv7")
class RWKV7Mixer(_DecayOptions, GeneralizedMixer):
    """RWKV-7: ``S_t = (Diag(w_t) - (a * kappa_hat) kappa_hat^T) S_{t-1} + k~ v^T`` (state = wkv^T)."""

    mixer_name, qkv_activation, normalize_q = "rwkv7", "identity", False

    def make_gates(self):
        return nn.ModuleDict({"rwkv": RWKV7Gates(self.dim, self.num_heads, self.head_dim, self.decay_rank,
                                                 self.min_memory, self.max_memory, **self.factory_kwargs)})

    def features(self, x, q, k, v, gates):
        p = gates["rwkv"](x, k[..., 0, :])
        return sm.rwkv7_factors(p["k"], v[..., 0, :], p["kappa_hat"], p["a"], p["log_w"])


class _HeadInHead(GeneralizedMixer):
    """Head-in-Head (Gated) DeltaNet: ``S_t = alpha (I - beta (k k^T) o M) S_{t-1} + beta k v^T``.

    Own arguments: ``groups`` r (default 4, must divide the head dim), ``mask`` "static" (learnable
    ``M_org`` per head, the paper's MAD / MQAR setting) or "data" (from the input by a linear map).
    """

    gated = False

    def configure(self, groups: int = 4, mask: str = "static", **options):
        if not isinstance(groups, int) or groups < 1 or self.head_dim % groups:
            raise ValueError(f"groups must be a positive int dividing the head dim {self.head_dim}, got {groups!r}")
        if mask not in ("static", "data"):
            raise ValueError(f"mask must be 'static' or 'data', got {mask!r}")
        self.groups, self.mask_kind = groups, mask
        super().configure(**options)

    def make_gates(self):
        dd = self.factory_kwargs
        gates = {"beta": BetaGate(self.dim, self.num_heads, **dd),
                 "mask": HeadInHeadMask(self.dim, self.num_heads, self.groups, self.mask_kind == "data", **dd)}
        if self.gated:
            gates["alpha"] = ScalarLogDecay(self.dim, self.num_heads, **dd)
        return nn.ModuleDict(gates)

    def features(self, x, q, k, v, gates):
        log_alpha = gates["alpha"](x) if self.gated else None
        beta = gates["beta"](x)[..., 0]
        return sm.head_in_head_factors(k[..., 0, :], v[..., 0, :], beta, gates["mask"](x), log_alpha)


@register_mixer("hih_deltanet")
class HeadInHeadDeltaNetMixer(_HeadInHead):
    """Head-in-Head DeltaNet (no gate)."""

    mixer_name = "hih_deltanet"


@register_mixer("hih_gated_deltanet")
class HeadInHeadGatedDeltaNetMixer(_HeadInHead):
    """Head-in-Head Gated DeltaNet (Mamba-2 scalar gate ``alpha`` per head)."""

    gated, mixer_name = True, "hih_gated_deltanet"
