"""The token-mixer block shared by every mixer, for the vision backbones and the causal language model.

One class per mixer serves both uses (as timm's ``Attention(is_causal=...)`` and fla's
``layers/<mixer>.py``), chosen by ``directions``:

- ``("fwd", "bwd")`` (vision): a forward scan (t = 1..N) and a reversed one (t = N..1, inside the
  kernel, no flipped copies), each with its own gates, summed with the token's own write counted
  once: ``y_t = y^fwd_t + y^bwd_t - own^bwd_t``. Both scans contain the token's own write
  ``scale * q_t^T K_t V_t^T``; with per-direction gates the two writes differ, so the mixer
  subtracts the backward scan's: the backward scan reads the later tokens through token t's own
  (backward) transition, and the token itself is read once, through the forward scan's write.
  The mixers run this sum as one bidirectional op (:meth:`LinearAttentionMixer.bidirectional_scan`:
  ``chunk_hdla_bidirectional`` / ``chunk_generalized_bidirectional``, kernels/README.md §9), which on
  the chunk64 kernels runs both scans in one launch per stage and writes y once;
  :meth:`LinearAttentionMixer.two_scans` is the definition it equals.
- ``("fwd",)`` (causal LM): one forward scan, with padding (``attention_mask``), an optional short
  causal convolution and a recurrent-state cache (prefill with the chunk op continuing the cached
  state, decoding with the decoding ops ``fused_recurrent_hdla`` / ``fused_recurrent_generalized``).

The block, per token (``H`` heads, key dim ``K``, value dim ``V`` per head)::

    q, k, v = act(conv(x W_qkv))                        (conv: LM only, optional; act: SiLU or identity)
    gates_d = directions[d](x)                          (beta, decays, ...: :mod:`hdla_vision.layers.gates`)
    y       = scan(q, k, v, gates_fwd) [+ reversed scan(q, k, v, gates_bwd) - own write]
    o       = W_o ( RMSNorm_head(y) * act_g(x W_g) )

``RMSNorm_head`` is an RMS norm over each head's V features (one weight shared by the heads), as in
GLA / Gated DeltaNet: the scans have no softmax normaliser and their output norm grows with the
number of tokens inside the decay window. ``act_g`` is SiLU by default (the swish output gate of
GLA and Gated DeltaNet).

Padding (``("fwd",)`` only). A token whose ``attention_mask`` entry is 0 becomes an identity step
of the recurrence: x is zeroed before the projections, and every recurrence input but q (k, v,
beta, g, or the generalized factors k, v, a, b, g) is zeroed, so the transition is ``I`` and the
write 0. With left padding the state stays exactly zero until the first real token; with right
padding the final state is the state after the last real token. The short conv sees the zeroed
inputs, so its window never reaches pad tokens' features either.

The cache (``("fwd",)`` only) is any object with the :class:`MixerCache` methods; the language
model adapts transformers' cache layers to it (``hdla_vision.lm.cache.LayerCache``).

Log-linear attention (``log_linear=True``, or the registered ``loglinear_<name>`` mixers; log-linear
paper, kernels/README.md §7). Every mixer lifts onto the log-linear ops with its own transitions:
the state splits into ``num_levels`` Fenwick buckets by the age of what they hold, each read with
its own weight ``lambda_t^(l) = softplus(L_{h,l} (x_t W_lambda)_{h,l})`` (a
:class:`~hdla_vision.layers.gates.LevelScales` module in each direction's gates, ``levels``)::

    y_t = scale * sum_l lambda_t^(l) S_t^(l)^T q_t,   S_t^(l) = sum_{s: level(t, s) = l} Phi(t, s) K_s V_s^T

with ``level(t, s) = min(bit_length(t XOR s), num_levels - 1)`` on absolute positions.

- Causal: positions continue the cache (``offset = cache.position()``, the tokens it has absorbed),
  whose state is the levels ``[B, H, num_levels, K, V]``; up to ``RECURRENT_MAX_TOKENS`` tokens
  decode with the log-linear decoding step. Padding shifts the grid of the padded rows, so a mask
  with padding before a token (left padding) is refused, and so is any padding with a cache.
- Bidirectional: both directions use one absolute grid. The backward scan of tokens ``N-1 .. 0``
  runs as a forward scan of the flipped sequence at offset ``P - N`` (``P`` the power of two
  ``>= N``): flipped token ``i`` (original ``N-1-i``) sits at ``P-1-(N-1-i)``, the complement of
  its original position in ``log2 P`` bits, and complementing both positions keeps
  ``t XOR s``. The backward level-0 weight is 0, so the token's own write is counted once (by
  the forward scan) and nothing is subtracted: ``y_t = y^fwd_t + y^bwd_t``.
The log-linear ops run the public linear ops once per level whatever :func:`set_chunk_backend` says, or, for
CPU tensors without a cache, their one PyTorch chunk form (kernels/README.md §7).

Recomputed activations (training memory, issue 12 part 4). With grad enabled and
:func:`set_activation_recompute` on (the default), two stages of the mixer keep only their inputs for the
backward and recompute what lies inside (:func:`recompute`, PyTorch's non-reentrant checkpoint; the
vision backbones' blocks recompute their MLP's activation the same way):

- the prologue of the bidirectional scans, ``x -> q`` and each direction's op inputs (:meth:`op_inputs`):
  the projections, SiLU and L2 norms, the gates (their low-rank projections, logsigmoid, sigmoid, fp32
  casts) and the factor functions. The bidirectional op (:meth:`bidirectional_scan`, one op for both
  directions) runs outside the recomputed stage: autograd keeps ``x`` and what the op saves (q, k, v,
  the per-direction inputs stacked as the op takes them), not the projections' outputs, the
  activations' inputs, the fp32 gate logits, nor a copy of k and v per direction. The backward never
  reruns the op's forward;
- the output stage before ``W_o``: the per-head RMS norm, ``x W_g`` and its activation, their product.
  Autograd keeps y and x;
- on the delta rule's kernels (the seed mixers' delta route, ``seed.GeneralizedMixer.delta_route``), the
  op's chunk terms: it saves only the state entering each chunk, and its backward remakes the rest with one
  more launch of its prepare kernel (``kernels/delta_rule/terms.py``).
A pre-norm block passes its norm (``forward(x, norm=...)``): both stages apply it to x themselves, so
autograd keeps the block's input (which the residual path needs anyway), not the normalised x.
The recomputation runs the same ops on the same inputs, so outputs and gradients are those of the plain
forward, bit for bit; the backward runs the stages' forward ops a second time (the q/k/v and gate GEMMs,
a few elementwise kernels). The causal use recomputes only the output stage: its prologue may read and
advance a cache.
"""
from functools import partial
from typing import NamedTuple, Optional, Protocol, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from hdla_vision.kernels import causal_conv1d, gated_rms_norm

from .gates import GateModule, LevelScales

DIRECTIONS = (("fwd",), ("fwd", "bwd"))
GATE_ACTIVATIONS = ("silu", "sigmoid", "identity")
# A causal forward of at most this many new tokens on top of a cached state uses the decoding op.
RECURRENT_MAX_TOKENS = 4
# Log-linear levels by default: levels 0..14 have their own weights, level 15 collects the rest
# (the pairs in different aligned blocks of 2^14 positions).
DEFAULT_NUM_LEVELS = 16
# "auto": the public ops (Triton on CUDA, the PyTorch chunk form on the CPU); "torch": the vectorised
# PyTorch chunk form called directly on any device (differentiable by autograd, traced by dynamo).
CHUNK_BACKENDS = ("auto", "torch")
_chunk_backend = "auto"
_activation_recompute = True


def set_chunk_backend(name: str) -> None:
    """Choose how every mixer runs its chunked scans: ``"auto"`` or ``"torch"``."""
    global _chunk_backend
    if name not in CHUNK_BACKENDS:
        raise ValueError(f"chunk backend must be one of {CHUNK_BACKENDS}, got {name!r}")
    _chunk_backend = name


def chunk_backend() -> str:
    return _chunk_backend


def set_activation_recompute(enabled: bool) -> None:
    """Recompute the mixers' prologue and output stage in the backward (True, the default) or save
    their activations (False: more memory, no second forward of those ops); on the delta rule's kernels
    also its chunk terms (``chunk_delta_rule(recompute=...)``); module docstring."""
    global _activation_recompute
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be a bool, got {enabled!r}")
    _activation_recompute = enabled


def activation_recompute() -> bool:
    return _activation_recompute


def recompute(function, *args, random: bool = False):
    """``function(*args)`` keeping only ``args`` (and what later ops save of its outputs) for the
    backward, which reruns ``function`` to rebuild the rest (non-reentrant ``torch.utils.checkpoint``:
    the recomputed graph is the original one, autocast state included). A plain call when grad is off
    or :func:`set_activation_recompute` is off. ``random``: ``function`` draws random numbers (dropout),
    so the RNG state is stashed and replayed for the recomputation."""
    if not (_activation_recompute and torch.is_grad_enabled()):
        return function(*args)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=random)


class MixerCache(Protocol):
    """One layer's recurrent state, as a causal mixer reads and writes it."""

    def recurrent_state(self) -> Optional[torch.Tensor]:
        """The state ``[B, H, K, V]`` after the tokens seen so far, or None before the first forward."""

    def set_recurrent_state(self, state: torch.Tensor) -> None:
        """Keep ``state [B, H, K, V]`` (fp32) for the next forward."""

    def conv_input(self, seq: torch.Tensor, width: int) -> torch.Tensor:
        """``seq [B, C, T]`` -> ``[B, C, width + T]``: the cached last ``width`` conv inputs (zeros for a
        fresh sequence) before ``seq``; keeps the last ``width`` columns for the next forward."""

    def position(self) -> int:
        """The number of tokens the cache has absorbed before this forward (the absolute position of
        the forward's first token); read by the log-linear mixers only. The cache's owner advances it
        once every layer has run."""


def mask_time(t: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Zero ``t [B, T, ...]`` where ``attention_mask [B, T]`` is 0 (a select, so no 0 * inf)."""
    keep = attention_mask.bool().reshape(*attention_mask.shape, *([1] * (t.dim() - 2)))
    return torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))


def check_loglinear_padding(attention_mask: torch.Tensor, cache) -> None:
    """Padding moves a row's tokens off their absolute positions on the log-linear bucket grid (the
    ops take one offset for the batch): refuse padding before a token (left padding, holes), and any
    padding with a cache (its next tokens would continue every row at the padded length)."""
    keep = attention_mask.bool()
    if bool((~keep[:, :-1] & keep[:, 1:]).any()):
        raise ValueError("attention_mask: a log-linear mixer takes no padding before a token (left padding): it "
                         "would shift the row's bucket grid; pad on the right, or run the rows separately")
    if cache is not None and not bool(keep.all()):
        raise ValueError("attention_mask: a log-linear mixer takes no padding with a cache (one absolute position "
                         "for the batch); run unpadded rows of equal length, or use no cache")


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class LinearAttentionMixer(nn.Module):
    """The shared block: ``forward(x [B, N, C], attention_mask=None, cache=None) -> [B, N, C]``.

    Args:
        dim: channels C of the input and output.
        num_heads: heads H.
        directions: ``("fwd", "bwd")`` (bidirectional, vision) or ``("fwd",)`` (causal, LM). Required:
            each model states which use it builds.
        head_dim: key dim K per head (default ``dim // num_heads``, then dim must be a multiple of H).
        head_dim_v: value dim V per head (default K).
        qkv_bias: bias on the q/k/v projection.
        proj_bias: bias on the output gate and output projection (timm's ViT blocks have them; LMs
            usually not).
        proj_drop: dropout after the output projection.
        short_conv_size: width of a depthwise causal conv on the q/k/v projections (0: none; causal only).
        gate_act: activation of the output gate, one of ``GATE_ACTIVATIONS``.
        norm_eps: epsilon of the per-head RMS norm and of the q/k L2 norms.
        log_linear: lift the mixer onto the log-linear ops (module docstring); None: the class's
            ``log_linear_default`` (True for the registered ``loglinear_<name>`` mixers, which refuse False).
        num_levels: log-linear levels L (>= 2), the width of each direction's lambda head; the
            buckets from level L - 1 up share the top weight (every pair ``2^(L-2)`` or more positions
            apart is among them).
        device, dtype: where and in which dtype the parameters are created (timm's factory arguments).
        **options: the mixer's own arguments (see each mixer); unknown ones raise ValueError.

    Subclasses set ``mixer_name``, ``qkv_activation`` ("silu" or "identity"), ``normalize_q``,
    ``scale`` (None: 1), and implement :meth:`make_gates` (one direction's gate modules),
    :meth:`features` (one direction's recurrence inputs), :meth:`scan`, :meth:`loglinear_scan`,
    :meth:`own_write` and, for the bidirectional op, :meth:`bidirectional_scan`.
    """

    mixer_name = "base"
    log_linear_default = False
    qkv_activation = "silu"
    normalize_q = False
    scale: Optional[float] = None

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        directions: Sequence[str],
        head_dim: Optional[int] = None,
        head_dim_v: Optional[int] = None,
        qkv_bias: bool = False,
        proj_bias: bool = True,
        proj_drop: float = 0.0,
        short_conv_size: int = 0,
        gate_act: str = "silu",
        norm_eps: float = 1e-5,
        log_linear: Optional[bool] = None,
        num_levels: int = DEFAULT_NUM_LEVELS,
        device=None,
        dtype=None,
        **options,
    ):
        super().__init__()
        self._check_sizes(dim, num_heads, head_dim, head_dim_v)
        self.directions_used = self._check_directions(directions)
        if not isinstance(short_conv_size, int) or short_conv_size < 0 or short_conv_size == 1:
            raise ValueError(f"short_conv_size must be 0 (off) or an int >= 2, got {short_conv_size!r}")
        if short_conv_size and self.bidirectional:
            raise ValueError("short_conv_size: the short convolution is causal; only directions=('fwd',) takes it")
        if gate_act not in GATE_ACTIVATIONS:
            raise ValueError(f"gate_act must be one of {GATE_ACTIVATIONS}, got {gate_act!r}")
        self.dim, self.num_heads = dim, num_heads
        self.head_dim = dim // num_heads if head_dim is None else head_dim
        self.head_dim_v = self.head_dim if head_dim_v is None else head_dim_v
        self.short_conv_size, self.gate_act, self.norm_eps = short_conv_size, gate_act, norm_eps
        self.log_linear, self.num_levels = self._check_log_linear(log_linear, num_levels)
        self.factory_kwargs = dd = dict(device=device, dtype=dtype)
        self.num_keys = 1  # key/value pairs per token (n_h of Gated DeltaProduct)
        self.configure(**options)
        heads, hk, hv, n = num_heads, self.head_dim, self.head_dim_v, self.num_keys
        self.qkv_sizes = [heads * hk, n * heads * hk, n * heads * hv]
        self.qkv = nn.Linear(dim, sum(self.qkv_sizes), bias=qkv_bias, **dd)
        if short_conv_size:
            width = sum(self.qkv_sizes)
            self.conv = nn.Conv1d(width, width, short_conv_size, groups=width, bias=False, **dd)
        self.directions = nn.ModuleList([self.direction_gates() for _ in self.directions_used])
        self.build_output(proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        self.init_weights()

    # -- checks ------------------------------------------------------------------------------
    @staticmethod
    def _check_sizes(dim, num_heads, head_dim, head_dim_v) -> None:
        check_positive_int("dim", dim)
        check_positive_int("num_heads", num_heads)
        if head_dim is None and dim % num_heads:
            raise ValueError(f"dim must be a positive multiple of num_heads, got dim={dim}, num_heads={num_heads}")
        if head_dim is not None:
            check_positive_int("head_dim", head_dim)
        if head_dim_v is not None:
            check_positive_int("head_dim_v", head_dim_v)

    @staticmethod
    def _check_directions(directions) -> Tuple[str, ...]:
        directions = tuple(directions) if isinstance(directions, (tuple, list)) else directions
        if directions not in DIRECTIONS:
            raise ValueError("directions must be ('fwd',) (causal) or ('fwd', 'bwd') (bidirectional), "
                             f"got {directions!r}")
        return directions

    def _check_log_linear(self, log_linear, num_levels) -> Tuple[bool, int]:
        if log_linear is None:
            log_linear = self.log_linear_default
        if not isinstance(log_linear, bool):
            raise ValueError(f"log_linear must be a bool, got {log_linear!r}")
        if self.log_linear_default and not log_linear:
            raise ValueError(f"log_linear=False: the {self.mixer_name!r} mixer is log-linear; "
                             f"use {self.mixer_name.removeprefix('loglinear_')!r} for the linear one")
        if not isinstance(num_levels, int) or isinstance(num_levels, bool) or num_levels < 2:
            raise ValueError(f"num_levels must be an int >= 2 (level 0, the token itself, and older buckets), "
                             f"got {num_levels!r}")
        return log_linear, num_levels

    @property
    def bidirectional(self) -> bool:
        return len(self.directions_used) == 2

    # -- hooks -------------------------------------------------------------------------------
    def configure(self, **options) -> None:
        """Take the mixer's own keyword arguments; unknown ones raise."""
        if options:
            raise ValueError(f"unknown arguments for the {self.mixer_name!r} mixer: {sorted(options)}")

    def make_gates(self) -> nn.ModuleDict:
        """The gate modules of one scan direction, created with ``**self.factory_kwargs``."""
        raise NotImplementedError

    def direction_gates(self) -> nn.ModuleDict:
        """:meth:`make_gates`, plus the lambda head ``levels`` when log-linear."""
        gates = self.make_gates()
        if self.log_linear:
            gates["levels"] = LevelScales(self.dim, self.num_heads, self.num_levels, **self.factory_kwargs)
        return gates

    def features(self, x: torch.Tensor, q, k, v, gates: nn.ModuleDict) -> NamedTuple:
        """One direction's recurrence inputs (a NamedTuple of ``[B, N, H, ...]`` tensors) from x, the
        activated q ``[B, N, H, K]``, k ``[B, N, H, n, K]``, v ``[B, N, H, n, V]`` and its gates."""
        raise NotImplementedError

    def scan(self, q: torch.Tensor, feats: NamedTuple, reverse: bool = False,
             initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
             recurrent: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run the recurrence: ``(y [B, N, H, V], final state [B, H, K, V] or None)``. ``recurrent``:
        the decoding op on ``initial_state`` (kept in fp32) instead of the chunk op."""
        raise NotImplementedError

    def loglinear_scan(self, q: torch.Tensor, feats: NamedTuple, level_scales: torch.Tensor, offset: int = 0,
                       initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                       recurrent: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The log-linear recurrence, forward only, at absolute positions ``offset + i``:
        ``(y [B, N, H, V], final levels [B, H, L, K, V] or None)``; ``level_scales [B, N, H, L]``.
        ``recurrent``: the decoding step on ``initial_state`` (kept in fp32) instead of the chunk op."""
        raise NotImplementedError

    def own_write(self, q: torch.Tensor, feats: NamedTuple) -> torch.Tensor:
        """The token's own contribution to a scan ``scale * q_t^T K_t V_t^T``: ``[B, N, H, V]``."""
        raise NotImplementedError

    def op_inputs(self, q: torch.Tensor, feats: NamedTuple) -> NamedTuple:
        """``feats`` in the layout and dtypes the ops take (what :meth:`scan` would make of them, so that
        it and :meth:`own_write` make no copy of their own); the identity unless a mixer converts."""
        return feats

    def two_scans(self, q: torch.Tensor, fwd: NamedTuple, bwd: NamedTuple) -> torch.Tensor:
        """The bidirectional sum by its definition: the forward scan with ``fwd``'s inputs, the reversed
        scan with ``bwd``'s, minus the reversed scan's own write: ``y [B, N, H, V]``."""
        y_fwd, _ = self.scan(q, fwd, reverse=False)
        y_bwd, _ = self.scan(q, bwd, reverse=True)
        return y_fwd + y_bwd - self.own_write(q, bwd)

    def bidirectional_scan(self, q: torch.Tensor, fwd: NamedTuple, bwd: NamedTuple) -> torch.Tensor:
        """The bidirectional sum of :meth:`two_scans` as the mixer runs it: subclasses call the
        bidirectional op (one node, one launch per stage on the chunk64 kernels); the base class, and
        every mixer under :func:`set_chunk_backend` ``("torch")``, runs :meth:`two_scans`."""
        return self.two_scans(q, fwd, bwd)

    # -- output stage ------------------------------------------------------------------------
    def build_output(self, proj_bias: bool) -> None:
        """The output gate ``W_g``, the per-head norm and the output projection ``W_o``."""
        dd, width = self.factory_kwargs, self.num_heads * self.head_dim_v
        self.gate = nn.Linear(self.dim, width, bias=proj_bias, **dd)
        self.norm = nn.RMSNorm(self.head_dim_v, eps=self.norm_eps, **dd)
        self.proj = nn.Linear(width, self.dim, bias=proj_bias, **dd)

    def gate_activation(self, gate: torch.Tensor) -> torch.Tensor:
        if self.gate_act == "silu":
            return F.silu(gate)
        if self.gate_act == "sigmoid":
            return torch.sigmoid(gate)
        return gate

    def output(self, y: torch.Tensor, x: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """``y [B, N, H, V]``, ``x [B, N, C]`` -> ``W_o (RMSNorm_head(y) * act_g(x' W_g))  [B, N, C]`` with
        ``x' = norm(x)`` (x without a norm); the gated norm is recomputed in the backward (module docstring)."""
        return self.proj_drop(self.proj(recompute(partial(self.gated_norm, norm=norm), y, x)))

    def gated_norm(self, y: torch.Tensor, x: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """``RMSNorm_head(y) * act_g(norm(x) W_g)``: ``[B, N, H * V]``, the norm and the gate in one op
        (``hdla_vision.kernels.gated_rms_norm``: one Triton kernel forward, one backward, fp32 inside)."""
        x = x if norm is None else norm(x)
        return gated_rms_norm(y, self.gate(x), self.norm.weight, self.norm_eps, self.gate_act)

    # -- shared ------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """The gates' starting values; the vision backbone calls this after its generic linear init."""
        for module in self.directions.modules():
            if isinstance(module, GateModule):
                module.init_weights()

    def short_conv(self, proj: torch.Tensor, cache: Optional[MixerCache]) -> torch.Tensor:
        """Depthwise causal conv over time of ``proj [B, T, C]``, continuing the cached window: without a cache
        one ``causal_conv1d`` (Triton, token-major), with one ``F.conv1d`` over the window and the new tokens."""
        if cache is None:
            return causal_conv1d(proj, self.conv.weight[:, 0])
        seq = cache.conv_input(proj.transpose(1, 2), self.short_conv_size - 1)  # [B, C, K - 1 + T]
        return F.conv1d(seq, self.conv.weight, groups=seq.shape[1]).transpose(1, 2)

    def projections(self, x: torch.Tensor, cache: Optional[MixerCache] = None):
        """q ``[B, N, H, K]``, k ``[B, N, H, n, K]``, v ``[B, N, H, n, V]``, activated (n = ``num_keys``),
        contiguous, in the projection's dtype; k (and q where ``normalize_q``) L2-normalised after a SiLU
        activation."""
        batch, seq_len, _ = x.shape
        heads, n = self.num_heads, self.num_keys
        proj = self.qkv(x)
        if self.short_conv_size:
            proj = self.short_conv(proj, cache)
        q, k, v = proj.split(self.qkv_sizes, dim=-1)
        q = q.reshape(batch, seq_len, heads, self.head_dim)
        k = k.reshape(batch, seq_len, heads, n, self.head_dim)
        v = v.reshape(batch, seq_len, heads, n, self.head_dim_v)
        if self.qkv_activation == "silu":
            dtype = proj.dtype
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
            # cast back: under CUDA autocast the norm runs in fp32, and a fp32 q would send the whole op
            # to the fp32 kernels (the ops run in q's dtype)
            if self.normalize_q:
                q = F.normalize(q, p=2.0, dim=-1, eps=self.norm_eps).to(dtype)
            k = F.normalize(k, p=2.0, dim=-1, eps=self.norm_eps).to(dtype)
        # one contiguous k and v for both directions and the own write: the ops save them as given, and a
        # view would keep the whole projection alive
        return q.contiguous(), k.contiguous(), v.contiguous()

    def check_input(self, x: torch.Tensor, attention_mask, cache) -> None:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape [B, N, {self.dim}], got {list(x.shape)}")
        if self.bidirectional and (attention_mask is not None or cache is not None):
            raise ValueError("attention_mask / cache: a bidirectional mixer (directions=('fwd', 'bwd')) takes neither")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"attention_mask must have shape [B, T] = {list(x.shape[:2])}, "
                             f"got {list(attention_mask.shape)}")
        if self.log_linear and attention_mask is not None:
            check_loglinear_padding(attention_mask, cache)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[MixerCache] = None, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """``x [B, N, C] -> [B, N, C]``; ``attention_mask [B, N]`` (1 = token, 0 = pad) and ``cache``
        for the causal use only. ``norm``: a per-token module (a pre-norm block's norm) the mixer applies
        to x first; the bidirectional use applies it inside its recomputed stages, so that the
        normalised x is not kept for the backward (module docstring)."""
        self.check_input(x, attention_mask, cache)
        if self.bidirectional:
            return self.output(self.mix(x, norm), x, norm)
        x = x if norm is None else norm(x)
        if attention_mask is not None:
            x = x * attention_mask.to(x.dtype)[..., None]
        return self.output(self.causal_mix(x, attention_mask, cache), x)

    def scan_inputs(self, x: torch.Tensor, norm: Optional[nn.Module] = None
                    ) -> Tuple[torch.Tensor, NamedTuple, NamedTuple]:
        """The prologue of the bidirectional scans: ``x [B, N, C] -> (q, forward inputs, backward inputs)``
        as the ops take them (:meth:`op_inputs`), of ``norm(x)`` (x without a norm)."""
        x = x if norm is None else norm(x)
        q, k, v = self.projections(x)
        fwd = self.op_inputs(q, self.features(x, q, k, v, self.directions[0]))
        bwd = self.op_inputs(q, self.features(x, q, k, v, self.directions[1]))
        return q, fwd, bwd

    def mix(self, x: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """The bidirectional sum before norm and gate: ``x [B, N, C] -> y [B, N, H, V]`` (of ``norm(x)``);
        the prologue is recomputed in the backward (module docstring)."""
        if self.log_linear:  # the level weights read the normalised x too: normalise it once, up front
            x = x if norm is None else norm(x)
            q, fwd, bwd = recompute(self.scan_inputs, x)
            return self.loglinear_mix(x, q, fwd, bwd)
        q, fwd, bwd = recompute(partial(self.scan_inputs, norm=norm), x)
        return self.bidirectional_scan(q, fwd, bwd)  # outside the recomputed stage: the op's saved tensors stay saved

    def loglinear_mix(self, x: torch.Tensor, q: torch.Tensor, fwd: NamedTuple, bwd: NamedTuple) -> torch.Tensor:
        """Both log-linear scans on one absolute grid (module docstring): ``y [B, N, H, V]``."""
        seq_len = x.shape[1]
        span = 1 << (seq_len - 1).bit_length()  # P, the power of two >= N
        scales_fwd = self.directions[0]["levels"](x)
        scales_bwd = self.directions[1]["levels"](x)
        scales_bwd = torch.cat([torch.zeros_like(scales_bwd[..., :1]), scales_bwd[..., 1:]], dim=-1)  # own write once
        y_fwd, _ = self.loglinear_scan(q, fwd, scales_fwd)
        flipped = type(bwd)(*(t.flip(1) for t in bwd))
        y_bwd, _ = self.loglinear_scan(q.flip(1), flipped, scales_bwd.flip(1), offset=span - seq_len)
        return y_fwd + y_bwd.flip(1)

    def causal_mix(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor],
                   cache: Optional[MixerCache]) -> torch.Tensor:
        """The causal scan before norm and gate: ``x [B, T, C] -> y [B, T, H, V]``, continuing and
        updating ``cache``'s state; up to ``RECURRENT_MAX_TOKENS`` tokens on a cached state decode."""
        state = cache.recurrent_state() if cache is not None else None
        q, k, v = self.projections(x, cache)
        feats = self.features(x, q, k, v, self.directions[0])
        if attention_mask is not None:
            feats = type(feats)(*(mask_time(t, attention_mask) for t in feats))
        recurrent = state is not None and x.shape[1] <= RECURRENT_MAX_TOKENS
        if self.log_linear:
            offset = 0 if cache is None else cache.position()
            y, final_state = self.loglinear_scan(q, feats, self.directions[0]["levels"](x), offset, state,
                                                 output_final_state=cache is not None, recurrent=recurrent)
        else:
            y, final_state = self.scan(q, feats, initial_state=state, output_final_state=cache is not None,
                                       recurrent=recurrent)
        if cache is not None:
            cache.set_recurrent_state(final_state.float())
        return y

    def extra_repr(self) -> str:
        levels = f", num_levels={self.num_levels}" if self.log_linear else ""
        return (f"{self.mixer_name!r}, dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"head_dim_v={self.head_dim_v}, directions={self.directions_used}{levels}")
