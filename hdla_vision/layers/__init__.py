from .registry import create_mixer, list_mixers, register_mixer
from .hdla import BidirectionalHDLA  # registers the "hdla" vision mixer
