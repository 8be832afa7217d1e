"""The gated per-head RMS norm in plain PyTorch: the definition the fused kernels (``gated_norm/fused.py``)
are tested against, and their path for CPU tensors without the interpreter and for float64.

For y ``[B, N, H, V]``, the gate's pre-activation ``z [B, N, H*V]`` and the norm's weight ``w [V]``
(one weight shared by the heads, as GLA's and Gated DeltaNet's output norm):

    out = (w * y * rsqrt(mean_V(y^2) + eps)) * act(z)      [B, N, H*V]

with ``act`` one of ``silu``, ``sigmoid``, ``identity``: the output stage of every mixer before its
output projection (``layers/mixer.py``: ``gated_norm``).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = ("silu", "sigmoid", "identity")


def activation(z: Tensor, act: str) -> Tensor:
    if act == "silu":
        return F.silu(z)
    if act == "sigmoid":
        return torch.sigmoid(z)
    return z


def naive_gated_rms_norm(y: Tensor, gate: Tensor, weight: Tensor, eps: float, act: str) -> Tensor:
    """The module docstring's ``out`` in ``promote_types(y.dtype, gate.dtype)``, computed in fp32 (float64
    stays float64) and rounded once; differentiable by autograd."""
    out_dtype = torch.promote_types(y.dtype, gate.dtype)
    acc = torch.promote_types(out_dtype, torch.float32)
    y32 = y.to(acc)
    normed = y32 * torch.rsqrt(y32.square().mean(-1, keepdim=True) + eps) * weight.to(acc)
    return (normed.reshape(gate.shape) * activation(gate.to(acc), act)).to(out_dtype)
