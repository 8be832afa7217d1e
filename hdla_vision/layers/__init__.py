from .registry import create_mixer, list_mixers, register_mixer
