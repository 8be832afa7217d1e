"""Log-linear attention in one chunk form (PyTorch, autograd backward): the path for CPU tensors.

With chunks of ``C = 2^c`` tokens that start at multiples of C (absolute positions), every pair ``s <= t`` of one
chunk has ``level(t, s) = bit_length(t XOR s) <= c`` and every pair across chunks ``n > m`` has
``c + bit_length(n XOR m)`` (kernels/README.md §7). So the output splits in two (log-linear paper eq. 4-5
on the chunk form of kernels/README.md §3):

- within the chunk, the linear op's attention matrix over the chunk's written values, ``M_o``
  (:func:`~hdla_vision.kernels.generalized.torch_chunk.chunk_terms`), times the hierarchical mask
  ``Lambda[t, s] = lambda_t^(level(t, s))``: ``O_local = (M_o * Lambda) V``;
- across chunks, a Fenwick tree over the chunks' own writes ``C_m = s_add``: entering chunk ``n`` of the grid
  (after the call's first) the levels ``0 .. z`` merge into ``z + 1`` (``z`` the lowest set bit of ``n``), so
  that level ``j >= 1`` holds the chunks ``m`` with ``bit_length(n XOR m) = j`` carried to the chunk's start
  (the decoding form of kernels/README.md §7 on chunk indices); each token reads level
  ``j`` through the chunk's own transitions, ``q_eff S^(j)``, with the weight ``lambda_t^(c + j)``; then
  every level takes the chunk's transition ``S <- decay * S - s_trans S`` (the same for all: a carry
  only sums states) and level 0 becomes ``C_n``.

Levels ``>= L - 1`` read with the last weight, as in :mod:`.chunk`. ``O(T C + T/C log(T/C))`` state
products instead of :mod:`.chunk`'s ``O(log T)`` linear-op calls. Without a cache, at any offset (a call that
does not start on the grid's chunk boundary starts early with identity tokens); the final Fenwick state is not
formed (the callers keep the per-level path for it and for a cache).
"""
import torch

from ..generalized.torch_chunk import CHUNK, chunk_terms, solve_unit_lower
from ..utils import check_log_decay


def intra_levels(chunk: int, device=None) -> torch.Tensor:
    """``level(t, s) = bit_length(t XOR s)`` within a chunk aligned to its size: ``[C, C]`` int64 (every pair,
    the causal mask is the callers')."""
    return torch.tensor([[(t ^ s).bit_length() for s in range(chunk)] for t in range(chunk)], device=device)


def merge_matrices(n_chunks: int, n_levels: int, dtype, device=None, first: int = 0) -> torch.Tensor:
    """``[N, J + 1, J + 1]``: row ``n`` maps the levels leaving chunk ``n - 1`` to those entering chunk ``n`` of a
    call whose first chunk is chunk ``first`` of the grid (levels ``0 .. z`` summed into ``z + 1``, ``z`` the
    lowest set bit of ``first + n``; identity at ``n = 0``, where every level is still empty)."""
    eye = torch.eye(n_levels + 1, dtype=dtype, device=device)
    mats = [eye]
    for n in range(first + 1, first + n_chunks):
        z = (n & -n).bit_length() - 1
        merge = eye.clone()
        merge[z + 1, : z + 1] = 1.0
        merge[: z + 1] = 0.0
        mats.append(merge)
    return torch.stack(mats)


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
        o = o + _across_chunks(terms, lam, num_levels, c.bit_length() - 1, offset // chunk_size)
    o = terms.unchunk(o)[:, lead:].to(q.dtype)
    if a.shape[-2] == 0:  # zero-size a, b get (empty) gradients, as the linear ops give them
        o = o + (a.sum() + b.sum()).to(o.dtype)
    return o


def _across_chunks(terms, lam: torch.Tensor, num_levels: int, log_chunk: int, first: int) -> torch.Tensor:
    """The reads of earlier chunks' writes, ``[B, H, N, C, V]``, by the Fenwick tree over chunks ``first ..
    first + N - 1`` of the grid."""
    batch, heads, n_chunks, c, dk = terms.q_eff.shape
    dv = terms.s_add.shape[-1]
    n_levels = ((first + n_chunks - 1) ^ first).bit_length()  # chunk levels 1 .. J met within the call
    merges = merge_matrices(n_chunks, n_levels, lam.dtype, lam.device, first)
    weight_of = (log_chunk + torch.arange(1, n_levels + 1, device=lam.device)).clamp(max=num_levels - 1)
    weights = lam[..., weight_of]  # [B, H, N, C, J]: token t's weight of chunk level j
    state = terms.q_eff.new_zeros(batch, heads, n_levels + 1, dk, dv)
    trans = [None] * n_chunks if terms.s_trans is None else terms.s_trans.unbind(2)
    entering = []  # the levels 1 .. J entering each chunk; read after the loop, in one product
    for n, (decay, add, tr) in enumerate(zip(terms.decay.unbind(2), terms.s_add.unbind(2), trans)):
        state = torch.einsum("ij,bhjkv->bhikv", merges[n], state)
        entering.append(state[:, :, 1:])
        nxt = decay.unsqueeze(2) * state
        if tr is not None:
            nxt = nxt - tr.unsqueeze(2) @ state
        state = torch.cat([add.unsqueeze(2), nxt[:, :, 1:]], dim=2)  # level 0 is empty after the merge
    levels = torch.stack(entering, dim=2)  # [B, H, N, J, K, V]
    return torch.einsum("bhnck,bhnjkv,bhncj->bhncv", terms.q_eff, levels, weights)
