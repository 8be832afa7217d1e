"""The chunk terms the delta rule's backward reads from its forward (kernels/README.md §12), as views of one fp32
buffer: the custom op (``custom_ops.chunk_delta_rule_op``) returns that buffer as one tensor, and its fake
implementation needs only its size (no Triton import).

    gcum  [B*H, N*C, BK]   G, the chunk's cumulative log-decay (BK: K up to a power of two, >= 16; one decay per
                           head: [B*H, N*C, 1])
    aqk   [B*H, N, C, C]   scale times the q-k Gram (lower)
    tm    [B*H, N, C, C]   T = (I + A)^-1
    w, kg, qg [B*H, N, C, K]
    gamma [B*H, N, K]      e^{G_C}
    h     [B*H, N, K, V]   the state entering each chunk
    new   [B*H, N, C, V]   U = u~ - w h

With the ``bf16`` and ``bf16_dc`` precisions (chunk.PRECISIONS) the :data:`HALF_TERMS`, which only the state path reads (S, O, dO,
dS: as bf16 tensor-core operands), are stored in bf16, each in half the fp32 elements of its place.

With ``recompute`` the buffer holds h alone (an eighth of the whole at d = 64, a quarter at 128) and the backward
recomputes the rest from the inputs and h (one more launch of the prepare kernel, which then also forms U): the
:data:`STATE_TERMS` are saved, the others live only during a launch sequence.
"""
import math
from typing import Dict, Optional, Sequence, Tuple

import torch

CHUNK = 64  # steps per chunk, of every kernel in chunk.py
STATE_TERMS = ("h",)  # what the recompute mode saves: the serial pass's output, which no parallel kernel remakes
HALF_TERMS = ("aqk", "w", "kg", "qg")  # bf16 under the bf16 precision: read only by the state path's products


def resolved_precision(precision: Optional[str], q: torch.Tensor) -> str:
    """The products' precision of a call (chunk.PRECISIONS): ``precision``, or by default tf32 for 16-bit inputs on
    CUDA and exact fp32 (ieee) otherwise (chunk._settings says why). The fake implementation resolves it here too,
    since the saved buffer's size depends on it (:func:`half_terms`)."""
    return precision or ("tf32" if q.is_cuda and q.dtype != torch.float32 else "ieee")


def half_terms(precision: Optional[str]) -> bool:
    """Whether ``precision`` (resolved: :func:`resolved_precision`) stores the :data:`HALF_TERMS` in bf16."""
    return precision in ("bf16", "bf16_dc")


def padded_head_dim(dk: int) -> int:
    """BK: K rounded up to a power of two, at least 16 (the kernels' K tile)."""
    return max(16, 1 << (dk - 1).bit_length())


def saved_layout(batch: int, seq_len: int, heads: int, dk: int, dv: int, scalar: bool = False,
                 terms: Optional[Sequence[str]] = None) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """``(name, shape)`` of each term, in the buffer's order; ``scalar``: one log-decay per head; ``terms``: only
    these (None: all)."""
    bh, n_chunks, bk = batch * heads, -(-seq_len // CHUNK), padded_head_dim(dk)
    per_row = lambda width: (bh, n_chunks, CHUNK, width)  # noqa: E731
    layout = (("gcum", (bh, n_chunks * CHUNK, 1 if scalar else bk)), ("aqk", per_row(CHUNK)), ("tm", per_row(CHUNK)),
              ("w", per_row(dk)), ("kg", per_row(dk)), ("qg", per_row(dk)), ("gamma", (bh, n_chunks, dk)),
              ("h", (bh, n_chunks, dk, dv)), ("new", per_row(dv)))
    return tuple(term for term in layout if terms is None or term[0] in terms)


# the terms the recompute mode remakes in the backward: all but STATE_TERMS
RECOMPUTED_TERMS = tuple(name for name, _ in saved_layout(1, 1, 1, 1, 1) if name not in STATE_TERMS)


def saved_terms(recompute: bool) -> Optional[Tuple[str, ...]]:
    """The terms of the saved buffer (None: all)."""
    return STATE_TERMS if recompute else None


def _fp32_numel(name: str, shape: Tuple[int, ...], half: bool) -> int:
    """The fp32 elements a term takes in the buffer (a bf16 term half its elements, an even count: C rows per
    chunk)."""
    return math.prod(shape) // (2 if half and name in HALF_TERMS else 1)


def saved_numel(batch: int, seq_len: int, heads: int, dk: int, dv: int, scalar: bool = False,
                terms: Optional[Sequence[str]] = None, half: bool = False) -> int:
    """The buffer's length (fp32 elements) for ``terms`` (None: all); ``half``: the :data:`HALF_TERMS` in bf16."""
    return sum(_fp32_numel(name, shape, half)
               for name, shape in saved_layout(batch, seq_len, heads, dk, dv, scalar, terms))


def carve(buffer: torch.Tensor, batch: int, seq_len: int, heads: int, dk: int, dv: int,
          scalar: bool = False, terms: Optional[Sequence[str]] = None, half: bool = False) -> Dict[str, torch.Tensor]:
    """The terms (None: all) as contiguous views of ``buffer`` (``[saved_numel(...)]`` fp32); ``half``: the
    :data:`HALF_TERMS` as bf16 views."""
    views, start = {}, 0
    for name, shape in saved_layout(batch, seq_len, heads, dk, dv, scalar, terms):
        size = _fp32_numel(name, shape, half)
        region = buffer[start:start + size]
        views[name] = (region.view(torch.bfloat16) if size < math.prod(shape) else region).view(shape)
        start += size
    return views
