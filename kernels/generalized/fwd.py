"""Forward of the generalized recurrence in three Triton kernels (issue 11, design/KERNELS.md).

    S_t = (Diag(exp g_t) - A_t B_t^T) S_{t-1} + K_t V_t^T,    o_t = scale * S_t^T q_t

Per chunk c of C scan steps (C in {16, 32, 64}; scan step p is token p, or T-1-p when reversed),
with G the inclusive and G' = G - g the exclusive chunk-local cumsum of the clamped log-decay:

    Bh_t = B_t e^{G'_t}            Qh_t = scale q_t e^{G_t}          At_i = A_i e^{G_last - G_i}
    L_AB = tril_<(B e^{G'} (A e^{-G})^T)     L_KB = tril_<(B e^{G'} (K e^{-G})^T)
    M_QA = tril_<=(Qh (A e^{-G})^T)         M_QK = tril_<=(Qh (K e^{-G})^T)
    W = (I + L_AB)^{-1} Bh         U = (I + L_AB)^{-1} L_KB
    Qeff = Qh - M_QA W             Mo = M_QK - M_QA U
    N = At^T W                     Cc = (Kt - U^T At)^T Vbar        gamma = e^{G_last}
    S_c = gamma (.) S_{c-1} - N S_{c-1} + Cc          O_c = Qeff S_{c-1} + Mo Vbar

(the products with e^{-G} are written as one factor only; every decay is evaluated as below).

Kernels (grid (NT, B*H) unless said; num_warps from :func:`launch_warps`, a host-side table)
    F0  ``chunk_cumsum_kernel``  G (chunk-local inclusive cumsum of the clamped g, fp32) and gamma.
    F1a ``chunk_wy_kernel``      W (PART 0) or U (PART 1): two launches, one accumulator each,
                                 stored fp32 ``[B*H*NT, C*RAP, BK]`` / ``[B*H*NT, C*RAP, C*RKP]``.
    F1b ``chunk_qeff_kernel``    Qeff and Mo per 16-query row block (W, U read from F1a's output).
    F1c ``chunk_nc_kernel``      N = At^T W and Cc = (Kt - U^T At)^T Vbar (64+-row wgmma products).
    F2  ``chunk_state_kernel``   grid (V/BV, B*H), serial over chunks: one [K x K].[K x BV] product
                                 per chunk on the chain; gamma (.) S exact in fp32; in 16-bit mode N
                                 (16-bit) times S split as hi + lo in N's dtype (two products).
    F3  ``chunk_output_kernel``  grid (NT, V/BV, B*H): O = Qeff h + Mo Vbar.
Every kernel reads what an earlier launch wrote (no cross-thread scratch inside a launch).

Decays (design/KERNELS.md "Numerics"). F1a/F1b walk the chunk in 16-token row blocks n. The
entries between row block n and an earlier 16-token column block m < n (loaded directly, 16 rows)
factor through the reference R_m = G at block m's last token: e^{X_t - R_m} <= 1 and
e^{R_m - G_i} <= 1 (X = G' or G), one tensor-core product per sub-block.
The diagonal 16 x 16 token block is built column by column with the exact pairwise e^{X_t - G_i}
(masked with ``tl.where`` before ``exp``), so gates down to -20 per step (and g = -inf, clamped at
``LOG_ZERO_FP32``) are exact with no data-dependent branch. Scalar decay per head (g [B, T, H])
multiplies the plain product by the exact C x C decay matrix instead. The inverse is never
formed: W and U come from block forward substitution, W_n = T_nn (Bh_n - L_AB[n, <n] W_<n)
(U likewise), with T_nn the inverse of the 16-token diagonal block by doubling (fp32).

Layout notes for the backward (bwd.py):
* Stacks inside a chunk are token-major with the rank fastest: row ``i * r + l`` holds rank l of
  chunk token i. ``Mo[b, h, c]`` is ``[C, r_kv * C]`` with column ``i * r_kv + l`` (i <= t).
* ``Qeff [B, H, NT * C, K]`` and ``h [B, H, NT, K, V]`` are in scan order (chunk c, step within);
  rows of steps past T are zero in Qeff and never read.
* ``N`` (None at r_ab = 0), ``Qeff``, ``Mo``, ``h``: q's dtype for bf16/fp16 input, fp32 otherwise.
  ``Cc``, ``gamma``, the final state and ``G`` (the chunk-local inclusive cumsum of the clamped g,
  ``[B*H, NT*C, BK]`` or ``[B*H, NT*C]`` for scalar decay, scan order, fp32, padded channels 0) fp32.
* Steps past T in the last chunk have g = 0 and q = k = v = a = b = 0 (identity, nothing written).
* HDLA (``hdla_beta`` given): A = [beta u, k], B = [k, beta u - beta^2 s k], u = e^g k, s = k.u are
  built in registers from (k, beta, g) (rank slot 0 and 1 in that order); g is then per channel.
* ``prep["chunk"]`` is the chunk actually used (the default rule, or a smaller one when F1's shared
  memory does not fit); always read it from there.

Status: exact under the interpreter (fp32, fp16); compiled for sm_90a without a GPU
(``python -m benchmarks.kernel_stages --part aot`` prints registers, spills, shared memory per
kernel); not yet run on a GPU.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from triton.runtime.errors import OutOfResources

from ..utils import LOG_ZERO_FP32

LOG_ZERO = tl.constexpr(LOG_ZERO_FP32)
SUB = tl.constexpr(16)  # tokens per row block (the exact diagonal block and the inverse's diagonal block)
CHUNKS = (16, 32, 64)


# ----------------------------------------------------------------------------- small helpers
@triton.jit
def _mm(x, y, F32: tl.constexpr, LOWP: tl.constexpr):
    """x @ y with fp32 accumulation: exact fp32 (``ieee``) for fp32 inputs; else operands in bf16
    (LOWP = 1) or fp16 (LOWP = 2), the input's 16-bit dtype, or TF32 (LOWP = 0)."""
    if F32:
        return tl.dot(x, y, input_precision="ieee")
    elif LOWP == 1:
        return tl.dot(x.to(tl.bfloat16), y.to(tl.bfloat16))
    elif LOWP == 2:
        return tl.dot(x.to(tl.float16), y.to(tl.float16))
    else:
        return tl.dot(x, y, input_precision="tf32")


@triton.jit
def _steps(c, tok0, NTOK: tl.constexpr, RP: tl.constexpr, T, C: tl.constexpr, REVERSE: tl.constexpr):
    """Rows ``tok * RP + rank`` of NTOK chunk tokens from ``tok0``: (chunk token, rank, time index,
    valid); a step past T is invalid (masked loads, identity step)."""
    rows = tl.arange(0, NTOK * RP)
    tok = tok0 + rows // RP
    rank = rows % RP
    p = c * C + tok
    valid = p < T
    if REVERSE:
        t = T - 1 - p
    else:
        t = p
    return tok, rank, t, valid


@triton.jit
def _load_stack(ptr, sb, st, sh, sr, i_b, i_h, t, valid, rank, cols, cmask, R: tl.constexpr):
    """Rows of a ``[B, T, H, (R,) D]`` tensor (strides sb, st, sh, sr; last dim contiguous) as fp32;
    rank slots >= R and steps past T are 0."""
    off = i_b.to(tl.int64) * sb + t.to(tl.int64) * st + i_h * sh + rank * sr
    mask = (valid & (rank < R))[:, None] & cmask[None, :]
    return tl.load(ptr + off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_token_scalar(ptr, sb, st, sh, i_b, i_h, t, valid):
    off = i_b.to(tl.int64) * sb + t.to(tl.int64) * st + i_h * sh
    return tl.load(ptr + off, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _load_cumsum(gs_ptr, bh, c, tok, cols, NT, C: tl.constexpr, BK: tl.constexpr, SCALAR: tl.constexpr):
    """G rows of chunk tokens ``tok`` from the scratch cumsum: ``[rows, BK]`` or ``[rows]``."""
    row = (bh * NT + c).to(tl.int64) * C + tok
    if SCALAR:
        return tl.load(gs_ptr + row)
    else:
        return tl.load(gs_ptr + row[:, None] * BK + cols[None, :])


@triton.jit
def _load_gate(g_ptr, sgb, sgt, sgh, i_b, i_h, t, valid, cols, cmask, SCALAR: tl.constexpr):
    """The clamped log-decay g of the rows' steps (0 past T): ``[rows, BK]`` or ``[rows]``."""
    if SCALAR:
        g = _load_token_scalar(g_ptr, sgb, sgt, sgh, i_b, i_h, t, valid)
    else:
        g = _load_stack(g_ptr, sgb, sgt, sgh, 0, i_b, i_h, t, valid, t * 0, cols, cmask, 1)
    return tl.maximum(g, LOG_ZERO)


@triton.jit
def _hdla_stacks(k_ptr, skb, skt, skh, beta_ptr, sbb, sbt, sbh, g_ptr, sgb, sgt, sgh,
                 i_b, i_h, t, valid, rank, cols, cmask):
    """HDLA's A = [beta u, k] and B = [k, beta u - beta^2 s k] rows (rank slot 0, 1),
    u = e^g k, s = k.u: two ``[rows, BK]`` tiles."""
    kk = _load_stack(k_ptr, skb, skt, skh, 0, i_b, i_h, t, valid, rank * 0, cols, cmask, 1)
    g = tl.maximum(_load_stack(g_ptr, sgb, sgt, sgh, 0, i_b, i_h, t, valid, rank * 0, cols, cmask, 1), LOG_ZERO)
    beta = _load_token_scalar(beta_ptr, sbb, sbt, sbh, i_b, i_h, t, valid)[:, None]
    u = tl.exp(g) * kk
    s = tl.sum(u * kk, 1)[:, None]
    first = (rank == 0)[:, None]
    a = tl.where(first, beta * u, kk)
    b = tl.where(first, kk, beta * u - beta * beta * s * kk)
    return a, b


@triton.jit
def _row_of(x, rows, r):
    """Row ``r`` of a 2-D tile as a 1-D vector."""
    return tl.sum(tl.where((rows == r)[:, None], x, 0.0), 0)


@triton.jit
def _tile_rows(x, NB: tl.constexpr, NR: tl.constexpr, D: tl.constexpr):
    """``[NR, D] -> [NB * NR, D]``: x repeated NB times down the rows."""
    return tl.reshape(tl.broadcast_to(x[None, :, :], (NB, NR, D)), (NB * NR, D))


@triton.jit
def _tile_cols(x, NB: tl.constexpr, NR: tl.constexpr, D: tl.constexpr):
    """``[NR, D] -> [NR, NB * D]``: x repeated NB times across the columns."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], (NR, NB, D)), (NR, NB * D))


# ----------------------------------------------------------------------------- the Gram blocks
@triton.jit
def _diag_exact(x, gx, y_d, gy_d, STRICT: tl.constexpr, RPR: tl.constexpr, RPC: tl.constexpr):
    """The diagonal token block ``D[n, m] = sum_k x[n,k] y_d[m,k] e^{gx[n,k] - gy_d[m,k]}`` for
    token(m) < token(n) (<= unless STRICT), exact pairwise: ``[16 RPR, 16 RPC]``."""
    tok_r = tl.arange(0, SUB * RPR) // RPR
    rows_d = tl.arange(0, SUB * RPC)
    out = tl.zeros([SUB * RPR, SUB * RPC], dtype=tl.float32)
    for i in range(SUB):
        gy_i = _row_of(gy_d, rows_d, i * RPC)
        if STRICT:
            live = tok_r > i
        else:
            live = tok_r >= i
        xe = x * tl.exp(tl.where(live[:, None], gx - gy_i[None, :], float("-inf")))
        for r in tl.static_range(RPC):
            y_i = _row_of(y_d, rows_d, i * RPC + r)
            col = tl.sum(xe * y_i[None, :], 1)
            out = tl.where((rows_d == i * RPC + r)[None, :], col[:, None], out)
    return out


@triton.jit
def _gram_add_block(out, x, gx, y_m, gy_m, ref_m, m, RPC: tl.constexpr, C: tl.constexpr,
                    SCALAR: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr):
    """Column block m < n of a Gram row block n: ``sum_k x_t y_i e^{gx_t - gy_i}`` for the 16 tokens i
    of block m (all earlier than every row t), through the reference ref_m = G at block m's last token:
    e^{gx_t - ref_m} <= 1 and e^{ref_m - gy_i} <= 1 (vector decay); scalar decay multiplies the plain
    product by the exact decay matrix. x, gx ``[rows, BK]`` (``[rows]``); y_m, gy_m ``[16 RPC, BK]``."""
    if SCALAR:
        blk = _mm(x, tl.trans(y_m), F32, LOWP) * tl.exp(gx[:, None] - gy_m[None, :])
    else:
        blk = _mm(x * tl.exp(gx - ref_m[None, :]), tl.trans(y_m * tl.exp(ref_m[None, :] - gy_m)), F32, LOWP)
    tok_c = tl.arange(0, C * RPC) // RPC
    full = _tile_cols(blk, C // SUB, x.shape[0], SUB * RPC)
    return tl.where((tok_c // SUB == m)[None, :], full, out)


@triton.jit
def _gram_add_diag(out, x, gx, y_d, gy_d, n, STRICT: tl.constexpr, RPR: tl.constexpr, RPC: tl.constexpr,
                   C: tl.constexpr, SCALAR: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr):
    """The diagonal token block n of a Gram row block, exact pairwise decays (:func:`_diag_exact`; scalar decay: the plain product times the exact decay matrix);
    returns (row block with it written, the diagonal block ``[16 RPR, 16 RPC]``)."""
    if SCALAR:
        tok_r = tl.arange(0, SUB * RPR) // RPR
        tok_d = tl.arange(0, SUB * RPC) // RPC
        if STRICT:
            live_d = tok_d[None, :] < tok_r[:, None]
        else:
            live_d = tok_d[None, :] <= tok_r[:, None]
        diag = _mm(x, tl.trans(y_d), F32, LOWP) * tl.exp(tl.where(live_d, gx[:, None] - gy_d[None, :], float("-inf")))
    else:
        diag = _diag_exact(x, gx, y_d, gy_d, STRICT, RPR, RPC)
    tok_c = tl.arange(0, C * RPC) // RPC
    full = _tile_cols(diag, C // SUB, SUB * RPR, SUB * RPC)
    return tl.where((tok_c // SUB == n)[None, :], full, out), diag


@triton.jit
def _decay_rows(x, gexp, SCALAR: tl.constexpr):
    """x * e^{gexp} with gexp ``[rows, BK]`` (vector decay) or ``[rows]`` (scalar)."""
    if SCALAR:
        return x * tl.exp(gexp)[:, None]
    else:
        return x * tl.exp(gexp)


@triton.jit
def _unit_lower_inverse(d, RP: tl.constexpr):
    """``(I + d)^{-1}`` for d ``[16 RP, 16 RP]`` strictly lower by token (r x r blocks), by doubling:
    with P the block-diagonal inverse over 2^l-token groups and X the entries between the halves
    of each 2^(l+1)-token group, the next inverse is P - P X P. fp32 throughout."""
    rows = tl.arange(0, SUB * RP)
    tok = rows // RP
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    inv = eye - tl.where((tok[:, None] >> 1) == (tok[None, :] >> 1), d, 0.0)
    for level in tl.static_range(1, 4):
        cross = ((tok[:, None] >> (level + 1)) == (tok[None, :] >> (level + 1))) & (
            (tok[:, None] >> level) != (tok[None, :] >> level))
        px = tl.dot(inv, tl.where(cross, d, 0.0), input_precision="ieee")
        inv = inv - tl.dot(px, inv, input_precision="ieee")
    return inv


# ----------------------------------------------------------------------------- F1
@triton.jit
def _cumsum_at(gs_ptr, bh, c, tok, cols, NT, C: tl.constexpr, BK: tl.constexpr, SCALAR: tl.constexpr):
    """G at one chunk token: ``[BK]``, or a scalar for scalar decay."""
    row = (bh * NT + c).to(tl.int64) * C + tok
    if SCALAR:
        return tl.load(gs_ptr + row)
    else:
        return tl.load(gs_ptr + row * BK + cols)


@triton.jit
def _key_rows(k_ptr, skb, skt, skh, skr, i_b, i_h, t, valid, rank, cols, cmask, RKV: tl.constexpr,
              HDLA: tl.constexpr):
    if HDLA:
        return _load_stack(k_ptr, skb, skt, skh, 0, i_b, i_h, t, valid, rank, cols, cmask, 1)
    else:
        return _load_stack(k_ptr, skb, skt, skh, skr, i_b, i_h, t, valid, rank, cols, cmask, RKV)


@triton.jit
def _ab_rows(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh, beta_ptr, sbeb, sbet, sbeh,
             g_ptr, sgb, sgt, sgh, i_b, i_h, t, valid, rank, cols, cmask, RAB: tl.constexpr, HDLA: tl.constexpr):
    """(A rows, B rows) ``[rows, BK]``: loaded, or built from (k, beta, g) for HDLA."""
    if HDLA:
        return _hdla_stacks(k_ptr, skb, skt, skh, beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh,
                            i_b, i_h, t, valid, rank, cols, cmask)
    else:
        a = _load_stack(a_ptr, sab, sat, sah, sar, i_b, i_h, t, valid, rank, cols, cmask, RAB)
        b = _load_stack(b_ptr, sbb, sbt, sbh, sbr, i_b, i_h, t, valid, rank, cols, cmask, RAB)
        return a, b


@triton.jit
def _exclusive(g_cum, g, RP: tl.constexpr, SCALAR: tl.constexpr):
    """G' = G - g of a row block, and its value at the block's first token (the reference R_n)."""
    gp = g_cum - g
    if SCALAR:
        return gp, 0.0
    else:
        return gp, _row_of(gp, tl.arange(0, SUB * RP), 0)


@triton.jit
def _from_last(x, g_last, g_rows, SCALAR: tl.constexpr):
    """x_i e^{G_last - G_i}."""
    if SCALAR:
        return x * tl.exp(g_last - g_rows)[:, None]
    else:
        return x * tl.exp(g_last[None, :] - g_rows)


@triton.jit
def _hold(x, F32: tl.constexpr, LOWP: tl.constexpr):
    """A tile kept only as a tensor-core operand: fp32 for fp32 input, else the input's 16-bit dtype
    (half the registers; every product rounds its operands to it anyway)."""
    if F32:
        return x
    elif LOWP == 2:
        return x.to(tl.float16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def chunk_cumsum_kernel(g_ptr, gs_ptr, gamma_ptr, sgb, sgt, sgh, T, H, K, NT,
                        C: tl.constexpr, BK: tl.constexpr, SCALAR: tl.constexpr, REVERSE: tl.constexpr):
    """F0 for chunk ``program_id(0)`` of head ``program_id(1)``: G, the chunk-local inclusive cumsum of
    the clamped g (scan order, fp32, ``[C, BK]`` or ``[C]``), and gamma = e^{G_last} ``[K]``. Its own
    kernel so that F1a / F1b (and the backward) read G from memory written by a finished launch."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    i_b = bh // H
    i_h = bh % H
    cols = tl.arange(0, BK)
    cmask = cols < K
    tok, rank, t, valid = _steps(c, 0, C, 1, T, C, REVERSE)
    g_cum = tl.cumsum(_load_gate(g_ptr, sgb, sgt, sgh, i_b, i_h, t, valid, cols, cmask, SCALAR), 0)
    row = (bh * NT + c).to(tl.int64) * C + tok
    last = (tok == C - 1)
    if SCALAR:
        tl.store(gs_ptr + row, g_cum)
        g_last = tl.sum(tl.where(last, g_cum, 0.0), 0) + tl.zeros([BK], tl.float32)
    else:
        tl.store(gs_ptr + row[:, None] * BK + cols[None, :], g_cum)
        g_last = tl.sum(tl.where(last[:, None], g_cum, 0.0), 0)
    tl.store(gamma_ptr + (bh * NT + c).to(tl.int64) * K + cols, tl.exp(g_last), mask=cmask)


@triton.jit
def _wy_rows(x_all, x_n, w_all, l_ab, t_nn, n, RAP: tl.constexpr, C: tl.constexpr, F32: tl.constexpr):
    """One row block of a forward substitution X = (I + L_AB)^{-1} R: X_n = T_nn (R_n - L_AB[n, <n] X_<n),
    written into x_all (rows of the other blocks kept)."""
    rows_a = tl.arange(0, C * RAP)
    x_n = _mm(t_nn, x_n - _mm(l_ab, x_all, F32, 0), F32, 0)
    in_block = ((rows_a // RAP) // SUB == n)[:, None]
    return tl.where(in_block, _tile_rows(x_n, C // SUB, SUB * RAP, x_all.shape[1]), x_all)


@triton.jit
def _gram_rows_a(x, gx, x_rows: tl.constexpr, n, STRICT: tl.constexpr, RPR: tl.constexpr,
                 a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                 beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, gs_ptr,
                 i_b, i_h, bh, c, T, NT, cols, cmask, RAB: tl.constexpr, RAP: tl.constexpr, C: tl.constexpr,
                 BK: tl.constexpr, SCALAR: tl.constexpr, HDLA: tl.constexpr, REVERSE: tl.constexpr,
                 F32: tl.constexpr, LOWP: tl.constexpr):
    """Row block n of ``x_t^T diag(e^{gx_t - G_i}) A_i`` over writer tokens i before (or at) t:
    ``[x_rows, C RAP]`` and its diagonal block. Every 16-token column block of A is loaded directly."""
    out = tl.zeros([x_rows, C * RAP], dtype=tl.float32)
    for m in range(n):  # a loop, not unrolled: one column block live at a time
        tm, rm, t_m, v_m = _steps(c, m * SUB, SUB, RAP, T, C, REVERSE)
        a_m, b_m = _ab_rows(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                            beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, i_b, i_h, t_m, v_m, rm, cols,
                            cmask, RAB, HDLA)
        ga_m = _load_cumsum(gs_ptr, bh, c, tm, cols, NT, C, BK, SCALAR)
        ref_m = _cumsum_at(gs_ptr, bh, c, m * SUB + SUB - 1, cols, NT, C, BK, SCALAR)
        out = _gram_add_block(out, x, gx, a_m, ga_m, ref_m, m, RAP, C, SCALAR, F32, LOWP)
    tn, rn, t_n, v_n = _steps(c, n * SUB, SUB, RAP, T, C, REVERSE)
    a_n, b_n = _ab_rows(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                        beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, i_b, i_h, t_n, v_n, rn, cols,
                        cmask, RAB, HDLA)
    ga_n = _load_cumsum(gs_ptr, bh, c, tn, cols, NT, C, BK, SCALAR)
    return _gram_add_diag(out, x, gx, a_n, ga_n, n, STRICT, RPR, RAP, C, SCALAR, F32, LOWP)


@triton.jit
def _gram_rows_k(x, gx, x_rows: tl.constexpr, n, STRICT: tl.constexpr, RPR: tl.constexpr,
                 k_ptr, skb, skt, skh, skr, gs_ptr, i_b, i_h, bh, c, T, NT, cols, cmask,
                 RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, SCALAR: tl.constexpr,
                 HDLA: tl.constexpr, REVERSE: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr):
    """As :func:`_gram_rows_a` against the write keys K: ``[x_rows, C RKP]`` and its diagonal block."""
    out = tl.zeros([x_rows, C * RKP], dtype=tl.float32)
    for m in range(n):  # a loop, not unrolled: one column block live at a time
        tm, rm, t_m, v_m = _steps(c, m * SUB, SUB, RKP, T, C, REVERSE)
        k_m = _key_rows(k_ptr, skb, skt, skh, skr, i_b, i_h, t_m, v_m, rm, cols, cmask, RKV, HDLA)
        gk_m = _load_cumsum(gs_ptr, bh, c, tm, cols, NT, C, BK, SCALAR)
        ref_m = _cumsum_at(gs_ptr, bh, c, m * SUB + SUB - 1, cols, NT, C, BK, SCALAR)
        out = _gram_add_block(out, x, gx, k_m, gk_m, ref_m, m, RKP, C, SCALAR, F32, LOWP)
    tn, rn, t_n, v_n = _steps(c, n * SUB, SUB, RKP, T, C, REVERSE)
    k_n = _key_rows(k_ptr, skb, skt, skh, skr, i_b, i_h, t_n, v_n, rn, cols, cmask, RKV, HDLA)
    gk_n = _load_cumsum(gs_ptr, bh, c, tn, cols, NT, C, BK, SCALAR)
    return _gram_add_diag(out, x, gx, k_n, gk_n, n, STRICT, RPR, RKP, C, SCALAR, F32, LOWP)


@triton.jit
def chunk_wy_kernel(
    k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, w_ptr, u_ptr,
    skb, skt, skh, skr, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh, sbeb, sbet, sbeh,
    T, H, K, NT,
    RAB: tl.constexpr, RAP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, SCALAR: tl.constexpr, HDLA: tl.constexpr, REVERSE: tl.constexpr,
    F32: tl.constexpr, LOWP: tl.constexpr, PART: tl.constexpr,
):
    """F1a for chunk ``program_id(0)`` of head ``program_id(1)`` (r_ab > 0): W = (I + L_AB)^{-1} Bh
    (PART = 0) or U = (I + L_AB)^{-1} L_KB (PART = 1) by block forward substitution, stored fp32 with
    padded rank slots (rows ``[C * RAP]``). Two launches, so that each keeps a single accumulator live
    across the row blocks (both build the L_AB row blocks). G comes from F0."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    i_b = bh // H
    i_h = bh % H
    chunk = (bh * NT + c).to(tl.int64)
    cols = tl.arange(0, BK)
    cmask = cols < K
    tk, rk, t_k, v_k = _steps(c, 0, C, RKP, T, C, REVERSE)
    ta, ra, t_a, v_a = _steps(c, 0, C, RAP, T, C, REVERSE)
    rows_a = tl.arange(0, C * RAP)
    mcols = tl.arange(0, C * RKP)
    if PART == 0:
        acc = tl.zeros([C * RAP, BK], dtype=tl.float32)
    else:
        acc = tl.zeros([C * RAP, C * RKP], dtype=tl.float32)
    for n in range(C // SUB):
        tb, rb, t_b, v_b = _steps(c, n * SUB, SUB, RAP, T, C, REVERSE)
        a_n, b_n = _ab_rows(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                            beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, i_b, i_h, t_b, v_b, rb, cols,
                            cmask, RAB, HDLA)
        ga_n = _load_cumsum(gs_ptr, bh, c, tb, cols, NT, C, BK, SCALAR)
        gp_b, ref = _exclusive(ga_n, _load_gate(g_ptr, sgb, sgt, sgh, i_b, i_h, t_b, v_b, cols, cmask, SCALAR),
                               RAP, SCALAR)
        l_ab, l_ab_d = _gram_rows_a(b_n, gp_b, SUB * RAP, n, True, RAP, a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt,
                                    sbh, sbr, k_ptr, skb, skt, skh, beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh,
                                    gs_ptr, i_b, i_h, bh, c, T, NT, cols, cmask, RAB, RAP, C, BK, SCALAR, HDLA,
                                    REVERSE, F32, 0)
        t_nn = _unit_lower_inverse(l_ab_d, RAP)
        if PART == 0:
            acc = _wy_rows(acc, _decay_rows(b_n, gp_b, SCALAR), acc, l_ab, t_nn, n, RAP, C, F32)
        else:
            l_kb, l_kb_d = _gram_rows_k(b_n, gp_b, SUB * RAP, n, True, RAP, k_ptr, skb, skt, skh, skr, gs_ptr,
                                        i_b, i_h, bh, c, T, NT, cols, cmask, RKV, RKP, C, BK, SCALAR, HDLA, REVERSE,
                                        F32, 0)
            acc = _wy_rows(acc, l_kb, acc, l_ab, t_nn, n, RAP, C, F32)
    wu_row = chunk * (C * RAP) + rows_a
    if PART == 0:
        tl.store(w_ptr + wu_row[:, None] * BK + cols[None, :], acc)
    else:
        tl.store(u_ptr + wu_row[:, None] * (C * RKP) + mcols[None, :], acc)


@triton.jit
def chunk_nc_kernel(
    k_ptr, v_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, w_ptr, u_ptr, n_ptr, cc_ptr,
    skb, skt, skh, skr, svb, svt, svh, svr, sab, sat, sah, sar, sbb, sbt, sbh, sbr,
    sgb, sgt, sgh, sbeb, sbet, sbeh,
    T, H, K, V, NT,
    RAB: tl.constexpr, RAP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, SCALAR: tl.constexpr, HDLA: tl.constexpr, REVERSE: tl.constexpr,
    F32: tl.constexpr, LOWP: tl.constexpr,
):
    """F1c for chunk ``program_id(0)`` of head ``program_id(1)``: N = At^T W ``[K, K]`` (r_ab > 0) and
    Cc = (Kt - U^T At)^T Vbar ``[K, V]`` (Kt^T Vbar at r_ab = 0), from W, U (F1a) and G (F0)."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    i_b = bh // H
    i_h = bh % H
    chunk = (bh * NT + c).to(tl.int64)
    cols = tl.arange(0, BK)
    cmask = cols < K
    g_last = _cumsum_at(gs_ptr, bh, c, C - 1, cols, NT, C, BK, SCALAR)
    tk, rk, t_k, v_k = _steps(c, 0, C, RKP, T, C, REVERSE)
    gk_all = _load_cumsum(gs_ptr, bh, c, tk, cols, NT, C, BK, SCALAR)
    k_all = _key_rows(k_ptr, skb, skt, skh, skr, i_b, i_h, t_k, v_k, rk, cols, cmask, RKV, HDLA)
    keff = _from_last(k_all, g_last, gk_all, SCALAR)  # Kt, then Kt - U^T At
    if RAB > 0:
        ta, ra, t_a, v_a = _steps(c, 0, C, RAP, T, C, REVERSE)
        ga_all = _load_cumsum(gs_ptr, bh, c, ta, cols, NT, C, BK, SCALAR)
        a_all, b_all = _ab_rows(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                                beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, i_b, i_h, t_a, v_a, ra, cols,
                                cmask, RAB, HDLA)
        at = _from_last(a_all, g_last, ga_all, SCALAR)
        wu_row = chunk * (C * RAP) + tl.arange(0, C * RAP)
        w_all = tl.load(w_ptr + wu_row[:, None] * BK + cols[None, :])
        n_mat = _mm(tl.trans(at), w_all, F32, LOWP)  # N = At^T W  [K, K]
        n_off = chunk * K * K + cols[:, None] * K + cols[None, :]
        tl.store(n_ptr + n_off, n_mat.to(n_ptr.dtype.element_ty), mask=cmask[:, None] & cmask[None, :])
        u_all = tl.load(u_ptr + wu_row[:, None] * (C * RKP) + tl.arange(0, C * RKP)[None, :])
        keff = keff - _mm(tl.trans(u_all), at, F32, 0)
    for i_v in range(tl.cdiv(V, BV)):
        vcols = i_v * BV + tl.arange(0, BV)
        vmask = vcols < V
        vb = _key_rows(v_ptr, svb, svt, svh, svr, i_b, i_h, t_k, v_k, rk, vcols, vmask, RKV, HDLA)
        cc = _mm(tl.trans(keff), vb, F32, 0)
        cc_off = chunk * K * V + cols[:, None] * V + vcols[None, :]
        tl.store(cc_ptr + cc_off, cc, mask=cmask[:, None] & vmask[None, :])


@triton.jit
def chunk_qeff_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr,
    gs_ptr, w_ptr, u_ptr, qe_ptr, mo_ptr,
    sqb, sqt, sqh, skb, skt, skh, skr, sab, sat, sah, sar, sbb, sbt, sbh, sbr,
    sgb, sgt, sgh, sbeb, sbet, sbeh,
    T, H, K, NT, scale,
    RAB: tl.constexpr, RAP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, SCALAR: tl.constexpr, HDLA: tl.constexpr, REVERSE: tl.constexpr,
    F32: tl.constexpr, LOWP: tl.constexpr,
):
    """F1b for chunk ``program_id(0)`` of head ``program_id(1)``, one 16-query row block at a time:
    Qeff = Qh - M_QA W and Mo = M_QK - M_QA U (W, U from F1a, G from F0)."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    i_b = bh // H
    i_h = bh % H
    chunk = (bh * NT + c).to(tl.int64)
    cols = tl.arange(0, BK)
    cmask = cols < K
    tk, rk, t_k, v_k = _steps(c, 0, C, RKP, T, C, REVERSE)
    ta, ra, t_a, v_a = _steps(c, 0, C, RAP, T, C, REVERSE)
    rows_a = tl.arange(0, C * RAP)
    mcols = tl.arange(0, C * RKP)
    mo_col = (mcols // RKP) * RKV + mcols % RKP
    for n in range(C // SUB):
        tq, rq, t_q, v_q = _steps(c, n * SUB, SUB, 1, T, C, REVERSE)
        q_n = _load_stack(q_ptr, sqb, sqt, sqh, 0, i_b, i_h, t_q, v_q, rq, cols, cmask, 1) * scale
        gq_n = _load_cumsum(gs_ptr, bh, c, tq, cols, NT, C, BK, SCALAR)
        mo, mo_d = _gram_rows_k(q_n, gq_n, SUB, n, False, 1, k_ptr, skb, skt, skh, skr, gs_ptr, i_b, i_h, bh, c,
                                T, NT, cols, cmask, RKV, RKP, C, BK, SCALAR, HDLA, REVERSE, F32, LOWP)
        q_eff = _decay_rows(q_n, gq_n, SCALAR)
        if RAB > 0:
            m_qa, m_qa_d = _gram_rows_a(q_n, gq_n, SUB, n, False, 1, a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt,
                                        sbh, sbr, k_ptr, skb, skt, skh, beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt,
                                        sgh, gs_ptr, i_b, i_h, bh, c, T, NT, cols, cmask, RAB, RAP, C, BK, SCALAR,
                                        HDLA, REVERSE, F32, LOWP)
            wu_row = chunk * (C * RAP) + rows_a
            w_all = tl.load(w_ptr + wu_row[:, None] * BK + cols[None, :])
            u_all = tl.load(u_ptr + wu_row[:, None] * (C * RKP) + mcols[None, :])
            q_eff = q_eff - _mm(m_qa, w_all, F32, 0)
            mo = mo - _mm(m_qa, u_all, F32, 0)
        qrow = chunk * C + tq
        tl.store(qe_ptr + qrow[:, None] * K + cols[None, :], q_eff.to(qe_ptr.dtype.element_ty), mask=cmask[None, :])
        tl.store(mo_ptr + qrow[:, None] * (C * RKV) + mo_col[None, :], mo.to(mo_ptr.dtype.element_ty),
                 mask=(mcols % RKP < RKV)[None, :])


# ----------------------------------------------------------------------------- F2
@triton.jit
def chunk_state_kernel(n_ptr, cc_ptr, gamma_ptr, h0_ptr, h_ptr, final_ptr, NT, K, V,
                       BK: tl.constexpr, BV: tl.constexpr, USE_N: tl.constexpr, HAS_H0: tl.constexpr,
                       F32: tl.constexpr):
    """F2: S_c = gamma (.) S_{c-1} - N_c S_{c-1} + Cc_c over the chunks of one (V block, head);
    stores the state entering each chunk (h) and the final state."""
    i_v = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BK)
    vcols = i_v * BV + tl.arange(0, BV)
    kmask = rows < K
    smask = kmask[:, None] & (vcols < V)[None, :]
    s_off = rows[:, None] * V + vcols[None, :]
    if HAS_H0:
        state = tl.load(h0_ptr + bh.to(tl.int64) * K * V + s_off, mask=smask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(NT):
        chunk = (bh * NT + c).to(tl.int64)
        tl.store(h_ptr + chunk * K * V + s_off, state.to(h_ptr.dtype.element_ty), mask=smask)
        gamma = tl.load(gamma_ptr + chunk * K + rows, mask=kmask, other=0.0)
        cc = tl.load(cc_ptr + chunk * K * V + s_off, mask=smask, other=0.0)
        nxt = gamma[:, None] * state + cc
        if USE_N:
            n_mat = tl.load(n_ptr + chunk * K * K + rows[:, None] * K + rows[None, :],
                            mask=kmask[:, None] & kmask[None, :], other=0.0)
            if F32:
                nxt -= tl.dot(n_mat, state, input_precision="ieee")
            else:
                # N is 16-bit already; S = hi + lo in N's dtype, two 16-bit products: S to ~2^-16
                # relative (TF32 would round it to 2^-11) at TF32's cost, half its operand registers
                s_hi = state.to(n_mat.dtype)
                s_lo = (state - s_hi.to(tl.float32)).to(n_mat.dtype)
                nxt -= tl.dot(n_mat, s_hi) + tl.dot(n_mat, s_lo)
        state = nxt
    tl.store(final_ptr + bh.to(tl.int64) * K * V + s_off, state, mask=smask)


# ----------------------------------------------------------------------------- F3
@triton.jit
def chunk_output_kernel(qe_ptr, mo_ptr, h_ptr, v_ptr, o_ptr, svb, svt, svh, svr, sob, sot, soh,
                        T, H, K, V, NT, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, HDLA: tl.constexpr, REVERSE: tl.constexpr,
                        F32: tl.constexpr):
    """F3: O_c = Qeff_c h_c + Mo_c Vbar_c for one (chunk, V block, head)."""
    c = tl.program_id(0)
    i_v = tl.program_id(1)
    bh = tl.program_id(2)
    i_b = bh // H
    i_h = bh % H
    chunk = (bh * NT + c).to(tl.int64)
    cols = tl.arange(0, BK)
    vcols = i_v * BV + tl.arange(0, BV)
    vmask = vcols < V
    tok, rank, t, valid = _steps(c, 0, C, 1, T, C, REVERSE)
    qe = tl.load(qe_ptr + (chunk * C + tok)[:, None] * K + cols[None, :], mask=(cols < K)[None, :], other=0.0)
    h = tl.load(h_ptr + chunk * K * V + cols[:, None] * V + vcols[None, :],
                mask=(cols < K)[:, None] & vmask[None, :], other=0.0)
    mcols = tl.arange(0, C * RKP)
    mo = tl.load(mo_ptr + (chunk * C + tok)[:, None] * (C * RKV) + ((mcols // RKP) * RKV + mcols % RKP)[None, :],
                 mask=(mcols % RKP < RKV)[None, :], other=0.0)
    tk, rk, t_k, v_k = _steps(c, 0, C, RKP, T, C, REVERSE)
    if HDLA:
        vb = _load_stack(v_ptr, svb, svt, svh, 0, i_b, i_h, t_k, v_k, rk, vcols, vmask, 1)
    else:
        vb = _load_stack(v_ptr, svb, svt, svh, svr, i_b, i_h, t_k, v_k, rk, vcols, vmask, RKV)
    if F32:
        o = tl.dot(qe, h, input_precision="ieee") + tl.dot(mo, vb, input_precision="ieee")
    else:
        o = tl.dot(qe, h) + tl.dot(mo, vb.to(mo.dtype))
    off = i_b.to(tl.int64) * sob + t.to(tl.int64) * sot + i_h * soh
    tl.store(o_ptr + off[:, None] + vcols[None, :], o.to(o_ptr.dtype.element_ty), mask=valid[:, None] & vmask[None, :])


# ----------------------------------------------------------------------------- launchers
def _pow2(n: int) -> int:
    return 1 if n <= 1 else triton.next_power_of_2(n)


def default_chunk(r_ab: int, r_kv: int, dk: int) -> int:
    """C = 64 where r_ab*C <= 128 and r_kv*C <= 128 (K <= 128), else 32, else 16 (kernel_plan.md);
    at K > 128 the stacks are kept to 64 rows (F1's shared memory on an H100, sm_90 compile)."""
    rows = 128 if dk <= 128 else 64
    for c in (64, 32):
        if _pow2(max(r_ab, 1)) * c <= rows and _pow2(r_kv) * c <= rows and (c < 64 or dk <= 128):
            return c
    return 16


def launch_warps(stage: str, c: int, rap: int, rkp: int, bk: int) -> int:
    """num_warps per forward stage from the tile sizes (chunk c, padded ranks, key block bk): the
    host-side table that an autotuner would replace once a GPU can time the choices; each entry is
    the smallest count that compiles for sm_90a without spills (``--part aot``)."""
    rows = c * max(rap, rkp)
    if stage == "F0":
        return 4 if c * bk <= 64 * 64 else 8
    if stage in ("F1a", "F1b", "F1c"):
        return 4 if rows * bk <= 64 * 64 else 8
    if stage == "F2":
        return 4 if bk <= 64 else 8
    raise ValueError(f"unknown stage {stage!r}")


_TOO_BIG = set()  # F1 configurations whose shared memory exceeds the GPU's: the next smaller chunk is used


def _strides(x: Optional[torch.Tensor], n: int):
    """The first n strides of x (0s for a missing tensor)."""
    return tuple(x.stride()[:n]) if x is not None else (0,) * n


def _last_contiguous(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _check(q, k, v, a, b, g, hdla_beta, chunk):
    """ValueError naming the argument, before any launch."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    batch, seq_len, heads, dk = q.shape
    if hdla_beta is not None:
        if k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
            raise ValueError("HDLA: k must be [B, T, H, K] like q and v [B, T, H, V]")
        if hdla_beta.shape != q.shape[:3]:
            raise ValueError(f"hdla_beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(hdla_beta.shape)}")
        if g.shape != q.shape:
            raise ValueError("HDLA: g must be [B, T, H, K] (a decay per channel)")
        if a is not None or b is not None:
            raise ValueError("HDLA: a and b must be None (built in the kernel from k, beta, g)")
    else:
        if k.dim() != 5 or k.shape[:3] != q.shape[:3] or k.shape[-1] != dk:
            raise ValueError(f"k must be [B, T, H, r_kv, K], got {tuple(k.shape)}")
        if v.dim() != 5 or v.shape[:4] != k.shape[:4]:
            raise ValueError(f"v must be [B, T, H, r_kv, V] (r_kv = {k.shape[3]}), got {tuple(v.shape)}")
        if a is None or b is None or a.shape != b.shape or a.dim() != 5 or a.shape[:3] != q.shape[:3] \
                or a.shape[-1] != dk:
            raise ValueError("a and b must be [B, T, H, r_ab, K] of one shape (r_ab may be 0)")
        if a.shape[3] > 4 or k.shape[3] > 4 or k.shape[3] < 1:
            raise ValueError(f"ranks must be r_ab <= 4 and 1 <= r_kv <= 4, got r_ab={a.shape[3]}, r_kv={k.shape[3]}")
        if g.shape != q.shape and g.shape != q.shape[:3]:
            raise ValueError(f"g must be [B, T, H, K] or [B, T, H], got {tuple(g.shape)}")
    if chunk is not None and chunk not in CHUNKS:
        raise ValueError(f"chunk must be one of {CHUNKS}, got {chunk}")


def chunk_prepare(q, k, v, a, b, g, scale, reverse, hdla_beta=None, chunk=None, num_warps=None):
    """F1. Shapes: q [B, T, H, K]; k [B, T, H, r_kv, K], v [B, T, H, r_kv, V], a, b [B, T, H, r_ab, K]
    (HDLA: k [B, T, H, K], v [B, T, H, V], a = b = None, hdla_beta [B, T, H]); g [B, T, H, K] or
    [B, T, H]. Returns a dict with N [B, H, NT, K, K] (None at r_ab = 0), Cc [B, H, NT, K, V] fp32,
    Qeff [B, H, NT*C, K], Mo [B, H, NT, C, r_kv*C], gamma [B, H, NT, K] fp32, G (scratch cumsum),
    chunk, and the launch facts F2/F3 reuse (see the module docstring for layouts and dtypes)."""
    _check(q, k, v, a, b, g, hdla_beta, chunk)
    if q.dtype == torch.float64:
        raise ValueError("q is float64: the Triton kernels run fp32/bf16/fp16 (use the float64 loop)")
    hdla = hdla_beta is not None
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    r_kv = 1 if hdla else k.shape[3]
    r_ab = 2 if hdla else a.shape[3]
    q, k, v, a, b, g, hdla_beta = (_last_contiguous(x) for x in (q, k, v, a, b, g, hdla_beta))
    key = (r_ab, r_kv, dk, dv, g.dim() == 3, hdla, q.dtype, num_warps)
    candidates = [chunk] if chunk is not None else _chunk_candidates(key)
    for c in candidates:
        try:
            return _prepare(q, k, v, a, b, g, scale, reverse, hdla_beta, c, num_warps)
        except OutOfResources:  # raised when the binary is loaded, before anything ran
            if c == candidates[-1]:
                raise
            _TOO_BIG.add(key + (c,))


def _chunk_candidates(key) -> list:
    """Chunk sizes to try for an F1 configuration ``key = (r_ab, r_kv, dk, dv, scalar decay, hdla,
    dtype, num_warps)``, largest first: the default rule, less the sizes that did not fit earlier."""
    r_ab, r_kv, dk = key[:3]
    c0 = default_chunk(r_ab, r_kv, dk)
    return [c for c in CHUNKS[::-1] if c <= c0 and key + (c,) not in _TOO_BIG] or [16]


def planned_chunk(r_ab: int, r_kv: int, dk: int, dv: int, scalar: bool, hdla: bool, dtype: torch.dtype) -> int:
    """The chunk :func:`chunk_prepare` (``chunk=None``, default warps) uses for this configuration: the
    host rule the custom ops' fake implementations use for h's shape ``[B, H, cdiv(T, C), K, V]``.
    It equals the real one unless this process has not yet met a configuration whose F1 does not fit
    the GPU's shared memory (then the first real call falls back, and later ones follow the fallback)."""
    if not _TOO_BIG:  # nothing fell back: no lookup (fake tensors may carry symbolic, unhashable sizes)
        return default_chunk(r_ab, r_kv, dk)
    key = tuple(int(x) if isinstance(x, torch.SymInt) else x for x in (r_ab, r_kv, dk, dv))
    return _chunk_candidates(key + (scalar, hdla, dtype, None))[0]


def _prepare(q, k, v, a, b, g, scale, reverse, hdla_beta, c, num_warps):
    """F1 launch with chunk size c (see :func:`chunk_prepare`)."""
    hdla = hdla_beta is not None
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    r_kv = 1 if hdla else k.shape[3]
    r_ab = 2 if hdla else a.shape[3]
    n_chunks = triton.cdiv(seq_len, c)
    f32 = q.dtype == torch.float32
    store_dtype = torch.float32 if f32 else q.dtype
    scalar = g.dim() == 3
    bk = max(16, triton.next_power_of_2(dk))
    bv = max(16, min(64, triton.next_power_of_2(dv)))
    dev = q.device
    bhn = batch * heads * n_chunks
    gs = torch.empty(bhn * c * (1 if scalar else bk), device=dev, dtype=torch.float32)
    n_mat = torch.empty(batch, heads, n_chunks, dk, dk, device=dev, dtype=store_dtype) if r_ab else None
    cc = torch.empty(batch, heads, n_chunks, dk, dv, device=dev, dtype=torch.float32)
    qe = torch.empty(batch, heads, n_chunks * c, dk, device=dev, dtype=store_dtype)
    mo = torch.empty(batch, heads, n_chunks, c, r_kv * c, device=dev, dtype=store_dtype)
    gamma = torch.empty(batch, heads, n_chunks, dk, device=dev, dtype=torch.float32)
    rap, rkp = _pow2(r_ab) if r_ab else 1, _pow2(r_kv)
    k_str = _strides(k, 3) + ((0,) if hdla else (k.stride(3),))
    v_str = _strides(v, 3) + ((0,) if hdla else (v.stride(3),))
    ab_str = (0,) * 4 if hdla or r_ab == 0 else _strides(a, 4)
    bb_str = (0,) * 4 if hdla or r_ab == 0 else _strides(b, 4)
    dummy = gs
    lowp = 0 if f32 else (1 if q.dtype == torch.bfloat16 else 2)
    grid = (n_chunks, batch * heads)
    tiles = dict(C=c, BK=bk, SCALAR=scalar, REVERSE=bool(reverse))
    chunk_cumsum_kernel[grid](g, gs, gamma, *_strides(g, 3), seq_len, heads, dk, n_chunks, **tiles,
                              num_warps=launch_warps("F0", c, rap, rkp, bk))
    a_in, b_in = (a, b) if r_ab and not hdla else (dummy, dummy)
    beta_in = hdla_beta if hdla else dummy
    w_mat = torch.empty(bhn * c * rap * bk if r_ab else 1, device=dev, dtype=torch.float32)
    u_mat = torch.empty(bhn * c * rap * c * rkp if r_ab else 1, device=dev, dtype=torch.float32)
    ranks = dict(RAB=r_ab, RAP=rap, RKV=r_kv, RKP=rkp, HDLA=hdla, F32=f32, LOWP=lowp)
    for part in (0, 1) if r_ab else ():  # W, then U
        chunk_wy_kernel[grid](
            k, a_in, b_in, g, beta_in, gs, w_mat, u_mat,
            *k_str, *ab_str, *bb_str, *_strides(g, 3), *_strides(hdla_beta, 3),
            seq_len, heads, dk, n_chunks, **ranks, **tiles, PART=part,
            num_warps=num_warps or launch_warps("F1a", c, rap, rkp, bk),
        )
    chunk_nc_kernel[grid](
        k, v, a_in, b_in, g, beta_in, gs, w_mat, u_mat, n_mat if r_ab else dummy, cc,
        *k_str, *v_str, *ab_str, *bb_str, *_strides(g, 3), *_strides(hdla_beta, 3),
        seq_len, heads, dk, dv, n_chunks, **ranks, **tiles, BV=bv,
        num_warps=num_warps or launch_warps("F1c", c, rap, rkp, bk),
    )
    chunk_qeff_kernel[grid](
        q, k, a_in, b_in, g, beta_in, gs, w_mat, u_mat, qe, mo,
        *_strides(q, 3), *k_str, *ab_str, *bb_str, *_strides(g, 3), *_strides(hdla_beta, 3),
        seq_len, heads, dk, n_chunks, float(scale), **ranks, **tiles,
        num_warps=num_warps or launch_warps("F1b", c, rap, rkp, bk),
    )
    return dict(N=n_mat, Cc=cc, Qeff=qe, Mo=mo, gamma=gamma, G=gs, chunk=c, r_kv=r_kv, r_ab=r_ab, hdla=hdla,
                seq_len=seq_len, dtype=q.dtype)


def chunk_state_pass(prep, initial_state=None, bv=None, num_warps=None, num_stages=None):
    """F2. Returns (h [B, H, NT, K, V] the state entering each chunk, in q's dtype (fp32 for fp32 q),
    final [B, H, K, V] fp32)."""
    cc = prep["Cc"]
    batch, heads, n_chunks, dk, dv = cc.shape
    f32 = prep["dtype"] == torch.float32
    h = torch.empty(batch, heads, n_chunks, dk, dv, device=cc.device,
                    dtype=torch.float32 if f32 else prep["dtype"])
    final = torch.empty(batch, heads, dk, dv, device=cc.device, dtype=torch.float32)
    bk = max(16, triton.next_power_of_2(dk))
    if bv is None:
        bv = max(16, min(64 if bk <= 128 else 32, triton.next_power_of_2(dv)))
        while bv > 16 and batch * heads * triton.cdiv(dv, bv) < 264:
            bv //= 2
    if num_warps is None:
        num_warps = launch_warps("F2", 0, 1, 1, bk)
    if num_stages is None:
        num_stages = 2 if bk <= 128 else 1  # two stages of a 16-bit 256 x 256 N need 256 KB of shared memory
    if initial_state is not None:
        if initial_state.shape != (batch, heads, dk, dv):
            raise ValueError(f"initial_state must be [B, H, K, V] = {(batch, heads, dk, dv)}, "
                             f"got {tuple(initial_state.shape)}")
        initial_state = initial_state.contiguous()
    n_mat = prep["N"]
    chunk_state_kernel[(triton.cdiv(dv, bv), batch * heads)](
        n_mat if n_mat is not None else cc, cc, prep["gamma"],
        initial_state if initial_state is not None else cc, h, final, n_chunks, dk, dv,
        BK=bk, BV=bv, USE_N=n_mat is not None, HAS_H0=initial_state is not None, F32=f32,
        num_warps=num_warps, num_stages=num_stages,
    )
    return h, final


def chunk_output(prep, h, v, reverse, bv=None, num_warps=None):
    """F3. v as given to :func:`chunk_prepare`; returns o [B, T, H, V] in q's dtype."""
    qe = prep["Qeff"]
    batch, heads, n_chunks, dk, dv = h.shape
    c, r_kv, seq_len = prep["chunk"], prep["r_kv"], prep["seq_len"]
    v = _last_contiguous(v)
    o = torch.empty(batch, seq_len, heads, dv, device=qe.device, dtype=prep["dtype"])
    bk = max(16, triton.next_power_of_2(dk))
    if bv is None:
        bv = max(16, min(64, triton.next_power_of_2(dv)))
    if num_warps is None:
        num_warps = 4
    hdla = prep["hdla"]
    v_str = _strides(v, 3) + ((0,) if hdla else (v.stride(3),))
    chunk_output_kernel[(n_chunks, triton.cdiv(dv, bv), batch * heads)](
        qe, prep["Mo"], h, v, o, *v_str, *_strides(o, 3), seq_len, heads, dk, dv, n_chunks,
        RKV=r_kv, RKP=_pow2(r_kv), C=c, BK=bk, BV=bv, HDLA=hdla, REVERSE=bool(reverse),
        F32=prep["dtype"] == torch.float32, num_warps=num_warps,
    )
    return o


def generalized_forward(q, k, v, a, b, g, scale, initial_state, reverse, hdla_beta=None, chunk=None):
    """F1, F2, F3: returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32, h
    [B, H, NT, K, V] the state entering each chunk). Shapes as :func:`chunk_prepare`."""
    scale = 1.0 if scale is None else scale
    prep = chunk_prepare(q, k, v, a, b, g, scale, reverse, hdla_beta=hdla_beta, chunk=chunk)
    h, final = chunk_state_pass(prep, initial_state)
    return chunk_output(prep, h, v, reverse), final, h
