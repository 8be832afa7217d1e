from .naive import naive_generalized
from .torch_chunk import torch_chunk_generalized
