"""Public ops: validate inputs, then call the custom ops of ``custom_ops.py`` (one opaque node
each under ``torch.compile``), which run the Triton kernels (CUDA tensors, or any tensor under
``TRITON_INTERPRET=1``) of the family ``HDLA_VISION_KERNELS`` selects (``chunk16``, the default, or
``chunk64``: kernels/README.md §8) or the vectorised PyTorch chunk form (CPU tensors, and what the
family does not cover: ``utils.triton_supports_ranks`` for chunk16, ranks above 4 and float64 for
chunk64).

Under ONNX export (``torch.onnx.export``, both the dynamo exporter and the legacy TorchScript one
set ``torch.onnx.is_in_onnx_export()``) the custom ops, which ONNX cannot know, are not called:
the ops run the PyTorch chunk form with the block-doubling inverse instead
(``generalized.torch_chunk.doubling_unit_lower``: matrix products and selects, no triangular
solve), so the exporter sees plain aten ops. ``torch.export`` and ``torch.compile`` keep the custom
op (one opaque node). The value check ``g <= 0`` is not part of an exported graph.
"""
from typing import Optional, Tuple

import torch

from .custom_ops import chunk_generalized_op, chunk_hdla_op
from .generalized.torch_chunk import chunk_form, doubling_unit_lower
from .hdla.naive import hdla_decay_factors
from .utils import check_generalized_inputs, check_hdla_inputs, per_batch_slice, use_triton  # noqa: F401 (use_triton: imported from here by callers)


def _scale(scale: Optional[float]) -> float:
    return 1.0 if scale is None else float(scale)


def exporting_to_onnx() -> bool:
    """Whether ``torch.onnx.export`` is tracing the caller (then the ops take the exportable path)."""
    return torch.onnx.is_in_onnx_export()


def exportable_generalized(q, k, v, a, b, g, scale: float, initial_state, reverse: bool):
    """The generalized op in plain aten ops that ONNX has (opset 17): the chunk form with the
    block-doubling inverse. Shapes as :func:`chunk_generalized`; returns ``(o [B, T, H, V], state
    [B, H, K, V] in the compute dtype, fp32 or float64)``."""
    return chunk_form(q, k, v, a, b, g, scale, initial_state, reverse, inverse=doubling_unit_lower)


def exportable_hdla(q, k, v, beta, g, scale: float, initial_state, reverse: bool):
    """HDLA in plain aten ops: :func:`exportable_generalized` with HDLA's A, B (kernels/README.md §2);
    shapes as :func:`chunk_hdla`."""
    a, b = hdla_decay_factors(k, beta, g)
    return exportable_generalized(q, k.unsqueeze(-2), v.unsqueeze(-2), a, b, g, scale, initial_state, reverse)


def _final(state: torch.Tensor, q: torch.Tensor, output_final_state: bool) -> Optional[torch.Tensor]:
    """The custom op's state output (accumulation dtype) as the public ops return it: q's dtype or None."""
    return state.to(q.dtype) if output_final_state else None


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
        q: ``[B, T, H, K]``.
        g: ``[B, T, H, K]`` (a decay per key channel, ``Diag(exp g_t)``) or ``[B, T, H]`` (one per
            head, ``exp(g_t) I``: Gated DeltaNet, Gated DeltaProduct, Head-in-Head; its gradient is
            ``[B, T, H]`` too). ``g = log d_t`` is a log-decay, see LOG-DECAY below.
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
    check_generalized_inputs(q, k, v, a, b, g, initial_state, scale)
    if exporting_to_onnx():
        o, state = exportable_generalized(q, k, v, a, b, g, _scale(scale), initial_state, reverse)
        return o, _final(state, q, output_final_state)
    def op(q, k, v, a, b, g, initial_state):
        return chunk_generalized_op(q, k, v, a, b, g, _scale(scale), initial_state, output_final_state, reverse)[:2]

    o, state = per_batch_slice(op, dict(q=q, k=k, v=v, a=a, b=b, g=g, initial_state=initial_state), q.shape[2])
    return o, _final(state, q, output_final_state)


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
    if exporting_to_onnx():
        o, state = exportable_hdla(q, k, v, beta, g, _scale(scale), initial_state, reverse)
        return o, _final(state, q, output_final_state)
    def op(q, k, v, beta, g, initial_state):
        return chunk_hdla_op(q, k, v, beta, g, _scale(scale), initial_state, output_final_state, reverse)[:2]

    o, state = per_batch_slice(op, dict(q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state), q.shape[2])
    return o, _final(state, q, output_final_state)
