"""Triton chunk kernels for rank-generalized linear attention (installed as ``hdla_vision.kernels``).

A checkout's root on ``sys.path`` (``python -c`` or ``python -m pytest`` run from it) makes this
directory importable as a top-level ``kernels`` as well, and transformers imports any ``kernels``
it can find (its probe for the Hugging Face ``kernels`` package). A second copy of the package
would define the ``hdla_vision::*`` custom ops again (``custom_ops.py``): torch then destroys the
first copy's registrations while that copy's op objects still point at them, and the next call
through them reads freed memory (a segfault, or "Tried to access the schema for"). So under any
other name this package only makes that name, and its loaded submodules' names, aliases of
``hdla_vision.kernels``'s modules.
"""
import sys

INSTALLED_NAME = "hdla_vision.kernels"

if __name__ != INSTALLED_NAME:
    import importlib

    importlib.import_module(INSTALLED_NAME)
    for _name, _module in list(sys.modules.items()):
        if _name == INSTALLED_NAME or _name.startswith(INSTALLED_NAME + "."):
            sys.modules[__name__ + _name[len(INSTALLED_NAME):]] = _module
else:
    from .generalized.fused_recurrent import fused_recurrent_generalized
    from .generalized.naive import naive_generalized
    from .generalized.torch_chunk import torch_chunk_generalized
    from .hdla.naive import hdla_decay_factors, naive_hdla
    from .hdla.fused_recurrent import fused_recurrent_hdla
    from .ops import (chunk_generalized, chunk_generalized_bidirectional, chunk_hdla, chunk_hdla_bidirectional,
                      on_delta_rule)
    from .delta_rule.steps import chunk_delta_substeps
    from .loglinear.chunk import chunk_loglinear_generalized, chunk_loglinear_hdla
    from .loglinear.fused_recurrent import fused_recurrent_loglinear_generalized, fused_recurrent_loglinear_hdla
    from .loglinear.naive import naive_loglinear_generalized, naive_loglinear_hdla
    from .gated_norm.fused import gated_rms_norm
    from .gated_norm.naive import naive_gated_rms_norm
    from .prologue.fused import mixer_prologue
    from .prologue.naive import naive_mixer_prologue
    from .short_conv.fused import causal_conv1d
    from .short_conv.naive import naive_causal_conv1d

    __all__ = [
        "chunk_generalized",
        "chunk_hdla",
        "chunk_generalized_bidirectional",
        "chunk_hdla_bidirectional",
        "chunk_delta_substeps",
        "on_delta_rule",
        "naive_generalized",
        "naive_hdla",
        "hdla_decay_factors",
        "torch_chunk_generalized",
        "fused_recurrent_hdla",
        "fused_recurrent_generalized",
        "chunk_loglinear_generalized",
        "chunk_loglinear_hdla",
        "naive_loglinear_generalized",
        "naive_loglinear_hdla",
        "fused_recurrent_loglinear_generalized",
        "fused_recurrent_loglinear_hdla",
        "gated_rms_norm",
        "naive_gated_rms_norm",
        "mixer_prologue",
        "naive_mixer_prologue",
        "causal_conv1d",
        "naive_causal_conv1d",
    ]
