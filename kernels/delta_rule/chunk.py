"""The delta rule in six Triton kernels on 64-step chunks, forward and backward (kernels/README.md §12; the math of
:mod:`.torch_chunk`, whose names these follow).

    P  ``_prepare_kernel``    grid (N, B*H): G = cumsum(g) in the chunk; the Grams A (rows times beta, strictly
                              lower) and Aqk (lower), every pair decay a product of two factors <= 1
                              (:func:`_gram_levels`);
                              T = (I + A)^-1 by block doubling; w = T (beta k e^G), u~ = T (omega v), kg, qg, gamma.
    S  ``_state_kernel``      grid (V / BV, B*H), serial over chunks: U = u~ - w S, S <- gamma S + kg^T U; stores
                              the state entering each chunk (h) and U.
    O  ``_output_kernel``     grid (N, V / BV, B*H): O = qg h + Aqk U.
    dO ``_dout_kernel``       grid (N, V / BV, B*H): dO's chunk-local products Aqk^T dO and qg^T dO.
    dS ``_state_bwd_kernel``  grid (V / BV, B*H), serial from the last chunk: dU = Aqk^T dO + kg dS_C, then
                              dS_0 = gamma dS_C + qg^T dO - w^T dU; stores dS_C and dU per chunk, and dh0.
    dC ``_chunk_bwd_kernel``  grid (N, B*H): the chunk's VJP from h, U, dS_C, dU: dqg, dAqk, dw, dkg, dgamma by
                              products with the state; dT, dA = -(T^T dT T^T); the two Gram VJPs (the forward's
                              factoring: :func:`_gram_vjps`); dg as the chunk's reverse cumsum of dG.

With ``LAUNCH["GROUP"]`` chunks per group, S and dS run as a two-level scan (:func:`_serial_pass`): both are affine in
the state, S_end = P S_0 + E over a group, so each group's E (from zeros) and P (the identity's columns, no inputs)
come from one parallel launch, :func:`_group_combine_kernel` walks the groups, and a third launch reruns every
group from its start, storing what the one-pass scan stores.

Every intermediate is fp32, and every product exact fp32 (``ieee``) unless ``precision`` names the tensor cores' tf32
(:data:`PRECISIONS`; tf32 by default on the GPU for 16-bit inputs), or ``bf16``: P and dC on tf32, the state path
(S, O, dO, dS, whose products the serial passes wait on) on bf16 operands with fp32 accumulation and the terms only
it reads (Aqk, w, kg, qg: terms.HALF_TERMS) stored in bf16, as fla's kernels store theirs; the states, U and the
cotangents stay fp32, rounded only as operands; ``bf16_dc`` rounds dC's products with U, dU, dO and the states to
bf16 operands too (T's and the Grams' VJPs stay tf32). P and dC take K in blocks of KB columns; the launch settings
(:data:`LAUNCH`) are the fastest measured on an H200 (``benchmarks/delta_rule_kernels.py``). Head dims up to 128.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..utils import LOG_ZERO_FP32, cdiv, check_log_decay, interpreted, next_power_of_2, per_batch_slice, use_triton
from .terms import (CHUNK, RECOMPUTED_TERMS, carve, half_terms, padded_head_dim, resolved_precision, saved_numel,
                    saved_terms)
from .torch_chunk import torch_chunk_delta_rule

MAX_HEAD_DIM = 128
# tl.dot's input_precision for the fp32 operands: exact (the default, and what the interpreter tests check), or the
# tensor cores' tf32 (one or three products) for the GPU's timing; bf16: tf32 in P and dC, bf16 operands in the state
# path (module docstring); bf16_dc: also in dC's products with U, dU, dO and the states
PRECISIONS = ("ieee", "tf32x3", "tf32", "bf16", "bf16_dc")
# each kernel's launch settings by head-dim tile (BK <= 64, BK = 128): warps, pipeline stages and the V block (BV)
LAUNCH = {
    "P": {64: dict(num_warps=4, num_stages=1), 128: dict(num_warps=4, num_stages=1)},
    "S": {64: dict(num_warps=4, num_stages=2), 128: dict(num_warps=8, num_stages=2)},
    "O": {64: dict(num_warps=4, num_stages=3), 128: dict(num_warps=4, num_stages=3)},
    "dS": {64: dict(num_warps=4, num_stages=2), 128: dict(num_warps=8, num_stages=1)},
    "dC": {64: dict(num_warps=8, num_stages=1), 128: dict(num_warps=8, num_stages=1)},
    # the V block; 32 at d <= 64 too: twice the serial passes' programs (H200: 2.24 -> 2.10 ms at (8, 4096, 3, 64))
    "BV": {64: 32, 128: 32},
    "BV_O": {64: 32, 128: 32},  # the V block of the parallel O and dO, which read qg and Aqk once per V block
    "BV_C": {64: 32, 128: 32},  # the V block of dC's loops over V (the reduction width of its state products)
    "KB": {64: 32, 128: 64},  # the K block of the chunk kernels (P, dC)
    # chunks per group of the serial passes' two-level scan (0: one pass over the sequence; untimed, so off), taken
    # only below GROUP_PROGRAMS one-pass programs (B*H*V/BV; about one per SM of an H100 / H200), and the launch of
    # its serial level over the groups (each step reads a [K, K] transition)
    "GROUP": {64: 0, 128: 0},
    "GROUP_PROGRAMS": 132,
    "combine": {64: dict(num_warps=4, num_stages=2), 128: dict(num_warps=8, num_stages=2)},
}


def _launch(kernel: str, bk: int) -> dict:
    """``LAUNCH[kernel]``'s settings for a head-dim tile ``bk``."""
    return LAUNCH[kernel][64 if bk <= 64 else 128]


@triton.jit
def _mma(a, b, PREC: tl.constexpr):
    """``a @ b`` with fp32 accumulation: bf16 operands (PREC "bf16"; "bf16_emulated" rounds them to bf16 and
    multiplies in fp32, for the interpreter, whose bf16 dot is wrong), else fp32 ones at ``input_precision`` PREC."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16_emulated":
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _rows_of(ptr, b, c, h, T, H, D, rows, cols, C: tl.constexpr):
    """``[C, BD]`` fp32: rows ``c*C + rows`` of a ``[B, T, H, D]`` tensor (zeros past T and past D)."""
    t = c * C + rows
    offs = ((b * T + t) * H + h).to(tl.int64)[:, None] * D + cols[None, :]
    return tl.load(ptr + offs, mask=(t < T)[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _scalars_of(ptr, b, c, h, T, H, rows, C: tl.constexpr):
    """``[C]`` fp32: steps ``c*C + rows`` of a ``[B, T, H]`` tensor (zeros past T)."""
    t = c * C + rows
    return tl.load(ptr + ((b * T + t) * H + h).to(tl.int64), mask=t < T, other=0.0).to(tl.float32)


@triton.jit
def _this_chunk(H, NT, BH_AXIS: tl.constexpr):
    """``(c, b, h, blk)`` of a per-chunk program: chunk ``program_id(0)`` of head ``program_id(BH_AXIS)``, ``blk`` its
    index in the ``[B*H, N, ...]`` terms."""
    c = tl.program_id(0)
    bh = tl.program_id(BH_AXIS)
    return c, bh // H, bh % H, (bh * NT + c).to(tl.int64)


@triton.jit
def _chunk_decays(q, k, G, scale, rows, C: tl.constexpr):
    """From a chunk's cumulative log-decay G ``[C, BK]``: ``(e^G, G_C [1, BK], kg = k e^{G_C - G}, qg = scale q
    e^G)``; every exponent <= 0 (the identity steps past T keep G_C the last real step's)."""
    decayed = tl.exp(G)
    last = tl.sum(tl.where((rows == C - 1)[:, None], G, 0.0), axis=0)[None, :]
    return decayed, last, k * tl.exp(last - G), scale * q * decayed


@triton.jit
def _load_G(gcum_blk, rows, cols, BK: tl.constexpr, KB: tl.constexpr, SCALAR: tl.constexpr):
    """A chunk's cumulative log-decay G as a ``[C, KB]`` tile of the K block ``cols`` (SCALAR: one per head, its
    ``[C]`` values repeated over the block)."""
    if SCALAR:
        return tl.load(gcum_blk + rows)[:, None] + tl.zeros([1, KB], dtype=tl.float32)
    return tl.load(gcum_blk + rows[:, None] * BK + cols[None, :])


@triton.jit
def _scalar_pairs(Gs, rows):
    """``[C, C]``: e^{G_t - G_i} for t >= i of one decay per head (exponent <= 0), 0 above the diagonal."""
    return tl.exp(tl.where(rows[:, None] >= rows[None, :], Gs[:, None] - Gs[None, :], float("-inf")))


@triton.jit
def _level(G, gcum_blk, rows, cols, s, BK: tl.constexpr):
    """Level s of the pair decays' doubling (kernels/README.md §12): each 2s-step block's later half (rows t) against
    its earlier half (columns i), through r = G at the later half's first step, one per block and row, so that
    e^{G_t - G_i} = e^{G_t - r} e^{r - G_i} with both factors <= 1. Every pair t > i of a chunk is in exactly one
    level's cross of s = 1, 2, ..., C / 2. Returns ``(decay [C, KB], cross [C, C])``: e^{-|G - r|}, which is
    e^{G_t - r} on the later halves' rows and e^{r - G_i} on the earlier halves' (G never increases), and the pairs'
    mask; a product masked to the cross (or with a cotangent so masked) sees each row on its side only."""
    span = 2 * s
    later = (rows % span) >= s
    ref = tl.load(gcum_blk + ((rows // span) * span + s)[:, None] * BK + cols[None, :])
    cross = ((rows[:, None] // span) == (rows[None, :] // span)) & later[:, None] & (~later)[None, :]
    return tl.exp(-tl.abs(G - ref)), cross


@triton.jit
def _gram_levels(a_mat, aqk, q, k, G, gcum_blk, rows, cols, BK: tl.constexpr, PREC: tl.constexpr):
    """Both Grams for one K block by the levels of :func:`_level` (G stored in ``gcum_blk`` before a barrier):
    every entry a product of factors <= 1, the diagonal of Aqk (pair decay 1) as q_t . k_t; no step read twice."""
    for level in range(6):  # a loop, not unrolled: one level's operands in shared memory at a time
        decay, cross = _level(G, gcum_blk, rows, cols, 1 << level, BK)
        k_dec = k * decay
        a_mat += tl.where(cross, tl.dot(k_dec, tl.trans(k_dec), input_precision=PREC), 0.0)
        aqk += tl.where(cross, tl.dot(q * decay, tl.trans(k_dec), input_precision=PREC), 0.0)
    return a_mat, aqk + tl.where(rows[:, None] == rows[None, :], tl.sum(q * k, axis=1)[:, None], 0.0)


@triton.jit
def _inverse(a_mat, rows, PREC: tl.constexpr):
    """T = (I + A)^-1 of a strictly lower ``[C, C]`` A by block doubling: D <- D - D L_s D, L_s the entries of A
    between the halves of each 2s block, s = 1, 2, ..., C / 2."""
    t_mat = (rows[:, None] == rows[None, :]).to(tl.float32)
    for level in tl.static_range(0, 6):
        s = 1 << level
        pair_block = (rows[:, None] // (2 * s)) == (rows[None, :] // (2 * s))
        cross = pair_block & ((rows[:, None] // s) % 2 == 1) & ((rows[None, :] // s) % 2 == 0)
        l_s = tl.where(cross, a_mat, 0.0)
        t_mat = t_mat - tl.dot(tl.dot(t_mat, l_s, input_precision=PREC), t_mat, input_precision=PREC)
    return t_mat


@triton.jit
def _prepare_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, om_ptr, gcum_ptr, aqk_ptr, tm_ptr, w_ptr, u_ptr, kg_ptr,
                    qg_ptr, gam_ptr, h_ptr, T, H, K, V, NT, scale,
                    C: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
                    LOG_ZERO: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, SCALAR: tl.constexpr,
                    HAS_H: tl.constexpr):
    """P: chunk ``program_id(0)``'s terms (module docstring): G (kept for the backward), Aqk, T, w, u~, kg, qg and
    gamma, each ``[B*H, N, ...]`` in its pointer's dtype (fp32, or bf16 for the terms only the state path reads).
    Two passes over K blocks of KB columns: the Grams (sums over K; the pair decays by :func:`_gram_levels`; SCALAR,
    one decay per head: the plain Grams times the ``[C, C]`` pair decays), then the terms T maps (column blocks).
    HAS_H (the backward's recompute, given the states h the serial pass stored): U = u~ - w h in place of u~, the
    product at the state path's precision SPREC, as S forms it."""
    c, b, h, blk = _this_chunk(H, NT, 1)
    rows = tl.arange(0, C)
    beta = _scalars_of(beta_ptr, b, c, h, T, H, rows, C)
    om = _scalars_of(om_ptr, b, c, h, T, H, rows, C)
    gcum_blk = gcum_ptr + blk * C * (1 if SCALAR else BK)
    a_mat = tl.zeros([C, C], dtype=tl.float32)
    aqk = tl.zeros([C, C], dtype=tl.float32)
    if SCALAR:
        Gs = tl.cumsum(tl.maximum(_scalars_of(g_ptr, b, c, h, T, H, rows, C), LOG_ZERO), axis=0)  # -inf: 0
        tl.store(gcum_blk + rows, Gs)
        for k0 in range(0, K, KB):
            cols = k0 + tl.arange(0, KB)
            q = _rows_of(q_ptr, b, c, h, T, H, K, rows, cols, C)
            k = _rows_of(k_ptr, b, c, h, T, H, K, rows, cols, C)
            a_mat += tl.dot(k, tl.trans(k), input_precision=PREC)
            aqk += tl.dot(q, tl.trans(k), input_precision=PREC)
        pairs = _scalar_pairs(Gs, rows)
        a_mat = tl.where(rows[:, None] > rows[None, :], a_mat * pairs, 0.0)
        aqk = aqk * pairs
        tl.debug_barrier()  # G is read back below by other threads of this program
    else:
        for k0 in range(0, K, KB):
            cols = k0 + tl.arange(0, KB)
            q = _rows_of(q_ptr, b, c, h, T, H, K, rows, cols, C)
            k = _rows_of(k_ptr, b, c, h, T, H, K, rows, cols, C)
            G = tl.cumsum(tl.maximum(_rows_of(g_ptr, b, c, h, T, H, K, rows, cols, C), LOG_ZERO), axis=0)  # -inf: 0
            tl.store(gcum_blk + rows[:, None] * BK + cols[None, :], G)
            tl.debug_barrier()  # G's rows are read back by other threads of this program
            a_mat, aqk = _gram_levels(a_mat, aqk, q, k, G, gcum_blk, rows, cols, BK, PREC)
    out_rows = (blk * C + rows)[:, None]
    t_mat = _inverse(a_mat * beta[:, None], rows, PREC)
    tl.store(aqk_ptr + out_rows * C + rows[None, :], (scale * aqk).to(aqk_ptr.dtype.element_ty))
    tl.store(tm_ptr + out_rows * C + rows[None, :], t_mat)
    for k0 in range(0, K, KB):
        cols = k0 + tl.arange(0, KB)
        kmask = (cols < K)[None, :]
        k = _rows_of(k_ptr, b, c, h, T, H, K, rows, cols, C)
        G = _load_G(gcum_blk, rows, cols, BK, KB, SCALAR)
        decayed, last, kg, qg = _chunk_decays(_rows_of(q_ptr, b, c, h, T, H, K, rows, cols, C), k, G, scale, rows, C)
        # each term stored as soon as it is formed
        tl.store(kg_ptr + out_rows * K + cols[None, :], kg.to(kg_ptr.dtype.element_ty), mask=kmask)
        tl.store(qg_ptr + out_rows * K + cols[None, :], qg.to(qg_ptr.dtype.element_ty), mask=kmask)
        tl.store(gam_ptr + blk * K + cols[None, :], tl.exp(last), mask=kmask)
        w = tl.dot(t_mat, k * decayed * beta[:, None], input_precision=PREC)
        tl.store(w_ptr + out_rows * K + cols[None, :], w.to(w_ptr.dtype.element_ty), mask=kmask)
    if HAS_H:
        tl.debug_barrier()  # w's rows, stored above, are read back by other threads
    for v0 in range(0, V, BV):
        vcols = v0 + tl.arange(0, BV)
        vals = _rows_of(v_ptr, b, c, h, T, H, V, rows, vcols, C) * om[:, None]
        u = tl.dot(t_mat, vals, input_precision=PREC)
        if HAS_H:  # U = u~ - w h, the state pass's U from the state it stored
            for k0 in range(0, K, KB):
                cols = k0 + tl.arange(0, KB)
                w = tl.load(w_ptr + out_rows * K + cols[None, :], mask=(cols < K)[None, :], other=0.0)
                u -= _mma(w, _state_block(h_ptr + blk * K * V, K, V, k0, v0, KB, BV), SPREC)
        tl.store(u_ptr + out_rows * V + vcols[None, :], u, mask=(vcols < V)[None, :])


@triton.jit
def _state_tile(ptr, bh, K, V, i_v, BK: tl.constexpr, BV: tl.constexpr, LOAD: tl.constexpr):
    """``(tile [BK, BV] fp32, offsets, mask)`` of V block ``i_v`` of a ``[B*H, K, V]`` state: loaded from ``ptr`` if
    LOAD, else zeros."""
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    offs = ck[:, None] * V + cv[None, :]
    mask = (ck < K)[:, None] & (cv < V)[None, :]
    if LOAD:
        tile = tl.load(ptr + bh * K * V + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        tile = tl.zeros([BK, BV], dtype=tl.float32)
    return tile, offs, mask


@triton.jit
def _chunk_tile(ptr, chunk_rows, cols, D):
    """Columns ``cols`` of a chunk's ``[C, D]`` rows (``chunk_rows`` ``[C, 1]``) of a saved term, in its stored dtype
    (zeros past D)."""
    return tl.load(ptr + chunk_rows * D + cols[None, :], mask=(cols < D)[None, :], other=0.0)


@triton.jit
def _group_of(NT, NG):
    """``(pid, bh, n0, n1)`` of a serial pass's program over a group of chunks: ``program_id(1)`` = bh * n_groups +
    group, the group's chunks ``[n0, n1)`` of head bh (NG chunks per group; one group when NG = NT)."""
    pid = tl.program_id(1).to(tl.int64)
    n_groups = tl.cdiv(NT, NG)
    n0 = (pid % n_groups) * NG
    return pid, pid // n_groups, n0, tl.minimum(n0 + NG, NT)


@triton.jit
def _summary_columns(i_c, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """A summary program's columns (:func:`_state_kernel`'s SUMMARY): the first ceil(V / BV) programs take V blocks
    of the values, the others K blocks of the identity. Returns ``(start [BK, BV]`` (zeros, or the identity's
    columns), ``value_cols [BV]`` (the value columns, all masked off on an identity program), ``end_offs [BK, BV]``
    and ``end_mask`` into a ``[K, V + K]`` summary (values, then the identity's image))."""
    ck = tl.arange(0, BK)
    n_vb = tl.cdiv(V, BV)
    is_ident = i_c >= n_vb
    j = (i_c - n_vb) * BV + tl.arange(0, BV)  # the identity's columns
    cv = tl.where(is_ident, V + BV, i_c * BV + tl.arange(0, BV))  # past V (masked) on an identity program
    start = tl.where((ck[:, None] == j[None, :]) & is_ident, 1.0, 0.0)
    end_offs = ck[:, None] * (V + K) + tl.where(is_ident, V + j, cv)[None, :]
    end_mask = (ck < K)[:, None] & tl.where(is_ident, j < K, cv < V)[None, :]
    return start, cv, end_offs, end_mask


@triton.jit
def _serial_start(start_ptr, end_ptr, pid, K, V, BK: tl.constexpr, BV: tl.constexpr, LOAD: tl.constexpr,
                  SUMMARY: tl.constexpr):
    """A serial pass's program ``pid`` over column block ``program_id(0)``: ``(start [BK, BV]`` (``start_ptr[pid]``
    if LOAD, else zeros; a SUMMARY program's from :func:`_summary_columns`), its value columns, ``end_ptr`` moved to
    the program's end state, the end's offsets and mask)."""
    i_c = tl.program_id(0)
    if SUMMARY:
        start, cv, end_offs, end_mask = _summary_columns(i_c, K, V, BK, BV)
        return start, cv, end_ptr + pid * K * (V + K), end_offs, end_mask
    start, end_offs, end_mask = _state_tile(start_ptr, pid, K, V, i_c, BK, BV, LOAD)
    return start, i_c * BV + tl.arange(0, BV), end_ptr + pid * K * V, end_offs, end_mask


@triton.jit
def _state_kernel(w_ptr, u_ptr, kg_ptr, gam_ptr, h0_ptr, h_ptr, new_ptr, end_ptr, K, V, NT, NG,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_START: tl.constexpr, PREC: tl.constexpr,
                  SUMMARY: tl.constexpr):
    """S: the serial pass over a group of chunks (:func:`_group_of`; the whole sequence when NG = NT) for V block
    ``program_id(0)``: U = u~ - w S, S <- gamma S + kg^T U, the state fp32 in registers, starting from
    ``h0_ptr[program_id(1)]`` (HAS_START: the initial state, or the group's start from :func:`_group_combine_kernel`)
    or zeros; stores h (the state entering each chunk), U and the end state (``end_ptr[program_id(1)]``).
    SUMMARY (the two-level scan's first level, kernels/README.md §12): no h or U stored; the programs also run K
    blocks of the identity with u~ = 0, so the end states ``[K, V + K]`` are the group's map S_0 -> S_end: its
    image of zero (values) and its transition (identity columns)."""
    pid, bh, n0, n1 = _group_of(NT, NG)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    state, cv, end_ptr, end_offs, end_mask = _serial_start(h0_ptr, end_ptr, pid, K, V, BK, BV, HAS_START, SUMMARY)
    for n in range(n0, n1):
        blk = bh * NT + n
        if not SUMMARY:
            tl.store(h_ptr + blk * K * V + end_offs, state, mask=end_mask)
        chunk_rows = (blk * C + rows)[:, None]
        w = _chunk_tile(w_ptr, chunk_rows, ck, K)
        kg = _chunk_tile(kg_ptr, chunk_rows, ck, K)
        u = _chunk_tile(u_ptr, chunk_rows, cv, V)
        gam = tl.load(gam_ptr + blk * K + ck, mask=ck < K, other=0.0)
        new = u - _mma(w, state, PREC)
        if not SUMMARY:
            tl.store(new_ptr + chunk_rows * V + cv[None, :], new, mask=(cv < V)[None, :])
        state = gam[:, None] * state + _mma(tl.trans(kg), new, PREC)
    tl.store(end_ptr + end_offs, state, mask=end_mask)


@triton.jit
def _group_combine_kernel(summary_ptr, start_ptr, starts_ptr, final_ptr, K, V, N_GROUPS, BK: tl.constexpr,
                          BV: tl.constexpr, HAS_START: tl.constexpr, PREC: tl.constexpr, REVERSE: tl.constexpr):
    """The two-level scan's second level for V block ``program_id(0)`` of head ``program_id(1)``: serial over its
    groups (from the last with REVERSE, the backward's order), storing the state each group starts from, then
    S <- P_g S + E_g with the group's summary ``[K, V + K]`` (E_g its value columns, P_g its identity image);
    ``start_ptr`` the first group's start (HAS_START) or zeros, ``final_ptr`` what leaves the last."""
    i_v = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    ck = tl.arange(0, BK)
    state, state_offs, state_mask = _state_tile(start_ptr, bh, K, V, i_v, BK, BV, HAS_START)
    cv = i_v * BV + tl.arange(0, BV)
    for i in range(N_GROUPS):
        g = (N_GROUPS - 1 - i) if REVERSE else i
        blk = bh * N_GROUPS + g
        tl.store(starts_ptr + blk * K * V + state_offs, state, mask=state_mask)
        summary = summary_ptr + blk * K * (V + K) + ck[:, None] * (V + K)
        transition = tl.load(summary + V + ck[None, :], mask=(ck < K)[:, None] & (ck < K)[None, :], other=0.0)
        image = tl.load(summary + cv[None, :], mask=state_mask, other=0.0)
        state = _mma(transition, state, PREC) + image
    tl.store(final_ptr + bh * K * V + state_offs, state, mask=state_mask)


@triton.jit
def _output_kernel(qg_ptr, aqk_ptr, h_ptr, new_ptr, o_ptr, T, H, K, V, NT,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """O: one chunk's outputs for V block ``program_id(1)``: O = qg h + Aqk U, in o's dtype."""
    c, b, h, blk = _this_chunk(H, NT, 2)
    i_v = tl.program_id(1)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    vmask = cv < V
    chunk_rows = (blk * C + rows)[:, None]
    qg = _chunk_tile(qg_ptr, chunk_rows, ck, K)
    state = _state_tile(h_ptr + blk * K * V, 0, K, V, i_v, BK, BV, True)[0]
    aqk = tl.load(aqk_ptr + chunk_rows * C + rows[None, :])
    new = _chunk_tile(new_ptr, chunk_rows, cv, V)
    o = _mma(qg, state, PREC) + _mma(aqk, new, PREC)
    t = c * C + rows
    offs = ((b * T + t) * H + h).to(tl.int64)[:, None] * V + cv[None, :]
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=(t < T)[:, None] & vmask[None, :])


def _check(q, k, v, beta, g, write, initial_state):
    """ValueError naming the argument, before any launch."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {list(q.shape)}")
    batch, seq_len, heads, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must be [B, T, H, K] = {list(q.shape)}, got {list(k.shape)}")
    if g.shape != q.shape and tuple(g.shape) != (batch, seq_len, heads):
        raise ValueError(f"g must be [B, T, H, K] = {list(q.shape)} (per channel) or [B, T, H] = "
                         f"{[batch, seq_len, heads]} (per head), got {list(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {list(q.shape[:3])}, got {list(v.shape)}")
    for name, x in (("beta", beta), ("write", write)):
        if tuple(x.shape) != (batch, seq_len, heads):
            raise ValueError(f"{name} must be [B, T, H] = {[batch, seq_len, heads]}, got {list(x.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (batch, heads, dk, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V] = {[batch, heads, dk, v.shape[-1]]}, "
                         f"got {list(initial_state.shape)}")
    tensors = (q, k, v, beta, g, write) + (() if initial_state is None else (initial_state,))
    if len({x.device for x in tensors}) != 1:
        raise ValueError("q, k, v, beta, g, write and initial_state must be on one device")


def value_block(dk: int, dv: int, kernel: str = "BV") -> int:
    """BV, the V block of the serial passes (B*H*ceil(V / BV) programs; ``kernel`` "BV"), of O and dO ("BV_O") or of
    dC's loops over V ("BV_C"): ``LAUNCH[kernel]`` for the head-dim tile, at most V rounded up to a power of two, at
    least 16 (S's loads within shared memory)."""
    return max(16, min(LAUNCH[kernel][64 if padded_head_dim(dk) <= 64 else 128], next_power_of_2(dv)))


def _settings(q: torch.Tensor, g: torch.Tensor, dv: int, precision: Optional[str]) -> dict:
    """Tiles and operand precision of a call (ValueError for a K over one tile or an unknown precision). tf32 is the
    GPU's default for 16-bit inputs (bf16 parity 5e-3 on the H200), exact fp32 (ieee) for fp32 inputs, as the
    generalized kernels take them: tf32 there put a Gated DeltaNet mixer's gate-weight gradients 1-3e-2 from the
    fp32 chunk form (sums over tokens cancel); with tf32x3 the backward chunk kernel at K = 64 needs 340 KB of
    shared memory, more than sm_90a's 227. ``SPREC``: the state path's products (S, O, dO, dS and P's U = u~ - w h):
    PREC, or for ``bf16`` and ``bf16_dc`` bf16 operands ("bf16_emulated" under the interpreter), P and dC then on
    tf32 but for ``CPREC``, dC's products with U, dU, dO and the states, which ``bf16_dc`` also takes in bf16;
    ``HALF``: the terms only the state path reads stored in bf16 (terms.HALF_TERMS)."""
    dk = q.shape[-1]
    if dk > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels take K up to {MAX_HEAD_DIM} (one tile), got K = {dk}")
    bk = padded_head_dim(dk)
    precision = resolved_precision(precision, q)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    size = 64 if bk <= 64 else 128
    half = half_terms(precision)
    chunk_precision = "tf32" if half else precision  # P's and dC's products
    state_precision = ("bf16_emulated" if interpreted(q) else "bf16") if half else precision
    return dict(BK=bk, BV=value_block(dk, dv), BV_O=value_block(dk, dv, "BV_O"), BV_C=value_block(dk, dv, "BV_C"),
                KB=min(bk, LAUNCH["KB"][size]), PREC=chunk_precision, SPREC=state_precision,
                CPREC=state_precision if precision == "bf16_dc" else chunk_precision, HALF=half, SCALAR=g.dim() == 3)


def _terms(saved: torch.Tensor, q: torch.Tensor, v: torch.Tensor, cfg: dict, recompute: bool) -> dict:
    """Every term of :mod:`.terms` as a view: those in ``saved``, and with ``recompute`` the others in a fresh
    buffer (alive while the views are)."""
    batch, seq_len, heads, dk = q.shape
    shape = (batch, seq_len, heads, dk, v.shape[-1], cfg["SCALAR"])
    terms = carve(saved, *shape, saved_terms(recompute), half=cfg["HALF"])
    if recompute:
        fresh = torch.empty(saved_numel(*shape, RECOMPUTED_TERMS, half=cfg["HALF"]), device=q.device,
                            dtype=torch.float32)
        terms.update(carve(fresh, *shape, RECOMPUTED_TERMS, half=cfg["HALF"]))
    return terms


def _prepare(q, k, v, beta, g, write, z: dict, u: torch.Tensor, scale: float, cfg: dict, with_state: bool) -> None:
    """P into the terms ``z`` and ``u`` (u~, or with ``with_state`` U = u~ - w h from ``z["h"]``)."""
    batch, seq_len, heads, dk = q.shape
    n_chunks = cdiv(seq_len, CHUNK)
    _prepare_kernel[(n_chunks, batch * heads)](q, k, v, beta, g, write, z["gcum"], z["aqk"], z["tm"], z["w"], u,
                                               z["kg"], z["qg"], z["gamma"], z["h"], seq_len, heads, dk, v.shape[-1],
                                               n_chunks, scale, C=CHUNK, BK=cfg["BK"], KB=cfg["KB"],
                                               BV=cfg["BV"], LOG_ZERO=LOG_ZERO_FP32, PREC=cfg["PREC"],
                                               SPREC=cfg["SPREC"], SCALAR=cfg["SCALAR"], HAS_H=with_state,
                                               **_launch("P", cfg["BK"]))


def group_size(n_chunks: int, bk: int, programs: int) -> int:
    """Chunks per group of the serial passes (``LAUNCH["GROUP"]``) when their one-pass ``programs`` are fewer than
    ``LAUNCH["GROUP_PROGRAMS"]``; all of them (one pass) otherwise, or when the groups would cover them."""
    size = LAUNCH["GROUP"][64 if bk <= 64 else 128]
    return size if 0 < size < n_chunks and programs < LAUNCH["GROUP_PROGRAMS"] else n_chunks


def _serial_pass(kernel, terms, outputs, start: Optional[torch.Tensor], end: torch.Tensor, dk: int, dv: int,
                 bh: int, n_chunks: int, cfg: dict, name: str) -> None:
    """S (``kernel`` :func:`_state_kernel`, forward) or dS (:func:`_state_bwd_kernel`, backward from the last chunk)
    over every head: ``terms`` the chunk terms the kernel reads, ``outputs`` its per-chunk stores (h and U, or the
    dS_C and dU slots), ``start`` the state entering the scan (h0 or dht; None: zeros) and ``end`` ``[B*H, K, V]``
    what leaves it (the final state or dh0). With groups (:func:`group_size`) a two-level scan (kernels/README.md
    §12): each group's map in parallel (SUMMARY), the groups' starts serially (:func:`_group_combine_kernel`), then
    every group's chunks in parallel from its start."""
    bk, bv = cfg["BK"], cfg["BV"]
    start = start.contiguous() if start is not None else None
    size = group_size(n_chunks, bk, bh * cdiv(dv, bv))
    n_groups = cdiv(n_chunks, size)
    common = dict(C=CHUNK, BK=bk, BV=bv, PREC=cfg["SPREC"], **_launch(name, bk))
    if n_groups == 1:
        kernel[(cdiv(dv, bv), bh)](*terms, start if start is not None else end, *outputs, end, dk, dv, n_chunks,
                                   n_chunks, SUMMARY=False, HAS_START=start is not None, **common)
        return
    f32 = dict(device=end.device, dtype=torch.float32)
    summary = torch.empty(bh * n_groups, dk, dv + dk, **f32)
    kernel[(cdiv(dv, bv) + cdiv(dk, bv), bh * n_groups)](*terms, summary, *outputs, summary, dk, dv, n_chunks, size,
                                                         SUMMARY=True, HAS_START=False, **common)
    starts = torch.empty(bh * n_groups, dk, dv, **f32)
    _group_combine_kernel[(cdiv(dv, bv), bh)](summary, start if start is not None else end, starts, end, dk, dv,
                                              n_groups, BK=bk, BV=bv, HAS_START=start is not None, PREC=cfg["PREC"],
                                              REVERSE=kernel is _state_bwd_kernel, **_launch("combine", bk))
    # each group's end goes to the summary's memory, read by then (the combine gave the one that leaves the scan)
    kernel[(cdiv(dv, bv), bh * n_groups)](*terms, starts, *outputs, summary, dk, dv, n_chunks, size, SUMMARY=False,
                                          HAS_START=True, **common)


def delta_rule_forward(q, k, v, beta, g, write, scale: float, initial_state: Optional[torch.Tensor],
                       precision: Optional[str],
                       recompute: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three forward launches (inputs checked by the caller): ``(o [B, T, H, V]`` in q's dtype, the final state
    ``[B, H, K, V]`` fp32, the terms the backward reads in one fp32 buffer, :mod:`.terms`: all of them, or with
    ``recompute`` the states h alone)."""
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    cfg = _settings(q, g, dv, precision)
    q, k, v, beta, g, write = (x.contiguous() for x in (q, k, v, beta, g, write))
    n_chunks = cdiv(seq_len, CHUNK)
    bh = batch * heads
    bk, sprec = cfg["BK"], cfg["SPREC"]
    f32 = dict(device=q.device, dtype=torch.float32)
    saved = torch.empty(saved_numel(batch, seq_len, heads, dk, dv, cfg["SCALAR"], saved_terms(recompute), cfg["HALF"]),
                        **f32)
    z = _terms(saved, q, v, cfg, recompute)
    u = torch.empty(bh, n_chunks, CHUNK, dv, **f32)
    final = torch.empty(bh, dk, dv, **f32)
    _prepare(q, k, v, beta, g, write, z, u, scale, cfg, with_state=False)
    _serial_pass(_state_kernel, (z["w"], u, z["kg"], z["gamma"]), (z["h"], z["new"]), initial_state, final, dk, dv,
                 bh, n_chunks, cfg, "S")
    o = torch.empty(batch, seq_len, heads, dv, device=q.device, dtype=q.dtype)
    bv_o = cfg["BV_O"]
    _output_kernel[(n_chunks, cdiv(dv, bv_o), bh)](z["qg"], z["aqk"], z["h"], z["new"], o, seq_len, heads, dk, dv,
                                                   n_chunks, C=CHUNK, BK=bk, BV=bv_o, PREC=sprec, **_launch("O", bk))
    return o, final.view(batch, heads, dk, dv), saved


@triton.jit
def _dout_kernel(do_ptr, aqk_ptr, qg_ptr, ds_ptr, du_ptr, T, H, K, V, NT, C: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, PREC: tl.constexpr):
    """dO's chunk-local products, before the serial pass (which they would otherwise lengthen), for chunk
    ``program_id(0)`` and V block ``program_id(1)``: Aqk^T dO into dU's slot and qg^T dO into dS_C's slot."""
    c, b, h, blk = _this_chunk(H, NT, 2)
    cv = tl.program_id(1) * BV + tl.arange(0, BV)
    rows = tl.arange(0, C)
    chunk_rows = (blk * C + rows)[:, None]
    do = _rows_of(do_ptr, b, c, h, T, H, V, rows, cv, C)
    aqk = tl.load(aqk_ptr + chunk_rows * C + rows[None, :])
    qg = _chunk_tile(qg_ptr, chunk_rows, tl.arange(0, BK), K)
    tl.store(du_ptr + chunk_rows * V + cv[None, :], _mma(tl.trans(aqk), do, PREC),
             mask=(cv < V)[None, :])
    state_offs = tl.arange(0, BK)[:, None] * V + cv[None, :]
    tl.store(ds_ptr + blk * K * V + state_offs, _mma(tl.trans(qg), do, PREC),
             mask=(tl.arange(0, BK) < K)[:, None] & (cv < V)[None, :])


@triton.jit
def _state_bwd_kernel(kg_ptr, w_ptr, gam_ptr, dht_ptr, ds_ptr, du_ptr, end_ptr, K, V, NT, NG, C: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_START: tl.constexpr, PREC: tl.constexpr,
                      SUMMARY: tl.constexpr):
    """The serial pass backwards over a group of chunks (:func:`_group_of`; the whole sequence when NG = NT), on
    :func:`_dout_kernel`'s products (read from the slots it then overwrites): dU = Aqk^T dO + kg dS_C and dS_0 =
    gamma dS_C + qg^T dO - w^T dU enters the chunk before, from ``dht_ptr[program_id(1)]`` (HAS_START: the final
    state's cotangent, or what enters the group from its right) or zeros; stores dS_C (the cotangent of the state
    leaving each chunk) and dU per chunk, and the end (dh0 for the whole sequence) in ``end_ptr[program_id(1)]``.
    SUMMARY: as :func:`_state_kernel`'s, the slots only read, the identity's K blocks with no dO terms: the group's
    map dS_C -> dS_0 as ``[K, V + K]``."""
    pid, bh, n0, n1 = _group_of(NT, NG)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    ds, cv, end_ptr, end_offs, end_mask = _serial_start(dht_ptr, end_ptr, pid, K, V, BK, BV, HAS_START, SUMMARY)
    slot_offs = ck[:, None] * V + cv[None, :]
    slot_mask = (ck < K)[:, None] & (cv < V)[None, :]
    for i in range(n1 - n0):
        blk = bh * NT + n1 - 1 - i
        chunk_rows = (blk * C + rows)[:, None]
        du_slot = du_ptr + chunk_rows * V + cv[None, :]
        q_do = tl.load(ds_ptr + blk * K * V + slot_offs, mask=slot_mask, other=0.0)  # qg^T dO
        aqk_do = tl.load(du_slot, mask=(cv < V)[None, :], other=0.0)  # Aqk^T dO
        kg = _chunk_tile(kg_ptr, chunk_rows, ck, K)
        w = _chunk_tile(w_ptr, chunk_rows, ck, K)
        gam = tl.load(gam_ptr + blk * K + ck, mask=ck < K, other=0.0)
        if not SUMMARY:
            tl.debug_barrier()  # every thread has read the slots before any overwrites them
            tl.store(ds_ptr + blk * K * V + slot_offs, ds, mask=slot_mask)
        du = aqk_do + _mma(kg, ds, PREC)
        if not SUMMARY:
            tl.store(du_slot, du, mask=(cv < V)[None, :])
        ds = gam[:, None] * ds + q_do - _mma(tl.trans(w), du, PREC)
    tl.store(end_ptr + end_offs, ds, mask=end_mask)


@triton.jit
def _gram_vjps(m_a, beta, m_q, m_q_diag, k, q, G, gcum_blk, rows, cols, C: tl.constexpr, BK: tl.constexpr,
               KB: tl.constexpr, PREC: tl.constexpr):
    """The VJPs of the two Grams P_A[t, i] = sum_c k_tc k_ic e^{G_tc - G_ic} (i < t) and P_q[t, i] = sum_c q_tc k_ic
    e^{G_tc - G_ic} (i <= t), which share their columns (k) and decays: ``(row_a, row_q, col)`` ``[C, KB]`` with
    row_a_t = sum_i m_a[t, i] k_i e^{G_t - G_i}, row_q likewise with m_q, and col_i = sum_t (m_a_col[t, i] k_t +
    m_q[t, i] q_t) e^{G_t - G_i} (the column sides summed: both land on dk), for the K block ``cols``; m_a_col is
    m_a with rows times ``beta [C]`` (formed per level, not held). By the levels of :func:`_level`, as the forward's
    :func:`_gram_levels` takes the Grams: per level, row_t = d_t (M (k o d))_t and col_i = d_i (M^T (x o d))_i with
    d the level's decay and M the cotangent on its cross (rows of the later halves, columns of the earlier); the
    diagonal of P_q (``m_q_diag [C]``, pair decay 1) adds m_q[t, t] k_t to row_q and m_q[t, t] q_t to col."""
    row_a = tl.zeros([C, KB], dtype=tl.float32)
    row_q = m_q_diag[:, None] * k
    col = m_q_diag[:, None] * q
    for level in range(6):  # a loop, not unrolled: one level's operands in shared memory at a time
        decay, cross = _level(G, gcum_blk, rows, cols, 1 << level, BK)
        k_dec = k * decay
        m_a_s = tl.where(cross, m_a, 0.0)  # each masked cotangent used up before the next is formed
        row_a += tl.dot(m_a_s, k_dec, input_precision=PREC) * decay
        col += tl.dot(tl.trans(m_a_s * beta[:, None]), k_dec, input_precision=PREC) * decay
        m_q_s = tl.where(cross, m_q, 0.0)
        row_q += tl.dot(m_q_s, k_dec, input_precision=PREC) * decay
        col += tl.dot(tl.trans(m_q_s), q * decay, input_precision=PREC) * decay
    return row_a, row_q, col


@triton.jit
def _state_block(ptr, K, V, k0, v0, KB: tl.constexpr, BV: tl.constexpr):
    """``[KB, BV]`` fp32: rows ``k0 + arange(KB)``, columns ``v0 + arange(BV)`` of one ``[K, V]`` state (zeros
    outside)."""
    ck = k0 + tl.arange(0, KB)
    cv = v0 + tl.arange(0, BV)
    return tl.load(ptr + ck[:, None] * V + cv[None, :], mask=(ck < K)[:, None] & (cv < V)[None, :], other=0.0)


@triton.jit
def _chunk_bwd_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, om_ptr, do_ptr, gcum_ptr, tm_ptr, h_ptr,
                      new_ptr, ds_ptr, du_ptr, dw_ptr, dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, dom_ptr, T, H, K, V, NT,
                      scale, C: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
                      LOG_ZERO: tl.constexpr, PREC: tl.constexpr, CPREC: tl.constexpr, SCALAR: tl.constexpr):
    """Every input gradient of chunk ``program_id(0)`` from its h, U, dS_C and dU (kernels/README.md §12), in three
    passes that keep at most ``[C, KB]`` column blocks live: over V, the products without the state (dAqk, dT's
    value side, dv, d omega); over K, dW = -dU S_0^T (stored in ``dw_ptr``, ``[B*H, N, C, K]`` fp32) and dT's key
    side dW (beta k e^G)^T, which completes dT and so dA = -(T^T dT T^T); over K again, each block's Gram VJPs,
    then its products with the state (dqg, dkg, dgamma; dW read back), and dq, dk, dg (the chunk's reverse cumsum
    of dG) and dbeta's share. SCALAR (one decay per
    head): the Gram VJPs through the ``[C, C]`` pair decays, and dG summed over K before the cumsum. CPREC: the
    products with U, dU, dO and the states (dAqk, dT's value side, dv, dW, dqg, dkg); PREC the others (T's and the
    Grams' VJPs)."""
    c, b, h, blk = _this_chunk(H, NT, 1)
    rows = tl.arange(0, C)
    beta = _scalars_of(beta_ptr, b, c, h, T, H, rows, C)
    om = _scalars_of(om_ptr, b, c, h, T, H, rows, C)
    gcum_blk = gcum_ptr + blk * C * (1 if SCALAR else BK)
    h_blk = h_ptr + blk * K * V
    ds_blk = ds_ptr + blk * K * V
    chunk_rows = (blk * C + rows)[:, None]
    t_mat = tl.load(tm_ptr + chunk_rows * C + rows[None, :])
    t_rows = c * C + rows
    valid = t_rows < T
    io_rows = ((b * T + t_rows) * H + h).to(tl.int64)[:, None]
    d_aqk = tl.zeros([C, C], dtype=tl.float32)
    d_t = tl.zeros([C, C], dtype=tl.float32)
    d_om = tl.zeros([C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        u = _chunk_tile(new_ptr, chunk_rows, cv, V)
        du = _chunk_tile(du_ptr, chunk_rows, cv, V)
        do = _rows_of(do_ptr, b, c, h, T, H, V, rows, cv, C)
        vals = _rows_of(v_ptr, b, c, h, T, H, V, rows, cv, C)
        d_aqk += _mma(do, tl.trans(u), CPREC)
        d_t += _mma(du, tl.trans(vals * om[:, None]), CPREC)
        t_du = _mma(tl.trans(t_mat), du, CPREC)  # d(omega v)
        tl.store(dv_ptr + io_rows * V + cv[None, :], (om[:, None] * t_du).to(dv_ptr.dtype.element_ty),
                 mask=valid[:, None] & (cv < V)[None, :])
        d_om += tl.sum(vals * t_du, axis=1)
    scalar_rows = ((b * T + t_rows) * H + h).to(tl.int64)
    tl.store(dom_ptr + scalar_rows, d_om.to(dom_ptr.dtype.element_ty), mask=valid)
    gram_kk = tl.zeros([C, C], dtype=tl.float32)  # SCALAR: the plain Grams, for dG's Gram share
    gram_qk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, KB):
        cols = k0 + tl.arange(0, KB)
        d_w = tl.zeros([C, KB], dtype=tl.float32)
        for v0 in range(0, V, BV):
            du = _chunk_tile(du_ptr, chunk_rows, v0 + tl.arange(0, BV), V)
            d_w -= _mma(du, tl.trans(_state_block(h_blk, K, V, k0, v0, KB, BV)), CPREC)
        tl.store(dw_ptr + chunk_rows * K + cols[None, :], d_w, mask=(cols < K)[None, :])
        k = _rows_of(k_ptr, b, c, h, T, H, K, rows, cols, C)
        G = _load_G(gcum_blk, rows, cols, BK, KB, SCALAR)
        d_t += tl.dot(d_w, tl.trans(beta[:, None] * k * tl.exp(G)), input_precision=PREC)
        if SCALAR:
            gram_kk += tl.dot(k, tl.trans(k), input_precision=PREC)
            gram_qk += tl.dot(_rows_of(q_ptr, b, c, h, T, H, K, rows, cols, C), tl.trans(k), input_precision=PREC)
    d_a = -tl.dot(tl.dot(tl.trans(t_mat), d_t, input_precision=PREC), tl.trans(t_mat), input_precision=PREC)
    d_a = tl.where(rows[:, None] > rows[None, :], d_a, 0.0)
    d_p = tl.where(rows[:, None] >= rows[None, :], d_aqk * scale, 0.0)
    if SCALAR:  # the cotangents on the plain Grams k k^T and q k^T
        pairs = _scalar_pairs(tl.load(gcum_blk + rows), rows)
        m_a, m_q = d_a * pairs, d_p * pairs
        m_a_col = m_a * beta[:, None]
        # the Grams' share of dG from their pair decays e^{G_t - G_i}, on the [C, C] level: E = (their cotangents) o
        # (the Grams), row sums minus column sums; summing the channels' dG instead would cancel terms in fp32
        e_pairs = m_a_col * gram_kk + m_q * gram_qk
        dg_sum = tl.sum(e_pairs, axis=1) - tl.sum(e_pairs, axis=0)
    else:
        d_p_diag = tl.sum(tl.where(rows[:, None] == rows[None, :], d_p, 0.0), axis=1)
    tl.debug_barrier()  # dW's rows, stored above, are read back by other threads
    d_beta = tl.zeros([C], dtype=tl.float32)
    for k0 in range(0, K, KB):
        cols = k0 + tl.arange(0, KB)
        q = _rows_of(q_ptr, b, c, h, T, H, K, rows, cols, C)
        k = _rows_of(k_ptr, b, c, h, T, H, K, rows, cols, C)
        G = _load_G(gcum_blk, rows, cols, BK, KB, SCALAR)
        # the Gram VJPs first, folded at once into the block's dq, dk, dG and dbeta (fewer [C, KB] tiles live
        # together). A = beta_t P_A, Aqk = scale P_q: their cotangents on the unscaled Grams (d_a strictly lower)
        if SCALAR:
            row_a = tl.dot(m_a, k, input_precision=PREC)
            row_q = tl.dot(m_q, k, input_precision=PREC)
            col_k = tl.dot(tl.trans(m_a_col), k, input_precision=PREC) + tl.dot(tl.trans(m_q), q, input_precision=PREC)
        else:
            row_a, row_q, col_k = _gram_vjps(d_a, beta, d_p, d_p_diag, k, q, G, gcum_blk, rows, cols, C, BK, KB, PREC)
        dq = row_q
        dk = beta[:, None] * row_a + col_k
        d_beta += tl.sum(k * row_a, axis=1)
        if not SCALAR:  # SCALAR: the Grams' share of dG is dg_sum's E term
            d_big = beta[:, None] * k * row_a + q * row_q - k * col_k
        # then the products with the state (dW from the second pass)
        d_qg = tl.zeros([C, KB], dtype=tl.float32)
        d_kg = tl.zeros([C, KB], dtype=tl.float32)
        d_gam = tl.zeros([KB], dtype=tl.float32)
        for v0 in range(0, V, BV):
            cv = v0 + tl.arange(0, BV)
            s0 = _state_block(h_blk, K, V, k0, v0, KB, BV)
            ds = _state_block(ds_blk, K, V, k0, v0, KB, BV)
            do = _rows_of(do_ptr, b, c, h, T, H, V, rows, cv, C)
            d_qg += _mma(do, tl.trans(s0), CPREC)
            d_kg += _mma(_chunk_tile(new_ptr, chunk_rows, cv, V), tl.trans(ds), CPREC)
            d_gam += tl.sum(ds * s0, axis=1)
        t_again = tl.load(tm_ptr + chunk_rows * C + rows[None, :])  # read again, not held through the Gram VJPs
        t_dw = tl.dot(tl.trans(t_again), _chunk_tile(dw_ptr, chunk_rows, cols, K), input_precision=PREC)  # d(beta k e^G)
        decayed, last, kg, qg = _chunk_decays(q, k, G, scale, rows, C)
        dq += scale * d_qg * decayed
        dk += d_kg * tl.exp(last - G) + beta[:, None] * decayed * t_dw
        d_beta += tl.sum(k * decayed * t_dw, axis=1)
        d_out = d_qg * qg + beta[:, None] * k * decayed * t_dw - d_kg * kg  # dG's terms outside the Grams
        d_last = tl.sum(d_kg * kg, axis=0) + d_gam * tl.reshape(tl.exp(last), [KB])  # G_C: kg's and gamma's
        d_out += tl.where((rows == C - 1)[:, None], d_last[None, :], 0.0)
        out_mask = valid[:, None] & (cols < K)[None, :]
        tl.store(dq_ptr + io_rows * K + cols[None, :], dq.to(dq_ptr.dtype.element_ty), mask=out_mask)
        tl.store(dk_ptr + io_rows * K + cols[None, :], dk.to(dk_ptr.dtype.element_ty), mask=out_mask)
        if SCALAR:  # G_t feeds every channel's G_tc: the terms outside the Grams, summed over K
            dg_sum += tl.sum(d_out, axis=1)
        else:
            dg = tl.cumsum(d_big + d_out, axis=0, reverse=True)
            g_raw = _rows_of(g_ptr, b, c, h, T, H, K, rows, cols, C)
            dg = tl.where(g_raw >= LOG_ZERO, dg, 0.0)  # below the floor exp(g) is 0 whatever g: no gradient
            tl.store(dg_ptr + io_rows * K + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=out_mask)
    if SCALAR:
        dg = tl.cumsum(dg_sum, axis=0, reverse=True)
        dg = tl.where(_scalars_of(g_ptr, b, c, h, T, H, rows, C) >= LOG_ZERO, dg, 0.0)
        tl.store(dg_ptr + scalar_rows, dg.to(dg_ptr.dtype.element_ty), mask=valid)
    tl.store(dbeta_ptr + scalar_rows, d_beta.to(dbeta_ptr.dtype.element_ty), mask=valid)


def delta_rule_backward(do, dht, q, k, v, beta, g, write, scale: float, initial_state: Optional[torch.Tensor],
                        saved: torch.Tensor, precision: Optional[str], recompute: bool = False):
    """Every input gradient from the forward's ``saved`` terms (``recompute``: the states h alone, the rest remade
    first by P): the serial pass for dS and dU, then each chunk's VJP. Returns ``(dq, dk, dv, dbeta, dg, dwrite, dh0
    [B, H, K, V] fp32 or None)``, the others in the inputs' dtypes."""
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    cfg = _settings(q, g, dv, precision)
    q, k, v, beta, g, write = (x.contiguous() for x in (q, k, v, beta, g, write))
    z = _terms(saved, q, v, cfg, recompute)
    if recompute:
        _prepare(q, k, v, beta, g, write, z, z["new"], scale, cfg, with_state=True)
    n_chunks = cdiv(seq_len, CHUNK)
    bh = batch * heads
    bk, prec, sprec = cfg["BK"], cfg["PREC"], cfg["SPREC"]
    f32 = dict(device=q.device, dtype=torch.float32)
    ds = torch.empty(bh, n_chunks, dk, dv, **f32)
    du = torch.empty(bh, n_chunks, CHUNK, dv, **f32)
    dh0 = torch.empty(bh, dk, dv, **f32)
    do = do.contiguous()
    _dout_kernel[(n_chunks, cdiv(dv, cfg["BV_O"]), bh)](do, z["aqk"], z["qg"], ds, du, seq_len, heads, dk, dv,
                                                        n_chunks, C=CHUNK, BK=bk, BV=cfg["BV_O"], PREC=sprec,
                                                        **_launch("O", bk))
    _serial_pass(_state_bwd_kernel, (z["kg"], z["w"], z["gamma"]), (ds, du), dht, dh0, dk, dv, bh, n_chunks, cfg,
                 "dS")
    grads = [torch.empty_like(x) for x in (q, k, v, beta, g, write)]
    d_w = torch.empty(bh, n_chunks, CHUNK, dk, **f32)
    _chunk_bwd_kernel[(n_chunks, bh)](q, k, v, beta, g, write, do, z["gcum"], z["tm"], z["h"], z["new"],
                                      ds, du, d_w, *grads, seq_len, heads, dk, dv, n_chunks, scale, C=CHUNK, BK=bk,
                                      KB=cfg["KB"], BV=cfg["BV_C"], LOG_ZERO=LOG_ZERO_FP32, PREC=prec,
                                      CPREC=cfg["CPREC"], SCALAR=cfg["SCALAR"], **_launch("dC", bk))
    return (*grads, dh0.view(batch, heads, dk, dv) if initial_state is not None else None)


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                     write: torch.Tensor, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                     output_final_state: bool = False, precision: Optional[str] = None,
                     reverse: bool = False, recompute: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The delta rule ``S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + write_t k_t v_t^T``, ``o_t = scale
    S_t^T q_t`` (kernels/README.md §12), with gradients for every input: the Triton kernels where Triton runs (CUDA,
    or the CPU under ``TRITON_INTERPRET=1``), else :func:`.torch_chunk.torch_chunk_delta_rule` (PyTorch's autograd).

    Args: q, k ``[B, T, H, K]`` (k unit rows), g ``[B, T, H, K]`` per channel or ``[B, T, H]`` per head (g <= 0;
        its own kernels' specialisation), v ``[B, T, H, V]``, beta and write ``[B, T, H]``,
        initial_state ``[B, H, K, V]`` or None; ``precision``: every product's fp32 operands as :data:`PRECISIONS`
        names them (``tl.dot``'s ``input_precision``; None: tf32 for 16-bit inputs on CUDA, else exact; ``bf16``:
        the state path's products on bf16 operands, its terms stored in bf16, the rest tf32; ``bf16_dc``: also
        the backward chunk kernel's products with U, dU, dO and the states);
        ``reverse``: the scan from the last step to the first (on time-flipped copies of the inputs, for now);
        ``recompute``: the Triton path saves only the states entering each chunk for the backward, which remakes
        the other terms from the inputs (:mod:`.terms`; less memory, one more prepare launch).
        Returns ``(o [B, T, H, V]`` in q's dtype, the final state ``[B, H, K, V]`` (fp32; float64 for float64 inputs on the CPU form) or
        None).
    """
    _check(q, k, v, beta, g, write, initial_state)
    if reverse:
        o, final = chunk_delta_rule(*(x.flip(1) for x in (q, k, v, beta, g, write)), scale, initial_state,
                                    output_final_state, precision, recompute=recompute)
        return o.flip(1), final
    if use_triton(q):
        from ..custom_ops import chunk_delta_rule_op

        def op(q, k, v, beta, g, write, initial_state):  # a grid axis holds at most MAX_GRID_BATCH_HEADS programs
            return chunk_delta_rule_op(q, k, v, beta, g, write, 1.0 if scale is None else float(scale),
                                       initial_state, output_final_state, precision, recompute)[:2]
        o, final = per_batch_slice(op, dict(q=q, k=k, v=v, beta=beta, g=g, write=write, initial_state=initial_state),
                                   q.shape[2])
        return o, (final if output_final_state else None)
    check_log_decay(g)
    per_channel = g if g.dim() == 4 else g.unsqueeze(-1).expand(q.shape)  # its gradient sums over K
    return torch_chunk_delta_rule(q, k, v, beta, per_channel, write, scale, initial_state, output_final_state)
