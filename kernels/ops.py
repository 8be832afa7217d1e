"""Public ops: validate inputs, then call the custom ops of ``custom_ops.py`` (one opaque node
each under ``torch.compile``), which run the Triton kernels (CUDA tensors, or any tensor under
``TRITON_INTERPRET=1``) of the family ``HDLA_VISION_KERNELS`` selects (``auto``, the default, ``chunk16``
or ``chunk64``: kernels/README.md §8) or the vectorised PyTorch chunk form (CPU tensors, and what the
family does not cover: ``utils.triton_supports_ranks`` for chunk16, ranks above 4 and float64 for
chunk64). The path is picked here and passed to the custom op, so a compiled graph holds it as a
constant (and inductor's cache tells graphs of different families apart).

Under ONNX export (``torch.onnx.export``, both the dynamo exporter and the legacy TorchScript one
set ``torch.onnx.is_in_onnx_export()``) the custom ops, which ONNX cannot know, are not called:
the ops run the PyTorch chunk form with the block-doubling inverse instead
(``generalized.torch_chunk.doubling_unit_lower``: matrix products and selects, no triangular
solve), so the exporter sees plain aten ops. ``torch.export`` and ``torch.compile`` keep the custom
op (one opaque node). The value check ``g <= 0`` is not part of an exported graph.
"""
from typing import Optional, Tuple

import torch

from .bidirectional_ops import (chunk_generalized_bidirectional_op, chunk_hdla_bidirectional_op, direction,
                                fused_recurrent_hdla_bidirectional_op, generalized_bidirectional_path, own_write,
                                per_direction)
from .custom_ops import _generalized_path, _hdla_path, chunk_generalized_op, chunk_hdla_op, fused_recurrent_hdla_op
from .delta_rule.chunk import MAX_HEAD_DIM as DELTA_MAX_HEAD_DIM, value_block as delta_value_block
from .delta_rule.steps import chunk_token_steps, hdla_steps
from .generalized.torch_chunk import chunk_form, doubling_unit_lower
from .hdla.naive import hdla_decay_factors
from .utils import (MAX_GRID_BATCH_HEADS, batch_slices, check_generalized_bidirectional_inputs,
                    check_generalized_inputs, check_hdla_bidirectional_inputs, check_hdla_inputs, kernel_family,
                    per_batch_slice, use_recurrence, use_triton)


def _scale(scale: Optional[float]) -> float:
    return 1.0 if scale is None else float(scale)


# The fewest programs of the delta rule's serial passes (B * H * V / BV, V taken as K) with which auto routes a mixer
# there by default: every case timed faster had >= 256 (H200: the LM shape 256, 512 px 384, 224 px 1536); with few
# (high-res backbones: 48 at (8, 4096, 3, 64), 12 at 2048 px) its serial passes leave the GPU idle, which the
# generalized kernels' two-level scan does not.
DELTA_DEFAULT_MIN_PROGRAMS = 256


def delta_rule_programs(q: torch.Tensor) -> int:
    """The programs of the delta rule's serial passes for q ``[B, T, H, K]`` (V taken as K)."""
    return q.shape[0] * q.shape[2] * -(-q.shape[-1] // delta_value_block(q.shape[-1], q.shape[-1]))


def on_delta_rule(q: torch.Tensor, by_default: bool = False) -> bool:
    """Whether an op runs on the delta rule's kernels: under ``HDLA_VISION_KERNELS=delta`` (utils.py) the HDLA ops
    and the seed mixers whose step is a product of delta steps (``layers/seed.py``), and under ``auto`` (the
    default) the callers that take them ``by_default``, for 16-bit q (the inputs they were timed faster on; fp32
    takes their exact products, not yet timed) of at least :data:`DELTA_DEFAULT_MIN_PROGRAMS` serial programs.
    Triton runs, q is fp32 / bf16 / fp16 and its head dim fits their one K tile; never inside an ONNX export."""
    family = kernel_family()
    chosen = family == "delta" or (by_default and family == "auto" and q.dtype in (torch.bfloat16, torch.float16)
                                   and delta_rule_programs(q) >= DELTA_DEFAULT_MIN_PROGRAMS)
    return (chosen and use_triton(q) and q.dtype != torch.float64 and q.shape[-1] <= DELTA_MAX_HEAD_DIM
            and not exporting_to_onnx())


def delta_rule_hdla(q, k, v, beta, g, scale: float, initial_state, reverse: bool):
    """HDLA through the delta rule over two steps per token (kernels/README.md §2, §12): ``(o, final state fp32)``,
    the signature of :func:`exportable_hdla`. Reversed, the tokens are flipped before they become steps (each
    token's two steps keep their order)."""
    return chunk_token_steps(hdla_steps, 2, (q, k, v, beta, g), scale, initial_state, True, reverse)


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
        return chunk_generalized_op(q, k, v, a, b, g, _scale(scale), initial_state, output_final_state, reverse,
                                    _generalized_path(q, k, a, g.dim() == 3))[:2]

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
    if on_delta_rule(q):
        o, state = delta_rule_hdla(q, k, v, beta, g, _scale(scale), initial_state, reverse)
        return o, _final(state, q, output_final_state)
    recurrent = use_recurrence(q, k, v, beta, g, initial_state)  # the token recurrence (README §11)

    def op(q, k, v, beta, g, initial_state):
        if recurrent:
            return fused_recurrent_hdla_op(q, k, v, beta, g, _scale(scale), initial_state, reverse)
        return chunk_hdla_op(q, k, v, beta, g, _scale(scale), initial_state, output_final_state, reverse,
                             _hdla_path(q))[:2]

    o, state = per_batch_slice(op, dict(q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state), q.shape[2])
    return o, _final(state, q, output_final_state)


# ----------------------------------------------------------------------------- both directions
def _per_batch_slice_directions(op, shared: dict, stacked: dict, heads: int):
    """``op(**shared, **stacked) -> (y [B, ...], state [2, B, ...] or [0])`` run on batch slices of at
    most ``MAX_GRID_BATCH_HEADS / 2`` batch-heads (the fused kernels put both directions' ``2 B H``
    programs on one grid axis) and concatenated; ``stacked`` tensors have the batch at dim 1."""
    batch = next(iter(shared.values())).shape[0]
    slices = batch_slices(batch, heads, MAX_GRID_BATCH_HEADS // 2)
    if len(slices) == 1:
        return op(**shared, **stacked)
    parts = [op(**{n: x[s] for n, x in shared.items()}, **{n: None if x is None else x[:, s] for n, x in stacked.items()})
             for s in slices]
    y = torch.cat([p[0] for p in parts])
    return y, (torch.cat([p[1] for p in parts], dim=1) if parts[0][1].numel() else parts[0][1])


def chunk_hdla_bidirectional(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Both scan directions of HDLA (:func:`chunk_hdla`) in one op, as the vision mixers sum them
    (kernels/README.md §9)::

        y = chunk_hdla(q, k, v, beta[0], g[0], scale)[0]                 # t = 0 .. T-1
          + chunk_hdla(q, k, v, beta[1], g[1], scale, reverse=True)[0]   # t = T-1 .. 0
          - scale * (q . k) v                                            # the own write, counted once

    Where the op runs the chunk64 kernels (CUDA or the interpreter; by default from 576 tokens on, or
    with ``HDLA_VISION_KERNELS=chunk64``) every launch covers both directions and y is written once;
    elsewhere it is computed as written above.

    Args:
        q, k: ``[B, T, H, K]`` (k L2-normalised), v: ``[B, T, H, V]``, shared by both directions.
        beta: ``[2, B, T, H]``, g: ``[2, B, T, H, K]``: index 0 the forward scan's, 1 the reversed scan's.
        scale: output scale (None: 1).
        initial_state: ``[2, B, H, K, V]`` or None: the state before the forward scan's first token
            (t = 0) and before the reversed scan's first token (t = T-1).
        output_final_state: also return both final states.

    Returns:
        ``(y [B, T, H, V] in q's dtype, final_state [2, B, H, K, V] or None)``.

    DTYPES and LOG-DECAY as :func:`chunk_hdla`; a bad shape, dtype or device raises ValueError naming
    the argument before anything runs.
    """
    check_hdla_bidirectional_inputs(q, k, v, beta, g, initial_state, scale)
    if on_delta_rule(q) or exporting_to_onnx():  # each direction on its own, summed as the docstring writes it
        one_direction = delta_rule_hdla if on_delta_rule(q) else exportable_hdla
        parts = [one_direction(q, k, v, beta[d], g[d], _scale(scale), direction(initial_state, d), d == 1)
                 for d in (0, 1)]
        y = parts[0][0] + parts[1][0] - own_write(q, k.unsqueeze(-2), v.unsqueeze(-2), _scale(scale)).to(q.dtype)
        return y, _final(torch.stack([parts[0][1], parts[1][1]]), q, output_final_state)

    recurrent = use_recurrence(q, k, v, beta, g, initial_state, directions=2)  # the token recurrence (README §11)

    def op(q, k, v, beta, g, initial_state):
        if recurrent:
            return fused_recurrent_hdla_bidirectional_op(q, k, v, beta, g, _scale(scale), initial_state)
        return chunk_hdla_bidirectional_op(q, k, v, beta, g, _scale(scale), initial_state, output_final_state,
                                           _hdla_path(q))[:2]

    y, state = _per_batch_slice_directions(op, dict(q=q, k=k, v=v), dict(beta=beta, g=g, initial_state=initial_state),
                                           q.shape[2])
    return y, _final(state, q, output_final_state)


def chunk_generalized_bidirectional(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Both scan directions of the generalized op (:func:`chunk_generalized`) in one op, as the vision
    mixers sum them (kernels/README.md §9): with ``X_d`` direction d's slice of a stacked input (the
    input itself where shared)::

        y = chunk_generalized(q, k_0, v_0, a_0, b_0, g[0], scale)[0]
          + chunk_generalized(q, k_1, v_1, a_1, b_1, g[1], scale, reverse=True)[0]
          - scale * sum_l (q . k_1[..., l, :]) v_1[..., l, :]            # the reversed scan's own write

    Args:
        q: ``[B, T, H, K]``, shared.
        k: ``[B, T, H, r_kv, K]``, v: ``[B, T, H, r_kv, V]``, a, b: ``[B, T, H, r_ab, K]``: each shared by
            both directions, or stacked ``[2, ...]`` (index 0 the forward scan's, 1 the reversed scan's).
        g: ``[2, B, T, H, K]`` or ``[2, B, T, H]`` (a decay per head), per direction.
        scale, initial_state ``[2, B, H, K, V]``, output_final_state: as :func:`chunk_hdla_bidirectional`.

    Returns:
        ``(y [B, T, H, V] in q's dtype, final_state [2, B, H, K, V] or None)``.

    DTYPES and LOG-DECAY as :func:`chunk_generalized`; a bad shape, dtype or device raises ValueError
    naming the argument before anything runs.
    """
    check_generalized_bidirectional_inputs(q, k, v, a, b, g, initial_state, scale)
    if exporting_to_onnx():
        stacked = {n: per_direction(x, 5) for n, x in dict(k=k, v=v, a=a, b=b).items()}
        parts = [exportable_generalized(q, direction(k, d, stacked["k"]), direction(v, d, stacked["v"]),
                                        direction(a, d, stacked["a"]), direction(b, d, stacked["b"]), g[d],
                                        _scale(scale), direction(initial_state, d), d == 1) for d in (0, 1)]
        own = own_write(q, direction(k, 1, stacked["k"]), direction(v, 1, stacked["v"]), _scale(scale))
        y = parts[0][0] + parts[1][0] - own.to(q.dtype)
        return y, _final(torch.stack([parts[0][1], parts[1][1]]), q, output_final_state)

    def op(q, k, v, a, b, g, initial_state):
        return chunk_generalized_bidirectional_op(q, k, v, a, b, g, _scale(scale), initial_state, output_final_state,
                                                  generalized_bidirectional_path(q, k, a, g))[:2]

    shared = dict(q=q)
    stacked = dict(g=g, initial_state=initial_state)
    for name, x in dict(k=k, v=v, a=a, b=b).items():
        (stacked if per_direction(x, 5) else shared)[name] = x
    y, state = _per_batch_slice_directions(op, shared, stacked, q.shape[2])
    return y, _final(state, q, output_final_state)
