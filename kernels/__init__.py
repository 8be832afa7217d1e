"""Triton chunk kernels for rank-generalized linear attention (installed as ``hdla_vision.kernels``)."""
from .generalized.naive import naive_generalized
from .generalized.torch_chunk import torch_chunk_generalized
from .hdla.naive import hdla_decay_factors, naive_hdla
from .hdla.fused_recurrent import fused_recurrent_hdla
from .ops import chunk_generalized, chunk_hdla
from .loglinear.chunk import chunk_loglinear_generalized, chunk_loglinear_hdla
from .loglinear.fused_recurrent import fused_recurrent_loglinear_generalized, fused_recurrent_loglinear_hdla
from .loglinear.naive import naive_loglinear_generalized, naive_loglinear_hdla

__all__ = [
    "chunk_generalized",
    "chunk_hdla",
    "naive_generalized",
    "naive_hdla",
    "hdla_decay_factors",
    "torch_chunk_generalized",
    "fused_recurrent_hdla",
    "chunk_loglinear_generalized",
    "chunk_loglinear_hdla",
    "naive_loglinear_generalized",
    "naive_loglinear_hdla",
    "fused_recurrent_loglinear_generalized",
    "fused_recurrent_loglinear_hdla",
]
