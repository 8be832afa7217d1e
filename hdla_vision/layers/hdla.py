"""The HDLA token mixer (HDLA paper, appendix C.1, eq. 23-30), bidirectional for vision and causal for the LM.

Per head (key dim K, value dim V), for each scan direction ``d`` (one for the causal use, two for
vision, see :mod:`hdla_vision.layers.mixer`):

    q, k, v = SiLU(x W_q), SiLU(x W_k), SiLU(x W_v)          (shared by the directions)
    k       = k / ||k||_2
    lambda  = sigmoid(x U_d V_d + b_d)   per key channel (low rank, :class:`~hdla_vision.layers.gates.VectorLogDecay`)
    beta    = beta_range * sigmoid(x W_beta_d + c_d)          (paper: beta in (0, 2))
    S_t     = (I - beta k k^T) Diag(lambda) (I - beta k k^T) S_{t-1} + k v^T    (eq. 27)
    y^d_t   = S_t^T q_t                                                        (eq. 28, no scale)

Both scans of the bidirectional use contain the same own write ``(q_t . k_t) v_t`` (the write does
not depend on the gates), subtracted once; both run as one ``chunk_hdla_bidirectional`` (q, k, v
shared, beta and g stacked by direction). The output is the shared block's
``W_o (RMSNorm_head(y) * SiLU(x W_g))`` (eq. 29-30 with a per-head norm and a swish gate).

The bidirectional prologue runs fused (:meth:`HDLAMixer.mix`): one GEMM for q, k, v and both
directions' beta logits, one for both directions' low-rank decay down-projections, one batched GEMM for
their up-projections, and one kernel (``hdla_vision.kernels.mixer_prologue``) for SiLU, the L2 norm of k,
2 sigmoid(.) and logsigmoid, writing beta and g stacked by direction as the bidirectional op takes them.
The parameters stay in their modules (the weights are concatenated per call), so checkpoints and the
unfused definition (:meth:`~hdla_vision.layers.mixer.LinearAttentionMixer.scan_inputs`) are unchanged.

Decay initialisation: ``b_d`` starts at ``logit(1 - 1/L)`` with memory lengths L spaced
geometrically over [``min_memory``, ``max_memory``] tokens across each head's channels, so that at
initialisation some channels forget within a few tokens and others span the sequence; ``beta``
starts at ``beta_range / 2`` (1: each write replaces its key's direction).

``hdla_authors`` (:class:`AuthorsHDLAMixer`) is HDLA as the authors' layer builds it, for the MQAR
comparison: a bias-free low-rank decay (lambda about 1/2 at init), a low-rank output gate that
multiplies y *before* one RMS norm over all heads' features.
"""
from functools import partial
from typing import NamedTuple, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from hdla_vision.kernels import (chunk_hdla, chunk_hdla_bidirectional, chunk_loglinear_hdla, fused_recurrent_hdla,
                                 fused_recurrent_loglinear_hdla, hdla_decay_factors, mixer_prologue,
                                 torch_chunk_generalized)

from .gates import BetaGate, LowRankProjection, VectorLogDecay, check_rank
from .mixer import LinearAttentionMixer, chunk_backend, recompute
from .registry import register_mixer


class HDLAStep(NamedTuple):
    """One direction's inputs of the HDLA ops: k ``[B, N, H, K]`` (unit rows), v ``[B, N, H, V]``,
    beta ``[B, N, H]`` and the log-decay g ``[B, N, H, K]`` (beta and g in fp32 or wider)."""

    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    g: torch.Tensor


@register_mixer("hdla")
class HDLAMixer(LinearAttentionMixer):
    """HDLA, ``forward(x [B, N, C], attention_mask=None, cache=None) -> [B, N, C]``.

    Own arguments: ``decay_rank`` (16), rank r of each direction's lambda projection;
    ``min_memory``, ``max_memory`` (2, 256), the range of the initial decay memory lengths (tokens);
    ``beta_range`` (2.0, the paper's (0, 2)). The block's arguments are those of
    :class:`~hdla_vision.layers.mixer.LinearAttentionMixer`.
    """

    mixer_name = "hdla"
    decay_bias = True

    def configure(self, decay_rank: int = 16, min_memory: float = 2.0, max_memory: float = 256.0,
                  beta_range: float = 2.0, **options) -> None:
        check_rank("decay_rank", decay_rank)
        self.decay_rank, self.beta_range = decay_rank, beta_range
        self.min_memory, self.max_memory = min_memory, max_memory
        super().configure(**options)

    def make_gates(self) -> nn.ModuleDict:
        dd = self.factory_kwargs
        return nn.ModuleDict({
            "decay": VectorLogDecay(self.dim, self.num_heads, self.head_dim, self.decay_rank, 1.0, self.min_memory,
                                    self.max_memory, bias=self.decay_bias, **dd),
            "beta": BetaGate(self.dim, self.num_heads, beta_range=self.beta_range, **dd),
        })

    def features(self, x, q, k, v, gates) -> HDLAStep:
        return HDLAStep(k[..., 0, :], v[..., 0, :], gates["beta"](x)[..., 0], gates["decay"](x))

    def scan(self, q, feats, reverse=False, initial_state=None, output_final_state=False, recurrent=False):
        k, v, beta, g = feats
        beta = beta.contiguous()
        if recurrent:
            return fused_recurrent_hdla(q, k, v, beta, g, initial_state=initial_state)
        init = None if initial_state is None else initial_state.to(q.dtype)
        if chunk_backend() == "torch":
            a, b = hdla_decay_factors(k, beta, g)
            return torch_chunk_generalized(q, k.unsqueeze(-2), v.unsqueeze(-2), a, b, g, None, init,
                                           output_final_state, reverse)
        return chunk_hdla(q, k, v, beta, g, initial_state=init, output_final_state=output_final_state, reverse=reverse)

    def loglinear_scan(self, q, feats, level_scales, offset=0, initial_state=None, output_final_state=False,
                       recurrent=False):
        k, v, beta, g = feats
        beta = beta.contiguous()
        if recurrent:
            return fused_recurrent_loglinear_hdla(q, k, v, beta, g, level_scales, initial_state=initial_state,
                                                  offset=offset)
        init = None if initial_state is None else initial_state.to(q.dtype)
        return chunk_loglinear_hdla(q, k, v, beta, g, level_scales, initial_state=init,
                                    output_final_state=output_final_state, offset=offset)

    def own_write(self, q, feats):
        return (q * feats.k).sum(-1, keepdim=True) * feats.v

    def op_inputs(self, q, feats):
        return feats._replace(beta=feats.beta.contiguous())

    def mix(self, x, norm=None):
        """The bidirectional sum with the fused prologue (:meth:`fused_scan_inputs`, recomputed in the
        backward like the unfused one); the log-linear mixers and the ``"torch"`` chunk backend take the
        unfused definition."""
        if self.log_linear or chunk_backend() == "torch":
            return super().mix(x, norm)
        q, k, v, beta, g = recompute(partial(self.fused_scan_inputs, norm=norm), x)
        return chunk_hdla_bidirectional(q, k, v, beta, g)[0]

    def fused_scan_inputs(self, x, norm=None) -> Tuple[torch.Tensor, ...]:
        """``x [B, N, C]`` -> q, k ``[B, N, H, K]``, v ``[B, N, H, V]``, beta ``[2, B, N, H]``, g ``[2, B, N, H, K]``
        of ``norm(x)``: :meth:`scan_inputs`' values, stacked by direction, from three GEMMs and one kernel."""
        x = x if norm is None else norm(x)
        batch, seq_len, _ = x.shape
        gates = list(self.directions)
        decays = [gate["decay"] for gate in gates]
        proj = F.linear(x, *self.projection_weights())
        down = F.linear(x, torch.cat([d.logits.down.weight for d in decays]))  # [B, N, 2 r]
        down = down.view(batch * seq_len, len(gates), -1).transpose(0, 1)  # [2, B N, r]
        up = torch.stack([d.logits.up.weight.t() for d in decays])  # [2, r, H K]
        if decays[0].logits.up.bias is None:
            logits = torch.bmm(down, up)
        else:
            logits = torch.baddbmm(torch.stack([d.logits.up.bias for d in decays]).unsqueeze(1), down, up)
        return mixer_prologue(proj, logits.view(len(gates), batch, seq_len, -1), self.num_heads, self.head_dim,
                              self.head_dim_v, self.beta_range, tau=decays[0].tau, eps=self.norm_eps)

    def projection_weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The fused projection ``q | k | v | beta_fwd | beta_bwd | zero padding`` (to a multiple of 8 rows,
        so that each token's row of its output is 16-byte aligned in 16 bits): ``(weight [P, C], bias [P])``."""
        betas = [gate["beta"].proj for gate in self.directions]
        weight = torch.cat([self.qkv.weight, *(b.weight for b in betas)])
        qkv_bias = self.qkv.bias if self.qkv.bias is not None else weight.new_zeros(self.qkv.out_features)
        bias = torch.cat([qkv_bias, *(b.bias for b in betas)])
        pad = -weight.shape[0] % 8
        return torch.cat([weight, weight.new_zeros(pad, weight.shape[1])]), torch.cat([bias, bias.new_zeros(pad)])

    def bidirectional_scan(self, q, fwd, bwd):
        """:meth:`two_scans` as one ``chunk_hdla_bidirectional``: k, v shared (the projections'), beta
        and g stacked ``[2, ...]`` (forward, reversed)."""
        if chunk_backend() == "torch":
            return self.two_scans(q, fwd, bwd)
        beta = torch.stack([fwd.beta, bwd.beta])
        g = torch.stack([fwd.g, bwd.g])
        return chunk_hdla_bidirectional(q, fwd.k, fwd.v, beta, g)[0]


@register_mixer("hdla_authors")
class AuthorsHDLAMixer(HDLAMixer):
    """HDLA as the authors' layer builds it (same recurrence, eq. 27-28), beside :class:`HDLAMixer`'s choices:

    * decay: ``lambda = sigmoid(x U V)`` from a bias-free rank-``decay_rank`` projection, so lambda is
      about 1/2 at init (HDLAMixer: a bias starting at multi-timescale memory lengths);
    * output: ``o = W_o RMSNorm_all(y * act_g(x U_g V_g))``: a rank-``gate_rank`` gate (bias-free; the
      authors use ``gate_act="sigmoid"``) multiplies y *before* one RMS norm over all heads' features
      (HDLAMixer: per-head norm, then a full-rank gate).
    Own arguments: those of :class:`HDLAMixer` plus ``gate_rank`` (16).
    """

    mixer_name = "hdla_authors"
    decay_bias = False

    def configure(self, gate_rank: int = 16, **options) -> None:
        check_rank("gate_rank", gate_rank)
        self.gate_rank = gate_rank
        super().configure(**options)

    def build_output(self, proj_bias: bool) -> None:
        dd, width = self.factory_kwargs, self.num_heads * self.head_dim_v
        self.gate = LowRankProjection(self.dim, self.gate_rank, width, bias=False, **dd)
        self.norm = nn.RMSNorm(width, eps=self.norm_eps, **dd)
        self.proj = nn.Linear(width, self.dim, bias=proj_bias, **dd)

    def output(self, y, x, norm=None):
        """``W_o RMSNorm_all(y * act_g(x' U_g V_g))``, ``x' = norm(x)`` (x without a norm)."""
        x = x if norm is None else norm(x)
        gated = y.reshape(*x.shape[:2], -1) * self.gate_activation(self.gate(x))
        return self.proj_drop(self.proj(self.norm(gated)))
