"""Token mixers, one class per mixer for the vision backbones (``directions=("fwd", "bwd")``) and the
causal language model (``directions=("fwd",)``), registered by name; each also as ``loglinear_<name>``
(log-linear attention, :mod:`hdla_vision.layers.loglinear`)."""
from .registry import create_mixer, list_mixers, mixer_class, register_mixer
from .mixer import (CHUNK_BACKENDS, RECURRENT_MAX_TOKENS, LinearAttentionMixer, MixerCache, set_activation_recompute,
                    set_chunk_backend)
from .hdla import AuthorsHDLAMixer, HDLAMixer  # registers "hdla", "hdla_authors"
from .seed import (DeltaNetMixer, GatedDeltaNetMixer, GatedDeltaProductMixer,  # registers the seed mixers
                   GeneralizedMixer, GLAMixer, HeadInHeadDeltaNetMixer, HeadInHeadGatedDeltaNetMixer, KDAMixer,
                   RWKV7Mixer)
from .loglinear import LOG_LINEAR_MIXERS  # registers "loglinear_<name>" for each mixer above

__all__ = [
    "create_mixer", "list_mixers", "mixer_class", "register_mixer", "CHUNK_BACKENDS", "RECURRENT_MAX_TOKENS",
    "LinearAttentionMixer", "MixerCache", "set_chunk_backend", "set_activation_recompute", "HDLAMixer", "AuthorsHDLAMixer", "GeneralizedMixer",
    "GLAMixer", "DeltaNetMixer", "GatedDeltaNetMixer", "GatedDeltaProductMixer", "KDAMixer", "RWKV7Mixer",
    "HeadInHeadDeltaNetMixer", "HeadInHeadGatedDeltaNetMixer", "LOG_LINEAR_MIXERS",
]
