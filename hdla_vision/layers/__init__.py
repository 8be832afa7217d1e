from .registry import create_mixer, list_mixers, register_mixer
from .hdla import BidirectionalHDLA  # registers the "hdla" vision mixer
from . import seed_vision  # registers the seed vision mixers (gla, deltanet, gated_deltanet, kda, rwkv7, ...)
