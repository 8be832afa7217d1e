"""Reading and writing the fixed-size per-layer states in a transformers cache.

``HDLAConfig.layer_types`` is ``"linear_attention"`` for every layer, so transformers'
``DynamicCache(config=...)`` (what ``generate`` builds) holds one ``LinearAttentionLayer`` per
layer: a recurrent state ``[B, H, K, V]`` (fp32) and, with a short conv, the last
``short_conv_size - 1`` conv inputs ``[B, C, short_conv_size - 1]``. Memory is constant in the
number of generated tokens. A log-linear mixer (``mixer="loglinear_<name>"``) keeps its Fenwick
levels ``[B, H, L, K, V]`` there instead (L = ``num_levels``; kernels/README.md §7) and reads the
absolute position of its next token from :class:`HDLACache`'s token count.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin


def _layer(cache: Cache, layer_idx: int) -> LinearAttentionCacheLayerMixin:
    if not isinstance(cache, Cache):
        raise ValueError(f"cache (past_key_values) must be a transformers Cache, got {type(cache).__name__}")
    if layer_idx >= len(cache.layers):
        raise ValueError(f"the cache has {len(cache.layers)} layers but layer {layer_idx} was requested; "
                         "build it with DynamicCache(config=model.config)")
    layer = cache.layers[layer_idx]
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        raise ValueError(f"cache layer {layer_idx} is a {type(layer).__name__}; HDLA layers need a linear-attention "
                         "cache layer (build the cache with DynamicCache(config=model.config))")
    return layer


def read_recurrent_state(cache: Cache, layer_idx: int) -> Optional[torch.Tensor]:
    """The state after the tokens seen so far, or None before the first forward (or after reset)."""
    layer = _layer(cache, layer_idx)
    if layer.has_previous_state[0] and layer.is_recurrent_states_initialized[0]:
        return layer.recurrent_states[0]
    return None


def write_recurrent_state(cache: Cache, layer_idx: int, state: torch.Tensor) -> None:
    layer = _layer(cache, layer_idx)
    layer.update_recurrent_state(state, 0)
    layer.has_previous_state[0] = True


def read_conv_window(cache: Cache, layer_idx: int) -> Optional[torch.Tensor]:
    """The cached conv inputs ``[B, C, width]``, or None before the first forward."""
    layer = _layer(cache, layer_idx)
    if layer.has_previous_state[0] and layer.is_conv_states_initialized[0]:
        return layer.conv_states[0]
    return None


class LayerCache:
    """One layer's view of a transformers cache, in the form the mixers read and write it
    (:class:`hdla_vision.layers.mixer.MixerCache`). Building it checks the cache and the layer."""

    def __init__(self, cache: Cache, layer_idx: int):
        _layer(cache, layer_idx)
        self.cache, self.layer_idx = cache, layer_idx

    def recurrent_state(self) -> Optional[torch.Tensor]:
        return read_recurrent_state(self.cache, self.layer_idx)

    def set_recurrent_state(self, state: torch.Tensor) -> None:
        write_recurrent_state(self.cache, self.layer_idx, state)

    def position(self) -> int:
        """The tokens the cache has absorbed before this forward (log-linear mixers: the absolute
        position of the forward's first token); only an :class:`HDLACache` counts them."""
        if not isinstance(self.cache, HDLACache):
            raise ValueError(f"cache (past_key_values): a log-linear mixer needs an HDLACache (it counts the tokens, the "
                             f"positions of the bucket grid), got {type(self.cache).__name__}; build it with "
                             "HDLACache(config=model.config)")
        return self.cache.seen_tokens

    def conv_input(self, seq: torch.Tensor, width: int) -> torch.Tensor:
        """``seq [B, C, T]`` after the cached last ``width`` conv inputs (zeros for a fresh sequence):
        ``[B, C, width + T]``; the cache keeps the last ``width`` columns."""
        if read_conv_window(self.cache, self.layer_idx) is None:
            seq = F.pad(seq, (width, 0))
        # returns [cached window, seq] when continuing, and keeps the last `width` inputs
        return self.cache.update_conv_state(seq, self.layer_idx, conv_kernel_size=width)


class HDLACache(DynamicCache):
    """``DynamicCache`` of linear-attention layers that also counts the tokens it has absorbed.

    transformers' ``generate`` asks a user-supplied cache for ``get_seq_length()`` to slice a
    continued prompt; plain linear-attention caches cannot answer, this one can. Build it with
    ``HDLACache(config=model.config)``; ``HDLAModel`` creates one when ``use_cache`` is set.
    """

    def __init__(self, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def advance(self, num_tokens: int) -> None:
        self.seen_tokens += int(num_tokens)

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0
