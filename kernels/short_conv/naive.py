"""The causal depthwise convolution over time in plain PyTorch: the definition the Triton kernels
(``short_conv/fused.py``) are tested against, and their path for CPU tensors without the interpreter, float64
and ONNX export.

For x ``[B, T, C]``, a filter of K taps per channel ``w [C, K]`` and an optional bias ``[C]``:

    y[b, t, c] = bias[c] + sum_{i < K} w[c, i] x[b, t - (K - 1) + i, c]        (x = 0 before t = 0)

the short convolution of the causal mixers (``layers/mixer.py``) and of Zoology's BaseConv
(``lm/zoology_lm.py``): ``nn.Conv1d(C, C, K, groups=C)`` on the sequence padded with K - 1 zeros in front, in
the token-major layout the projections produce (no transposes).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def naive_causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """The module docstring's ``y [B, T, C]`` in x's dtype, computed in fp32 (float64 stays float64) and rounded
    once; differentiable by autograd."""
    acc = torch.promote_types(x.dtype, torch.float32)
    taps = weight.shape[-1]
    seq = F.pad(x.to(acc).transpose(1, 2), (taps - 1, 0))  # [B, C, K - 1 + T]
    out = F.conv1d(seq, weight.to(acc).unsqueeze(1), None if bias is None else bias.to(acc), groups=x.shape[-1])
    return out.transpose(1, 2).to(x.dtype)
