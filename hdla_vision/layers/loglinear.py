"""The log-linear mixers, registered as ``loglinear_<name>`` for every linear mixer registered so far.

Each is its linear mixer's class with ``log_linear=True`` as the default (and the only value it
takes): the same gates plus one lambda head per direction, the same transitions on the log-linear
ops (see :mod:`hdla_vision.layers.mixer`). ``loglinear_hdla``, ``loglinear_gated_deltanet``, ...;
``create_mixer(name, log_linear=True)`` builds the same mixer under its linear name.
"""
from typing import Dict, Type

from .mixer import LinearAttentionMixer
from .registry import list_mixers, mixer_class, register_mixer

PREFIX = "loglinear_"


def log_linear_class(linear: Type[LinearAttentionMixer]) -> Type[LinearAttentionMixer]:
    """``linear``'s log-linear subclass, named ``LogLinear<class name>`` in this module (so that
    pickling finds it) and registered as ``loglinear_<mixer name>``."""
    name = PREFIX + linear.mixer_name
    cls = type(f"LogLinear{linear.__name__}", (linear,), {
        "__module__": __name__,
        "__doc__": f"Log-linear {linear.__name__}: ``{linear.mixer_name}`` with ``log_linear=True``.",
        "mixer_name": name,
        "log_linear_default": True,
    })
    globals()[cls.__name__] = cls
    return register_mixer(name)(cls)


LOG_LINEAR_MIXERS: Dict[str, Type[LinearAttentionMixer]] = {
    PREFIX + name: log_linear_class(mixer_class(name)) for name in list_mixers() if not name.startswith(PREFIX)
}
