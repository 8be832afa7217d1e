"""Public ops: validate inputs, then run the Triton kernels (CUDA tensors, or any tensor
under ``TRITON_INTERPRET=1``) or the vectorised PyTorch chunk form (CPU tensors, and the
rank / head-dim combinations the Triton kernels do not cover: ``utils.triton_supports_ranks``)."""
import warnings
from typing import Optional, Tuple

import torch

from .generalized.torch_chunk import torch_chunk_generalized
from .hdla.naive import hdla_decay_factors
from .utils import check_generalized_inputs, check_hdla_inputs, triton_supports_ranks, use_triton


def chunk_generalized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Generalized linear attention (HDLA paper eq. 8), chunkwise.

    ``S_t = (Diag(exp g_t) - A_t B_t^T) S_{t-1} + K_t V_t^T``, ``o_t = scale * S_t^T q_t``.

    Args:
        q, g: ``[B, T, H, K]``; ``g = log d_t`` is a log-decay, see LOG-DECAY below.
        k: ``[B, T, H, r_kv, K]``; v: ``[B, T, H, r_kv, V]``, ``r_kv >= 1``.
        a, b: ``[B, T, H, r_ab, K]``, ``r_ab >= 0`` (the columns of A_t, B_t). At ``r_ab = 0`` they
            are empty tensors and get empty gradients.
        scale: output scale, ``None`` means 1.
        initial_state: ``[B, H, K, V]`` or None (any float dtype; read in fp32 or float64).
        output_final_state: also return the state after the last scanned token.
        reverse: scan from token T-1 down to 0.

    Returns:
        ``(o [B, T, H, V], final_state [B, H, K, V] or None)``; ``o`` has q's dtype.

    DTYPES: k, v, a, b have q's dtype; g has q's dtype or float32 (mixers keep their gates in
    fp32 under bf16). Anything else raises ValueError naming the argument before any launch.

    LOG-DECAY: the domain is ``g <= 0``. ``g = -inf`` (d = 0) is allowed and gives the exact
    limit, a reset of the state's channel; its gradient is defined as 0 (as everywhere below the
    floor where exp(g) underflows to 0: -110 in fp32, -750 in float64; ``utils.LOG_ZERO_FP32``).
    ``g > 0`` is outside the domain: refused with ValueError for CPU tensors; for CUDA tensors it
    is not checked (that would synchronise the device) and the result is undefined.
    """
    r_kv, r_ab = check_generalized_inputs(q, k, v, a, b, g, initial_state, scale)
    if use_triton(q) and triton_supports_ranks(q.shape[-1], r_kv, r_ab):
        from .generalized.chunk import triton_chunk_generalized

        return triton_chunk_generalized(q, k, v, a, b, g, scale, initial_state, output_final_state, reverse)
    if q.is_cuda:
        warnings.warn(f"chunk_generalized: r_ab = {r_ab}, r_kv = {r_kv} at K = {q.shape[-1]} is outside what the Triton "
                      "kernels run correctly (kernels/utils.py: triton_supports_ranks); using the slower PyTorch chunk form")
    return torch_chunk_generalized(q, k, v, a, b, g, scale, initial_state, output_final_state, reverse)


def chunk_hdla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """HDLA (paper eq. 27): ``S_t = (I - b k k^T) Diag(exp g) (I - b k k^T) S_{t-1} + k v^T``.

    Args:
        q, k, g: ``[B, T, H, K]`` (k L2-normalised by the caller, ``g = log lambda <= 0``).
        v: ``[B, T, H, V]``; beta: ``[B, T, H]`` in [0, 2].
        Other arguments as :func:`chunk_generalized`.

    DTYPES: k, v have q's dtype; beta and g have q's dtype or float32. LOG-DECAY as in
    :func:`chunk_generalized`: ``g = -inf`` is the exact reset (gradient 0), ``g > 0`` is outside
    the domain (ValueError for CPU tensors, unchecked on CUDA).
    """
    check_hdla_inputs(q, k, v, beta, g, initial_state, scale)
    if use_triton(q):
        from .hdla.chunk import triton_chunk_hdla

        return triton_chunk_hdla(q, k, v, beta, g, scale, initial_state, output_final_state, reverse)
    a, b = hdla_decay_factors(k, beta, g)
    return torch_chunk_generalized(
        q, k.unsqueeze(-2), v.unsqueeze(-2), a, b, g, scale, initial_state, output_final_state, reverse
    )
