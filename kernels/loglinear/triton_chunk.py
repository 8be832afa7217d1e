"""Log-linear attention's forward on the linear op's chunk kernels, for calls no gradient flows through
(kernels/README.md §7; the path of :func:`.torch_chunk.chunk_form_loglinear`'s callers in inference).

The chunk form needs each chunk's terms: the reads of the entering state ``Q_eff``, the chunk's attention matrix
over its own writes ``M_o``, and its state step ``S_C = gamma * S_0 - N S_0 + Cc``. The linear op's F1 kernel
(:func:`~hdla_vision.kernels.generalized.fwd.chunk_prepare`) computes exactly these, in registers and without
the ``[C, C, K]`` pairwise decays the PyTorch terms materialise, and HDLA's from (k, beta, lambda) directly. The
log-linear part is then :func:`.torch_chunk.loglinear_from_terms`: ``M_o`` times the hierarchical mask within a
chunk, and across chunks either the linear op's own state pass F2 on segments of chunks (:func:`across_by_chains`,
kernels/README.md §7; the default) or, with :data:`ACROSS_ENV` = ``doubling``, the Fenwick tree over the chunks'
maps and writes (``_across_chunks``: ``[K, K]`` maps doubled over aligned segments). No autograd: F1 has no
backward of its own, so a call that needs gradients takes the PyTorch terms.
"""
import os
from typing import Optional

import torch

from ..generalized import fwd
from ..generalized.torch_chunk import ChunkTerms
from ..utils import check_log_decay, chunk64_supports_ranks, needs_grad, use_triton
from .torch_chunk import _lead_padded, loglinear_from_terms

# How the no-gradient path reads earlier chunks' writes: "chains" (the default: :func:`across_by_chains`, F2 per
# level on segments of chunks) or "doubling" (torch_chunk._across_chunks, the PyTorch chunk form's). On an H200
# (benchmarks/README.md, loglinear_ours_chains_1d33a2d.json) the chains were faster at 8 of 11 shapes, up to 1.7x,
# and at most 6% slower at the others.
ACROSS_ENV = "HDLA_VISION_LOGLINEAR_ACROSS"
ACROSS = ("doubling", "chains")


def across_setting() -> str:
    """:data:`ACROSS_ENV` (unset or empty: chains); any other value raises ValueError."""
    value = os.environ.get(ACROSS_ENV, "") or "chains"
    if value not in ACROSS:
        raise ValueError(f"{ACROSS_ENV} must be one of {', '.join(ACROSS)}, got {value!r}")
    return value


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
        across = None
        if across_setting() == "chains":
            def across(terms, lam, num_levels, log_chunk, first):
                return across_by_chains(prep, terms.q_eff, lam, num_levels, log_chunk, first)
        o = loglinear_from_terms(prep_terms(prep, v, r_kv), level_scales, offset // prep["chunk"], across)
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


def across_by_chains(prep: dict, q_eff: torch.Tensor, lam: torch.Tensor, num_levels: int, log_chunk: int,
                     first: int) -> torch.Tensor:
    """The reads of earlier chunks' writes ``[B, H, N, C, V]`` (fp32) from the linear op's state pass on segments.

    Chunk level ``j`` entering chunk ``n`` holds the chunks ``m < n`` with ``bit_length(n XOR m) = j``; the chunks
    with ``bit_length(n XOR m) <= j`` are those before ``n`` in its aligned segment of ``2^j`` chunks, whose state
    ``R_j(n)`` is the linear state chain restarted from zero at every segment start. So level ``j`` is
    ``R_j - R_{j-1}`` (``R_0 = 0``) and, by parts, ``sum_j w_j (R_j - R_{j-1}) = sum_j (w_j - w_{j+1}) R_j`` with
    ``w_{J+1} = 0``: ``o_t = q_eff,t sum_j mu_t,j R_j(n)``, ``mu_j = w_j - w_{j+1}``, ``w_j = lambda_t^(c + j)``
    clamped to the last weight (where two weights are the same level, ``mu_j = 0`` and the chain is skipped).
    ``R_J``, one segment over the whole call, is the linear op's own state. Each ``R_j`` is F2 (the op's state
    pass, :func:`~hdla_vision.kernels.generalized.fwd.chunk_state_pass`) on the chunk axis folded into segments:
    ``log2`` of the call's chunk span state passes, ``[C, K] x [K, V]`` reads, no ``[K, K]`` products.

    ``prep``: F1's outputs on the call's grid-aligned tokens (N chunks from ``first`` on the grid), ``q_eff [B, H,
    N, C, K]``, ``lam [B, H, N, C, L]`` the level weights per token, ``log_chunk`` = c = log2 C."""
    batch, heads, n_chunks, c, _ = q_eff.shape
    n_levels = ((first + n_chunks - 1) ^ first).bit_length()  # chunk levels 1 .. J met within the call
    weight_of = [min(log_chunk + j, num_levels - 1) for j in range(1, n_levels + 1)]
    weights = lam[..., weight_of]  # [B, H, N, C, J]: w_j
    mu = weights - torch.nn.functional.pad(weights[..., 1:], [0, 1])
    queries = q_eff.float()
    out = queries.new_zeros(batch, heads, n_chunks, c, prep["Cc"].shape[-1])
    for j in range(1, n_levels + 1):
        if j < n_levels and weight_of[j - 1] == weight_of[j]:
            continue  # mu_j = 0
        states = segment_states(prep, first, 1 << j)
        out += mu[..., j - 1:j] * (queries @ states.float())
    return out


def segment_states(prep: dict, first: int, segment: int) -> torch.Tensor:
    """``[B, H, N, K, V]``: the state entering each of the call's N chunks (chunk ``i`` at ``first + i`` on the grid)
    from zero at every multiple of ``segment`` chunks on the grid, by F2 on the chunk axis folded into segments
    (padded with identity chunks: no write, identity map) or, where the call starts inside a segment, on the whole
    axis with the last chunk of each segment made a zero map without write (the state after it restarts at zero)."""
    cc, gamma, n_mat = prep["Cc"], prep["gamma"], prep["N"]
    batch, heads, n_chunks = cc.shape[:3]
    front = first % segment
    if front + n_chunks <= segment:  # one segment: the op's own chain
        return fwd.chunk_state_pass(prep)[0]
    if front:
        ends = ((first + torch.arange(n_chunks, device=cc.device) + 1) % segment != 0).to(cc.dtype)
        cut = dict(prep, Cc=cc * ends[:, None, None], gamma=gamma * ends[:, None],
                   N=None if n_mat is None else n_mat * ends[:, None, None].to(n_mat.dtype))
        return fwd.chunk_state_pass(cut)[0]
    total = -(-n_chunks // segment) * segment
    folds = total // segment

    def folded(x, pad_value):  # [B, H, N, ...] -> [B, H * folds, segment, ...], identity chunks at the end
        pad = [0, 0] * (x.dim() - 3) + [0, total - n_chunks]
        return torch.nn.functional.pad(x, pad, value=pad_value).reshape(batch, heads * folds, segment, *x.shape[3:])

    fold = dict(prep, Cc=folded(cc, 0.0), gamma=folded(gamma, 1.0), N=None if n_mat is None else folded(n_mat, 0.0))
    states = fwd.chunk_state_pass(fold)[0]
    return states.reshape(batch, heads, total, *states.shape[3:])[:, :, :n_chunks]
