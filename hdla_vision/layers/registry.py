"""Token mixers chosen by name, one registry for the vision backbones and the causal language model.

A mixer class is registered under a name with ``@register_mixer("hdla")`` and built with
``create_mixer(name, dim=..., num_heads=..., directions=..., **kw)``: ``directions=("fwd", "bwd")``
for the bidirectional (vision) use, ``("fwd",)`` for the causal one (see
:mod:`hdla_vision.layers.mixer`).
"""
from typing import Callable, Dict, List

_REGISTRY: Dict[str, Callable] = {}


def register_mixer(name: str) -> Callable:
    """Class decorator that registers a token mixer under ``name``."""

    def wrap(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"a mixer named {name!r} is already registered ({_REGISTRY[name].__name__})")
        _REGISTRY[name] = cls
        return cls

    return wrap


def list_mixers() -> List[str]:
    return sorted(_REGISTRY)


def mixer_class(name: str) -> Callable:
    """The class registered as ``name``; unknown names raise with the list of known ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown mixer {name!r}; expected one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def create_mixer(name: str, **kwargs):
    """Build the mixer registered as ``name`` with ``kwargs``."""
    return mixer_class(name)(**kwargs)
