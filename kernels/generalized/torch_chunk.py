"""Vectorised PyTorch chunk form of the generalized recurrence: the path for CPU tensors.

Same algorithm as the Triton kernel (see ``chunk.py``), written with batched tensor ops so
autograd gives the backward. Within a chunk, with G the inclusive cumulative log-decay,
G' = G - g the exclusive one and X_t = S_{t-1}^T B_t the read of the previous state:

    X = (I + L_AB)^{-1} (Bhat S_0 + L_KB V)                 (paper eq. 13-14, UT form)
    O = Qhat S_0 + M_QK V - M_QA X                           (eq. 18)
    S_C = exp(G_C) * S_0 + Ktil^T V - Atil^T X              (eq. 17)

where every decay factor is exp of a difference G_t - G_i with t >= i, computed pairwise
(never exp(-G), which overflows; kernels/README.md §3).

``g = -inf`` (a full reset): g is clamped at the floor of the compute dtype (``utils.log_zero``),
where exp is exactly 0, so every decay across the reset is exactly 0 and no ``-inf - (-inf)``
appears; the gradient w.r.t. g is 0 there (clamp's). With ``r_ab = 0`` the empty a, b still get
(empty) gradients.
"""
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..utils import log_zero

CHUNK = 16


def _pairwise_decay(g_read: torch.Tensor, g_write: torch.Tensor, strict: bool) -> torch.Tensor:
    """exp(g_read[t] - g_write[i]) for i <= t (i < t if strict), else 0: ``[..., C, C, K]``."""
    c = g_read.shape[-2]
    mask = torch.ones(c, c, dtype=torch.bool, device=g_read.device).tril(-1 if strict else 0)
    diff = g_read.unsqueeze(-2) - g_write.unsqueeze(-3)
    return diff.masked_fill(~mask[..., None], float("-inf")).exp()


def solve_unit_lower(lmat: torch.Tensor, rank: int) -> torch.Tensor:
    """``(I + L)^{-1}`` for ``lmat = L [..., C*r, C*r]`` strictly lower block-triangular over tokens
    (``r = rank`` rows per token; paper eq. 13-14), by ``torch.linalg.solve_triangular``.
    Returns ``[..., C*r, C*r]`` in lmat's dtype. The chunk form's default inverse."""
    eye = torch.eye(lmat.shape[-1], dtype=lmat.dtype, device=lmat.device)
    return torch.linalg.solve_triangular(eye + lmat, eye.expand_as(lmat), upper=False, unitriangular=True)


def doubling_unit_lower(lmat: torch.Tensor, rank: int) -> torch.Tensor:
    """``(I + L)^{-1}`` as :func:`solve_unit_lower` (same shapes), by block doubling made of matrix
    products and selects only, so that ONNX can express it (kernels/README.md §3; the Triton
    kernels' ``_unit_lower_inverse``): with D the inverse restricted to blocks of n tokens and C
    the entries of L between the two halves of each 2n-token block, the 2n-block inverse is
    ``D - D C D``, starting from 2-token blocks where ``[[I, 0], [C, I]]^{-1} = [[I, 0], [-C, I]]``.
    ``log2(C) - 1`` doublings."""
    size = lmat.shape[-1]
    doublings = max(0, (size // rank - 1).bit_length() - 1)  # 2-token blocks doubled until they hold the chunk
    tok = torch.arange(size, device=lmat.device) // rank
    width = 2 ** torch.arange(1, doublings + 2, device=lmat.device)  # block sizes 2, 4, ... tokens
    blk = tok[:, None] // width  # [C*r, levels]: each row's block at each level
    same = (blk[:, None, :] == blk[None, :, :]).unbind(-1)  # levels x [C*r, C*r]: one block of that size
    zero = lmat.new_zeros(())
    inv = torch.eye(size, dtype=lmat.dtype, device=lmat.device) - torch.where(same[0], lmat, zero)
    for level in range(1, doublings + 1):
        cross = same[level] & ~same[level - 1]  # the lower-left quarter of each block of 2^(level+1) tokens
        inv = inv - (inv @ torch.where(cross, lmat, zero)) @ inv
    return inv


UnitLowerInverse = Callable[[torch.Tensor, int], torch.Tensor]


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[..., C, r, D] -> [..., C*r, D]`` (token-major, rank fastest)."""
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def torch_chunk_generalized(
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
    chunk_size: int = CHUNK,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked generalized op in PyTorch; shapes as in :func:`naive_generalized` (g ``[B, T, H, K]``
    or ``[B, T, H]``). Returns ``(o, final state in q's dtype or None)``."""
    o, state = chunk_form(q, k, v, a, b, g, scale, initial_state, reverse, chunk_size)
    return o, (state.to(q.dtype) if output_final_state else None)


def per_channel(g: torch.Tensor, dk: int) -> torch.Tensor:
    """A per-head log-decay ``[B, T, H]`` broadcast over the K key channels (a view, ``[B, T, H, K]``);
    a per-channel ``[B, T, H, K]`` one unchanged."""
    return g.unsqueeze(-1).expand(*g.shape, dk) if g.dim() == 3 else g


def chunk_form(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    reverse: bool = False,
    chunk_size: int = CHUNK,
    inverse: UnitLowerInverse = solve_unit_lower,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk form proper: ``(o [B, T, H, V] in q's dtype, final state [B, H, K, V] in the compute
    dtype)`` (float64 for float64 q, else fp32). g is ``[B, T, H, K]`` or ``[B, T, H]`` (broadcast
    over K here, so autograd sums its gradient back to ``[B, T, H]``). ``inverse(L, r_ab)`` forms
    ``(I + L_AB)^{-1}``: :func:`solve_unit_lower` (default) or :func:`doubling_unit_lower` (ONNX)."""
    if reverse:
        flip = [x.flip(1) for x in (q, k, v, a, b, g)]
        o, s = chunk_form(*flip, scale, initial_state, False, chunk_size, inverse)
        return o.flip(1), s
    terms = chunk_terms(q, k, v, a, b, g, scale, chunk_size, inverse)
    batch, heads, dk, dv = q.shape[0], q.shape[2], q.shape[3], v.shape[-1]
    state_in = terms.q_eff.new_zeros(batch, heads, dk, dv)
    if initial_state is not None:
        state_in = state_in + initial_state.to(state_in.dtype)

    states = []
    state = state_in
    # unbind: one node per tensor in a traced graph (ONNX export), not a slice per chunk
    trans = [None] * terms.q_eff.shape[2] if terms.s_trans is None else terms.s_trans.unbind(2)
    for decay, add, tr in zip(terms.decay.unbind(2), terms.s_add.unbind(2), trans):
        states.append(state)
        nxt = decay * state + add
        if tr is not None:
            nxt = nxt - tr @ state
        state = nxt
    starts = torch.stack(states, dim=2)  # state entering each chunk
    o = terms.q_eff @ starts + terms.o_local  # [B, H, N, C, V]
    o = terms.unchunk(o).to(q.dtype)
    if a.shape[-2] == 0:
        o, state = _attach_empty((a, b), o, state)
    return o, state


class ChunkTerms(NamedTuple):
    """What the chunk form needs of each chunk's own inputs (compute dtype; N chunks of C tokens):

    q_eff ``[B, H, N, C, K]``: the reads of the entering state, ``O = q_eff S_0 + o_local``;
    o_local ``[B, H, N, C, V]``: the chunk's own contribution ``M_o V`` (None with ``mixing``);
    mixing ``[B, H, N, C, C r_kv]``: ``M_o = M_QK - M_QA (I + L_AB)^{-1} L_KB`` itself (with ``mixing=True``), the
        chunk's attention matrix over its written values (token-major, rank fastest), ``v_flat`` its right side;
    v_flat ``[B, H, N, C r_kv, V]``; s_trans ``[B, H, N, K, K]`` (None at r_ab = 0), s_add ``[B, H, N, K, V]`` and
    decay ``[B, H, N, K, 1]``: the state step ``S_C = decay * S_0 - s_trans S_0 + s_add``;
    unchunk: ``[B, H, N, C, V]`` -> ``[B, T, H, V]`` (the padding dropped)."""
    q_eff: torch.Tensor
    o_local: Optional[torch.Tensor]
    mixing: Optional[torch.Tensor]
    v_flat: torch.Tensor
    s_trans: Optional[torch.Tensor]
    s_add: torch.Tensor
    decay: torch.Tensor
    unchunk: Callable[[torch.Tensor], torch.Tensor]


def chunk_terms(q, k, v, a, b, g, scale, chunk_size, inverse=solve_unit_lower, mixing=False) -> ChunkTerms:
    """Each chunk's terms of the chunk form (:class:`ChunkTerms`), forward order, shapes as :func:`chunk_form`;
    with ``mixing`` the matrix ``M_o`` instead of its product with V (log-linear attention masks it)."""
    g = per_channel(g, q.shape[-1])
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = g.to(compute).clamp(min=log_zero(compute))  # g = -inf: exactly the reset, no NaN (module docstring)
    batch, seq_len, heads, dk = q.shape
    r_kv, r_ab = v.shape[-2], a.shape[-2]
    scale = 1.0 if scale is None else scale
    c = chunk_size
    n = -(-seq_len // c)
    pad = n * c - seq_len

    def prep(x):  # [B, T, H, ...] -> [B, H, N, C, ...], zero-padded (padding tokens are identity steps)
        x = x.to(compute).transpose(1, 2)
        x = F.pad(x, [0, 0] * (x.dim() - 3) + [0, pad])
        return x.reshape(batch, heads, n, c, *x.shape[3:])

    def unchunk(x):
        return x.reshape(batch, heads, n * c, x.shape[-1])[:, :, :seq_len].transpose(1, 2)

    q, k, v, a, b, g = (prep(x) for x in (q * scale, k, v, a, b, g))
    G = g.cumsum(-2)
    Gp = G - g
    e_post = _pairwise_decay(G, G, strict=False)  # [B, H, N, C, C, K]
    m_qk = torch.einsum("...sk,...stk,...trk->...str", q, e_post, k)
    m_qk = m_qk.reshape(*m_qk.shape[:-2], c * r_kv)
    q_hat = q * G.exp()
    decay_last = (G[..., -1:, :] - G).exp()  # exp(G_C - G_i)
    k_til = _flat(k * decay_last.unsqueeze(-2))
    v_flat = _flat(v)
    m_o = None
    if r_ab > 0:
        e_pre = _pairwise_decay(Gp, G, strict=True)
        l_ab = torch.einsum("...srk,...stk,...tpk->...srtp", b, e_pre, a).reshape(batch, heads, n, c * r_ab, c * r_ab)
        l_kb = torch.einsum("...srk,...stk,...tpk->...srtp", b, e_pre, k).reshape(batch, heads, n, c * r_ab, c * r_kv)
        m_qa = torch.einsum("...sk,...stk,...tpk->...stp", q, e_post, a).reshape(batch, heads, n, c, c * r_ab)
        solve = inverse(l_ab, r_ab)
        b_hat = _flat(b * Gp.exp().unsqueeze(-2))
        wx = solve @ b_hat  # X = wx S_0 + u
        a_til = _flat(a * decay_last.unsqueeze(-2))
        q_eff = q_hat - m_qa @ wx
        s_trans = a_til.transpose(-1, -2) @ wx  # S_C = exp(G_C) S_0 - s_trans S_0 + s_add
        if mixing:
            u_mix = solve @ l_kb  # U = u_mix V
            m_o = m_qk - m_qa @ u_mix
            s_add = (k_til.transpose(-1, -2) - a_til.transpose(-1, -2) @ u_mix) @ v_flat
            o_local = None
        else:
            u = solve @ (l_kb @ v_flat)
            o_local = m_qk @ v_flat - m_qa @ u
            s_add = k_til.transpose(-1, -2) @ v_flat - a_til.transpose(-1, -2) @ u
    else:
        q_eff, s_trans = q_hat, None
        m_o, o_local = (m_qk, None) if mixing else (None, m_qk @ v_flat)
        s_add = k_til.transpose(-1, -2) @ v_flat
    decay = G[..., -1, :].exp().unsqueeze(-1)  # [B, H, N, K, 1]
    return ChunkTerms(q_eff, o_local, m_o, v_flat, s_trans, s_add, decay, unchunk)


def _attach_empty(empty, *outputs):
    """Add an exact 0 that depends on the zero-size tensors ``empty`` (a, b at rank r_ab = 0) to
    each output, so that autograd gives them (empty) gradients instead of None."""
    zero = sum(t.sum() for t in empty)
    return tuple(x + zero.to(x.dtype) for x in outputs)
