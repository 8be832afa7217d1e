"""Token mixers chosen by name.

Two registries: bidirectional mixers for the vision backbones (``forward(x [B, N, C]) -> [B, N, C]``)
and causal mixers for the language models. A mixer class is registered under a name with
``@register_mixer("hdla", kind="vision")`` and built with ``create_mixer(name, kind=..., dim=..., num_heads=..., **kw)``.
"""
from typing import Callable, Dict

_REGISTRIES: Dict[str, Dict[str, Callable]] = {"vision": {}, "causal": {}}


def _registry(kind: str) -> Dict[str, Callable]:
    if kind not in _REGISTRIES:
        raise ValueError(f"kind must be one of {sorted(_REGISTRIES)}, got {kind!r}")
    return _REGISTRIES[kind]


def register_mixer(name: str, kind: str = "vision") -> Callable:
    """Class decorator that registers a token mixer under ``name``."""
    registry = _registry(kind)

    def wrap(cls):
        if name in registry and registry[name] is not cls:
            raise ValueError(f"a {kind} mixer named {name!r} is already registered ({registry[name].__name__})")
        registry[name] = cls
        return cls

    return wrap


def list_mixers(kind: str = "vision"):
    return sorted(_registry(kind))


def create_mixer(name: str, kind: str = "vision", **kwargs):
    """Build the mixer registered as ``name``; unknown names raise with the list of known ones."""
    registry = _registry(kind)
    if name not in registry:
        raise ValueError(f"unknown {kind} mixer {name!r}; expected one of {sorted(registry)}")
    return registry[name](**kwargs)
