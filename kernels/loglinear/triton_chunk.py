"""Log-linear attention's forward on the linear op's chunk kernels, for calls no gradient flows through
(kernels/README.md §7; the path of :func:`.torch_chunk.chunk_form_loglinear`'s callers in inference).

The chunk form needs each chunk's terms: the reads of the entering state ``Q_eff``, the chunk's attention matrix
over its own writes ``M_o``, and its state step ``S_C = gamma * S_0 - N S_0 + Cc``. The linear op's F1 kernel
(:func:`~hdla_vision.kernels.generalized.fwd.chunk_prepare`) computes exactly these, in registers and without
the ``[C, C, K]`` pairwise decays the PyTorch terms materialise, and HDLA's from (k, beta, lambda) directly. The
log-linear part is then :func:`.torch_chunk.loglinear_from_terms`: ``M_o`` times the hierarchical mask within a
chunk, and the Fenwick tree over the chunks' maps and writes across them. No autograd: F1 has no backward of its
own, so a call that needs gradients takes the PyTorch terms.
"""
from typing import Optional

import torch

from ..generalized import fwd
from ..generalized.torch_chunk import ChunkTerms
from ..utils import check_log_decay, chunk64_supports_ranks, needs_grad, use_triton
from .torch_chunk import _lead_padded, loglinear_from_terms


def triton_terms_apply(q: torch.Tensor, r_kv: int, r_ab: int, *tensors: Optional[torch.Tensor]) -> bool:
    """Whether a log-linear call takes :func:`triton_chunk_form_loglinear`: Triton runs q's device, the ranks fit
    the chunk kernels, no input needs a gradient, and no ``torch.compile`` trace is running (F1's launch code is
    not traceable)."""
    if not use_triton(q) or not chunk64_supports_ranks(r_kv, r_ab) or q.dtype == torch.float64:
        return False
    if torch.compiler.is_compiling():
        return False
    return not needs_grad(q, *tensors)


def triton_chunk_form_loglinear(q, k, v, a, b, g, level_scales, scale=None, offset: int = 0,
                                hdla_beta: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``o [B, T, H, V]`` in q's dtype, as :func:`.torch_chunk.chunk_form_loglinear` (no gradient). Generalized:
    ``k [B, T, H, r_kv, K]``, ``v [B, T, H, r_kv, V]``, ``a, b [B, T, H, r_ab, K]``; HDLA (``hdla_beta [B, T, H]``):
    ``k [B, T, H, K]``, ``v [B, T, H, V]``, ``a = b = None``. ``g [B, T, H, K]`` or ``[B, T, H]``,
    ``level_scales [B, T, H, L]``; ``offset`` the absolute position of token 0 (``offset mod C`` identity tokens
    run first, so that the chunks sit on the grid)."""
    check_log_decay(g)  # as the other paths do (CPU tensors)
    hdla = hdla_beta is not None
    r_kv = 1 if hdla else k.shape[3]
    r_ab = 2 if hdla else a.shape[3]
    chunk = fwd.planned_chunk(r_ab, r_kv, q.shape[-1], v.shape[-1], g.dim() == 3, hdla, q.dtype)
    lead = offset % chunk
    q, k, v, a, b, g, hdla_beta, level_scales = (None if x is None else _lead_padded(x, lead)
                                                 for x in (q, k, v, a, b, g, hdla_beta, level_scales))
    with torch.no_grad():
        prep = fwd.chunk_prepare(q, k, v, a, b, g, 1.0 if scale is None else float(scale), False,
                                 hdla_beta=hdla_beta, chunk=chunk)
        o = loglinear_from_terms(prep_terms(prep, v, r_kv), level_scales, offset // prep["chunk"])
    return o[:, lead:].to(q.dtype)


def prep_terms(prep: dict, v: torch.Tensor, r_kv: int) -> ChunkTerms:
    """F1's outputs as the chunk form's :class:`ChunkTerms` (fp32, ``mixing`` = M_o); ``v`` the values of the
    call (``[B, T, H, V]`` at r_kv = 1 without a rank axis, else ``[B, T, H, r_kv, V]``)."""
    batch, heads, n_chunks, c = prep["Mo"].shape[:4]
    seq_len, dv = v.shape[1], v.shape[-1]
    values = v.reshape(batch, seq_len, heads, r_kv * dv).float().transpose(1, 2)  # [B, H, T, r_kv V]
    values = torch.nn.functional.pad(values, [0, 0, 0, n_chunks * c - seq_len])
    v_flat = values.reshape(batch, heads, n_chunks, c * r_kv, dv)  # token-major, rank fastest

    def unchunk(x):
        return x.reshape(batch, heads, n_chunks * c, x.shape[-1])[:, :, :seq_len].transpose(1, 2)

    return ChunkTerms(q_eff=prep["Qeff"].float().reshape(batch, heads, n_chunks, c, -1), o_local=None,
                      mixing=prep["Mo"].float(), v_flat=v_flat,
                      s_trans=None if prep["N"] is None else prep["N"].float(), s_add=prep["Cc"],
                      decay=prep["gamma"].unsqueeze(-1), unchunk=unchunk)
