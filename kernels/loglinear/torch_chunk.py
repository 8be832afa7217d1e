"""Log-linear attention in one chunk form (PyTorch, autograd backward): the path of calls without a cache (CPU and
CUDA; kernels/loglinear/chunk.py's ``PATH_ENV``).

With chunks of ``C = 2^c`` tokens that start at multiples of C (absolute positions), every pair ``s <= t`` of one
chunk has ``level(t, s) = bit_length(t XOR s) <= c`` and every pair across chunks ``n > m`` has
``c + bit_length(n XOR m)`` (kernels/README.md §7). So the output splits in two (log-linear paper eq. 4-5
on the chunk form of kernels/README.md §3):

- within the chunk, the linear op's attention matrix over the chunk's written values, ``M_o``
  (:func:`~hdla_vision.kernels.generalized.torch_chunk.chunk_terms`), times the hierarchical mask
  ``Lambda[t, s] = lambda_t^(level(t, s))``: ``O_local = (M_o * Lambda) V``;
- across chunks, the levels of the decoding form of kernels/README.md §7 on chunk indices: level ``j >= 1``
  entering chunk ``n`` holds the chunks ``m`` with ``bit_length(n XOR m) = j`` (the earlier half of the aligned
  block of ``2^j`` chunks whose later half holds ``n``), carried to the chunk's start; each token reads level ``j``
  through the chunk's own transitions, ``q_eff S^(j)``, with the weight ``lambda_t^(c + j)``. Every level takes
  the same chunk maps, so the earlier half's state and the maps across the later half double over aligned
  segments of chunks (:func:`_across_chunks`).

Levels ``>= L - 1`` read with the last weight, as in :mod:`.chunk`. The chunk-local work of one linear op and
``log2(T / C)`` steps of batched products, instead of :mod:`.chunk`'s ``O(log T)`` linear-op calls. Without a
cache, at any offset (a call that does not start on the grid's chunk boundary starts early with identity tokens);
the final Fenwick state is not formed (the callers keep the per-level path for it and for a cache).
"""
import torch

from ..generalized.torch_chunk import CHUNK, chunk_terms, solve_unit_lower
from ..utils import check_log_decay


def intra_levels(chunk: int, device=None) -> torch.Tensor:
    """``level(t, s) = bit_length(t XOR s)`` within a chunk aligned to its size: ``[C, C]`` int64 (every pair,
    the causal mask is the callers'), on ``device`` by tensor ops (no per-call Python table): ``bit_length(x)``
    counts the powers of two ``<= x``."""
    tok = torch.arange(chunk, device=device)
    pairs = tok[:, None] ^ tok[None, :]
    powers = 1 << torch.arange(max(chunk - 1, 1).bit_length(), device=device)
    return (pairs[..., None] >= powers).sum(-1)


def _lead_padded(x: torch.Tensor, lead: int) -> torch.Tensor:
    """``lead`` all-zero tokens before ``x [B, T, ...]`` (identity steps: no write, no decay, no read)."""
    return torch.cat([x.new_zeros(x.shape[0], lead, *x.shape[2:]), x], dim=1) if lead else x


def chunk_form_loglinear(q, k, v, a, b, g, level_scales, scale=None, offset: int = 0,
                         chunk_size: int = CHUNK) -> torch.Tensor:
    """Log-linear generalized attention without a cache: ``o [B, T, H, V]`` in q's dtype (computed in fp32, float64
    for float64 q). Shapes as :func:`~hdla_vision.kernels.chunk_loglinear_generalized` (``k, v`` with the rank axis;
    ``a, b [B, T, H, r_ab, K]``, empty at rank 0; ``g [B, T, H, K]`` or ``[B, T, H]``; ``level_scales [B, T, H, L]``);
    ``offset`` the absolute position of token 0 (the call starts ``offset mod C`` identity tokens early, so that
    its chunks sit on the grid); ``chunk_size`` a power of two."""
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if not torch.compiler.is_compiling():  # a data-dependent branch: the linear ops check inside their custom op
        check_log_decay(g)  # as the linear ops do (CPU tensors)
    lead = offset % chunk_size
    q, k, v, a, b, g, level_scales = (_lead_padded(x, lead) for x in (q, k, v, a, b, g, level_scales))
    terms = chunk_terms(q, k, v, a, b, g, scale, chunk_size, solve_unit_lower, mixing=True)
    o = loglinear_from_terms(terms, level_scales, offset // chunk_size)[:, lead:].to(q.dtype)
    if a.shape[-2] == 0:  # zero-size a, b get (empty) gradients, as the linear ops give them
        o = o + (a.sum() + b.sum()).to(o.dtype)
    return o


def loglinear_from_terms(terms, level_scales: torch.Tensor, first: int, across=None) -> torch.Tensor:
    """``o [B, T', H, V]`` (compute dtype) of the chunk form from each chunk's terms (:class:`ChunkTerms` with
    ``mixing``) and the level weights ``level_scales [B, T', H, L]`` of the same (grid-aligned) tokens; ``first``
    the first chunk's index on the grid. Within a chunk ``(M_o * Lambda) V``, across chunks ``across`` (default
    :func:`_across_chunks`; called as it is, its result ``[B, H, N, C, V]``)."""
    batch, heads, n_chunks, c = terms.q_eff.shape[:4]
    num_levels = level_scales.shape[-1]
    compute = terms.q_eff.dtype
    lam = level_scales.to(compute).transpose(1, 2)  # [B, H, T, L]
    lam = torch.nn.functional.pad(lam, [0, 0, 0, n_chunks * c - lam.shape[2]]).reshape(batch, heads, n_chunks, c, -1)
    within = intra_levels(c, lam.device).clamp(max=num_levels - 1)  # [C, C]
    mask = lam.gather(-1, within.expand(batch, heads, n_chunks, c, c))  # [B, H, N, C (t), C (s)]
    r_kv = terms.mixing.shape[-1] // c
    mask = mask.repeat_interleave(r_kv, dim=-1)  # columns token-major, rank fastest, as M_o's
    o = (terms.mixing * mask) @ terms.v_flat  # [B, H, N, C, V]
    if n_chunks > 1:
        o = o + (across or _across_chunks)(terms, lam, num_levels, c.bit_length() - 1, first)
    return terms.unchunk(o)


def _across_chunks(terms, lam: torch.Tensor, num_levels: int, log_chunk: int, first: int) -> torch.Tensor:
    """The reads of earlier chunks' writes, ``[B, H, N, C, V]``, level by level through aligned segments of chunks
    (``first`` the call's first chunk on the grid). With ``P_n = diag(decay_n) - s_trans_n`` chunk ``n``'s map and
    ``C_n = s_add_n`` its write, level ``j`` entering a chunk ``n`` of the later half of its aligned block of ``2^j``
    chunks is ``Pre(n) X``: ``X`` the earlier half's state from zero (its segment state), ``Pre(n)`` the product of
    the maps from the later half's start to ``n`` (exclusive). Both double from one chunk (segments of ``L`` to
    ``2L``): ``Seg' = Map_2 Seg_1 + Seg_2``, ``Map' = Map_2 Map_1``, and for the later half ``Pre' = Pre Map_1``,
    carried on the query side (``q_eff Pre``) so that no per-chunk ``K x K`` product is kept. ``log2`` of the
    chunks' span steps of batched products, no loop over chunks."""
    batch, heads, n_chunks, c, dk = terms.q_eff.shape
    n_levels = ((first + n_chunks - 1) ^ first).bit_length()  # chunk levels 1 .. J met within the call
    span = 1 << n_levels
    front = first % span  # identity chunks before the first, so that the call sits on the grid's blocks of 2^J
    total = -(-(front + n_chunks) // span) * span
    pad = [0, 0] * 2 + [front, total - front - n_chunks]  # the chunk axis of [B, H, N, X, Y]
    eye = torch.eye(dk, dtype=terms.q_eff.dtype, device=terms.q_eff.device)
    maps = terms.decay * eye  # diag(decay): [B, H, N, K, K]
    if terms.s_trans is not None:
        maps = maps - terms.s_trans
    maps = torch.nn.functional.pad(maps - eye, pad) + eye  # padding chunks: the identity map
    segs = torch.nn.functional.pad(terms.s_add, pad)
    queries = torch.nn.functional.pad(terms.q_eff, pad)  # q_eff Pre, Pre = I within one chunk
    weight_of = (log_chunk + torch.arange(1, n_levels + 1, device=lam.device)).clamp(max=num_levels - 1)
    weights = torch.nn.functional.pad(lam[..., weight_of], pad)  # [B, H, N', C, J]: token t's weight of level j
    out = queries.new_zeros(batch, heads, total, c, terms.s_add.shape[-1])
    for level in range(1, n_levels + 1):
        half = 1 << (level - 1)  # segments of `half` chunks, paired into blocks of 2 half
        pairs = total // (2 * half)
        segs2 = segs.reshape(batch, heads, pairs, 2, *segs.shape[-2:])
        maps2 = maps.reshape(batch, heads, pairs, 2, dk, dk)
        queries2 = queries.reshape(batch, heads, pairs, 2, half, c, dk)
        reads = queries2[:, :, :, 1] @ segs2[:, :, :, :1]  # the later half reads the earlier half's state
        reads = reads * weights.reshape(batch, heads, pairs, 2, half, c, n_levels)[:, :, :, 1, ..., level - 1:level]
        out = out + torch.stack([torch.zeros_like(reads), reads], dim=3).reshape(out.shape)
        later = queries2[:, :, :, 1] @ maps2[:, :, :, :1]  # Pre' = Pre Map_1 on the later half
        queries = torch.stack([queries2[:, :, :, 0], later], dim=3).reshape(queries.shape)
        segs = maps2[:, :, :, 1] @ segs2[:, :, :, 0] + segs2[:, :, :, 1]
        maps = maps2[:, :, :, 1] @ maps2[:, :, :, 0]
    return out[:, :, front:front + n_chunks]
