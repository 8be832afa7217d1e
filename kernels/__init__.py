"""Triton chunk kernels for rank-generalized linear attention (installed as ``hdla_vision.kernels``)."""
from .generalized.naive import naive_generalized
from .generalized.torch_chunk import torch_chunk_generalized
from .hdla.naive import hdla_decay_factors, naive_hdla
from .hdla.fused_recurrent import fused_recurrent_hdla
from .ops import chunk_generalized, chunk_hdla

__all__ = [
    "chunk_generalized",
    "chunk_hdla",
    "naive_generalized",
    "naive_hdla",
    "hdla_decay_factors",
    "torch_chunk_generalized",
    "fused_recurrent_hdla",
]
