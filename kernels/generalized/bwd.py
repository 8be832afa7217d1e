"""Backward of the chunk algorithm (issue 11; notation of /work/kernel_plan.md and the float64
specification ``tests/chunk_bwd_reference.py``, which these kernels follow stage by stage).

Per batch b, head h and chunk c (scan order, C tokens; t = p or T-1-p when reverse):

    O_c = Qeff_c S_{c-1} + Mo_c Vbar_c,     S_c = gamma_c (.) S_{c-1} - N_c S_{c-1} + Cc_c

B1 (``_bwd_state_kernel``, grid V/BV x B*H, serial over chunks): the cotangent of the state leaving
each chunk, dS_{c-1} = gamma (.) dS_c - N_c^T dS_c + Qeff_c^T dO_c, stored per chunk, and dh0.

B2 (``_bwd_chunk_kernel``, one source launched as two or three stages, no atomics: each program owns
its chunk's rows; stage 1 on a grid NT x B*H with the full K, stages 2 and 3 on NT x B*H x K/BKS): the chunk
VJP given S_{c-1} (the forward's h) and dS_c. It recomputes the Gram matrices (exact decays:
off-diagonal 16-token blocks factor through the reference G' at the block's first token, both
factors <= 1; diagonal blocks use pairwise exp(X_t - G_i), masked before exp), T = (I + L_AB)^-1,
W = T Bh, U = T L_KB, then runs the VJP back through them and through the decays; dg is the
chunk-local reverse cumsum of the dG / dG' cotangents; HDLA adds the chain rule through
A = [beta u, k], B = [k, beta u - beta^2 s k], u = exp(g) k, s = k.u.

Flat rank rows are token-major, rank fastest (row t*RP + j; RP = rank padded to a power of 2,
padded rows are zero). g is clamped at LOG_ZERO_FP32 as loaded, dg = 0 below it.
"""

import torch
import triton
import triton.language as tl

from ..utils import LOG_ZERO_FP32
from . import fwd

SUB = 16  # token sub-block of the exact decays


@triton.jit
def _mm(a, b, LOWP: tl.constexpr):
    """a @ b, fp32 accumulate: bf16 operands (LOWP) or exact fp32."""
    if LOWP:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def _expand(x, C: tl.constexpr, RP: tl.constexpr, BD: tl.constexpr):
    """Per-token ``[C, BD]`` -> flat rank rows ``[C*RP, BD]`` (each token's row repeated RP times)."""
    if RP == 1:
        out = x
    else:
        out = tl.reshape(tl.broadcast_to(x[:, None, :], (C, RP, BD)), (C * RP, BD))
    return out


@triton.jit
def _collapse(x, C: tl.constexpr, RP: tl.constexpr, BD: tl.constexpr):
    """Flat rank rows ``[C*RP, BD]`` -> per token ``[C, BD]`` (sum over the token's rows)."""
    if RP == 1:
        out = x
    else:
        out = tl.sum(tl.reshape(x, (C, RP, BD)), 1)
    return out


@triton.jit
def _row(x, rows, i):
    """Row i of a 2-D tile as a vector."""
    return tl.sum(tl.where(rows[:, None] == i, x, 0.0), 0)


@triton.jit
def _col(x, cols, i):
    """Column i of a 2-D tile as a vector."""
    return tl.sum(tl.where(cols[None, :] == i, x, 0.0), 1)


@triton.jit
def _token_offsets(c, C: tl.constexpr, T, H, i_b, i_h, REVERSE: tl.constexpr):
    """Token slots of chunk c: (memory index ((b*T + t)*H + h) as int64 [C], valid [C])."""
    p = c * C + tl.arange(0, C)
    valid = p < T
    if REVERSE:
        t = T - 1 - p
    else:
        t = p
    t = tl.where(valid, t, 0)
    return ((i_b * T + t) * H + i_h).to(tl.int64), valid


@triton.jit
def _load_rows(ptr, tok, valid, R: tl.constexpr, RP: tl.constexpr, C: tl.constexpr, D, BD: tl.constexpr, d0):
    """Rank rows of ``[B, T, H, R, D]`` (columns d0 .. d0+BD) for the chunk's tokens as ``[C*RP, BD]``
    fp32 (zero padding)."""
    rho = tl.arange(0, C * RP)
    j = rho % RP
    cd = d0 + tl.arange(0, BD)
    tok_r = tl.reshape(tl.broadcast_to(tok[:, None], (C, RP)), (C * RP,)) if RP > 1 else tok
    val_r = tl.reshape(tl.broadcast_to(valid[:, None], (C, RP)), (C * RP,)) if RP > 1 else valid
    off = (tok_r * R + j)[:, None] * D + cd[None, :]
    m = (val_r & (j < R))[:, None] & (cd[None, :] < D)
    return tl.load(ptr + off, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, x, tok, valid, R: tl.constexpr, RP: tl.constexpr, C: tl.constexpr, D, BD: tl.constexpr,
                d0):
    """Store ``[C*RP, BD]`` rank rows into ``[B, T, H, R, D]`` (columns d0 .. d0+BD)."""
    rho = tl.arange(0, C * RP)
    j = rho % RP
    cd = d0 + tl.arange(0, BD)
    tok_r = tl.reshape(tl.broadcast_to(tok[:, None], (C, RP)), (C * RP,)) if RP > 1 else tok
    val_r = tl.reshape(tl.broadcast_to(valid[:, None], (C, RP)), (C * RP,)) if RP > 1 else valid
    off = (tok_r * R + j)[:, None] * D + cd[None, :]
    m = (val_r & (j < R))[:, None] & (cd[None, :] < D)
    tl.store(ptr + off, x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _state_block_step(ds_i, ds_j, n_ptr, n_off, i0, j0, gam_ptr, g_off, qe_i, do, ck, mk_i, mk_j, K,
                      TWO: tl.constexpr, LOWP: tl.constexpr):
    """One K block i of dS_{c-1} = gamma (.) dS_c - N^T dS_c + Qeff^T dO: ``ds_i`` (rows i0 ..) and,
    when the state is split in two K blocks (TWO), ``ds_j`` (rows j0 ..) of dS_c; N^T's block (i, i)
    and (i, j) are loaded from ``n_ptr + n_off`` (row-major [K, K])."""
    rows_i = i0 + ck
    gam = tl.load(gam_ptr + g_off + rows_i, mask=mk_i, other=0.0)
    n_ii = tl.load(n_ptr + n_off + rows_i[:, None] * K + rows_i[None, :], mask=mk_i[:, None] & mk_i[None, :],
                   other=0.0)
    out = gam[:, None] * ds_i - _mm(tl.trans(n_ii), ds_i, LOWP) + _mm(tl.trans(qe_i), do, LOWP)
    if TWO:
        rows_j = j0 + ck
        n_ji = tl.load(n_ptr + n_off + rows_j[:, None] * K + rows_i[None, :], mask=mk_j[:, None] & mk_i[None, :],
                       other=0.0)
        out -= _mm(tl.trans(n_ji), ds_j, LOWP)
    return out


@triton.jit
def _bwd_state_kernel(
    n_ptr, qeff_ptr, gamma_ptr, do_ptr, dht_ptr, ds_ptr, dh0_ptr,
    T, H, K, V, NT,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, TWO: tl.constexpr,
    REVERSE: tl.constexpr, HAS_DHT: tl.constexpr, LOWP: tl.constexpr,
):
    """B1: dS_{c-1} = gamma_c (.) dS_c - N_c^T dS_c + Qeff_c^T dO_c, from the last chunk to the first.
    Stores ds[b, h, c] = dS_c (the cotangent of the state leaving chunk c, in ds's dtype: the input
    dtype) and dh0 (fp32); the carried dS stays fp32. The state's K rows are one block of BK rows, or
    two (TWO, K = 2 BK: K = 256) so that no [K, K] tile of N is ever held: four [BK, BK] blocks."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mv = cv[None, :] < V
    mk0 = ck < K
    mk1 = (BK + ck) < K
    off0 = ck[:, None] * V + cv[None, :]
    off1 = (BK + ck)[:, None] * V + cv[None, :]
    bh64 = i_bh.to(tl.int64)
    ds0 = tl.zeros([BK, BV], dtype=tl.float32)
    ds1 = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        ds0 = tl.load(dht_ptr + bh64 * K * V + off0, mask=mk0[:, None] & mv, other=0.0).to(tl.float32)
        if TWO:
            ds1 = tl.load(dht_ptr + bh64 * K * V + off1, mask=mk1[:, None] & mv, other=0.0).to(tl.float32)
    ct = tl.arange(0, C)
    for i in range(NT):
        c = NT - 1 - i
        blk = bh64 * NT + c
        tl.store(ds_ptr + blk * K * V + off0, ds0.to(ds_ptr.dtype.element_ty), mask=mk0[:, None] & mv)
        if TWO:
            tl.store(ds_ptr + blk * K * V + off1, ds1.to(ds_ptr.dtype.element_ty), mask=mk1[:, None] & mv)
        tok, valid = _token_offsets(c, C, T, H, i_b, i_h, REVERSE)
        do = tl.load(do_ptr + tok[:, None] * V + cv[None, :], mask=valid[:, None] & mv, other=0.0)
        q_rows = (bh64 * NT * C + c * C + ct)[:, None] * K
        qe0 = tl.load(qeff_ptr + q_rows + ck[None, :], mask=mk0[None, :], other=0.0)
        new0 = _state_block_step(ds0, ds1, n_ptr, blk * K * K, 0, BK, gamma_ptr, blk * K, qe0, do, ck, mk0, mk1,
                                 K, TWO, LOWP)
        if TWO:
            qe1 = tl.load(qeff_ptr + q_rows + (BK + ck)[None, :], mask=mk1[None, :], other=0.0)
            ds1 = _state_block_step(ds1, ds0, n_ptr, blk * K * K, BK, 0, gamma_ptr, blk * K, qe1, do, ck, mk1, mk0,
                                    K, TWO, LOWP)
        ds0 = new0
    tl.store(dh0_ptr + bh64 * K * V + off0, ds0, mask=mk0[:, None] & mv)
    if TWO:
        tl.store(dh0_ptr + bh64 * K * V + off1, ds1, mask=mk1[:, None] & mv)


@triton.jit
def _gram_off(x, y, Gp, el, ty, ct, C: tl.constexpr, Y, RXP: tl.constexpr, BK: tl.constexpr,
              SUBC: tl.constexpr, LOWP: tl.constexpr):
    """Off-diagonal 16-token blocks of sum_k x_tk y_ik exp(X_t - Y_i): rows in block n, columns before
    it, factored through R_n = G' at the block's first token: (x e^{X - R_n}) (y e^{R_n - Y})^T, both
    factors <= 1. ``el`` = e^{X - R(row)} on x's rows. Returns [RX, RY]."""
    xl = x * el
    bx = (tl.arange(0, C * RXP) // RXP) // SUBC
    out = tl.zeros([C * RXP, y.shape[0]], dtype=tl.float32)
    for n in tl.static_range(1, C // SUBC):
        ref = _row(Gp, ct, n * SUBC)
        yr = tl.where((ty < n * SUBC)[:, None], y * tl.exp(tl.minimum(ref[None, :] - Y, 0.0)), 0.0)
        out += tl.where((bx == n)[:, None], _mm(xl, tl.trans(yr), LOWP), 0.0)
    return out


@triton.jit
def _gram_off_vjp(D, x, y, Gp, el, ty, ct, C: tl.constexpr, Y, RXP: tl.constexpr, BK: tl.constexpr,
                  SUBC: tl.constexpr, LOWP: tl.constexpr):
    """VJP of :func:`_gram_off` w.r.t. x and y for the cotangent D [RX, RY]: (dx, dy)."""
    xl = x * el
    bx = (tl.arange(0, C * RXP) // RXP) // SUBC
    dxl = tl.zeros(x.shape, dtype=tl.float32)
    dy = tl.zeros(y.shape, dtype=tl.float32)
    for n in tl.static_range(1, C // SUBC):
        ref = _row(Gp, ct, n * SUBC)
        er = tl.where((ty < n * SUBC)[:, None], tl.exp(tl.minimum(ref[None, :] - Y, 0.0)), 0.0)
        dxl += tl.where((bx == n)[:, None], _mm(D, y * er, LOWP), 0.0)
        dy += er * _mm(tl.trans(tl.where((bx == n)[:, None], D, 0.0)), xl, LOWP)
    return dxl * el, dy


@triton.jit
def _scalar_decay(X, Y, tx, ty, STRICT: tl.constexpr):
    """exp(X_t - Y_i) for token pairs with i < t (STRICT) or i <= t, else 0: [RX, RY] (scalar decay)."""
    if STRICT:
        m = ty[None, :] < tx[:, None]
    else:
        m = ty[None, :] <= tx[:, None]
    return tl.exp(tl.where(m, X[:, None] - Y[None, :], float("-inf")))


@triton.jit
def _hdla_s(k_ptr, g_ptr, tok, valid, K, BKS: tl.constexpr, LOG_ZERO: tl.constexpr):
    """HDLA's s_t = k_t . u_t = sum_k exp(g_tk) k_tk^2 over the full K, in BKS-column tiles: [C]."""
    s = tl.zeros(tok.shape, dtype=tl.float32)
    for k1 in range(0, K, BKS):
        cj = k1 + tl.arange(0, BKS)
        m = valid[:, None] & (cj[None, :] < K)
        kj = tl.load(k_ptr + tok[:, None] * K + cj[None, :], mask=m, other=0.0).to(tl.float32)
        gj = tl.maximum(tl.load(g_ptr + tok[:, None] * K + cj[None, :], mask=m, other=0.0).to(tl.float32), LOG_ZERO)
        s += tl.sum(tl.exp(gj) * kj * kj, 1)
    return s


@triton.jit
def _bwd_chunk_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, beta_ptr, g_ptr, h_ptr, ds_ptr, do_ptr,
    dq_ptr, dk_ptr, dv_ptr, da_ptr, db_ptr, dbeta_ptr, dg_ptr,
    sq_ptr, sk_ptr, sa_ptr, sb_ptr, sgam_ptr, dqk_ptr, dqa_ptr, dab_ptr, dkb_ptr, red_ptr,
    T, H, K, V, NT, NKT, scale,
    C: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    RKV: tl.constexpr, RKP: tl.constexpr, RAB: tl.constexpr, RAP: tl.constexpr,
    HDLA: tl.constexpr, SCALAR_G: tl.constexpr, REVERSE: tl.constexpr, LOWP: tl.constexpr,
    SUBC: tl.constexpr, LOG_ZERO: tl.constexpr, STAGE: tl.constexpr,
):
    """B2, in two or three launches (STAGE, module docstring). Stack tiles: K rows [C*RKP, BKS], A and
    B rows [C*RAP, BKS]; token tiles [C, BKS], columns k0 .. k0+BKS (stage 1: BKS = BK, k0 = 0).

    STAGE 1: recompute the Gram matrices, T, W, U; the V contractions (dv stored); back through Mo,
    Qeff, N, E, W, U and T to the cotangents of the Gram matrices. Stores per chunk (fp32 scratch,
    padded tiles): dQeff [C, BK] (sq), dKt [C*RKP, BK] (sk), dgamma [BK] (sgam), dAt, dW' = T^T dW
    [C*RAP, BK] (sa, sb) and the Gram cotangents dM_QK [C, C*RKP], dM_QA [C, C*RAP], dL_AB
    [C*RAP, C*RAP], dL_KB [C*RAP, C*RKP] (dqk, dqa, dab, dkb).
    STAGE 2 (one K tile of BKS columns): the Gram VJP into dq, dk, da, db, the decays' chain rule, dg by
    the chunk-local reverse cumsum, HDLA's chain rule except its full-K sums; stores the gradients and,
    for HDLA or a per-head decay, the tile's partial sums [C] x 2 in red [blocks, NKT, 2, C].
    STAGE 3 (HDLA, or per-head decay): sums the partials over the K tiles; HDLA adds the s = k.u terms
    to dk and dg (read back in their dtype: one more rounding for bf16) and stores dbeta; a per-head
    decay stores dg [C]."""
    c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bh64 = i_bh.to(tl.int64)
    ct = tl.arange(0, C)
    k0 = tl.program_id(2) * BKS
    ck = k0 + tl.arange(0, BKS)
    mk = ck < K
    tok, valid = _token_offsets(c, C, T, H, i_b, i_h, REVERSE)
    m_tk = valid[:, None] & mk[None, :]
    # ---- decays: G inclusive, G' exclusive chunk-local cumsums (fp32), clamped at LOG_ZERO
    if SCALAR_G:
        g_raw = tl.load(g_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        g_tok = tl.broadcast_to(tl.maximum(g_raw, LOG_ZERO)[:, None], (C, BKS))
    else:
        g_raw = tl.load(g_ptr + tok[:, None] * K + ck[None, :], mask=m_tk, other=0.0).to(tl.float32)
        g_tok = tl.maximum(g_raw, LOG_ZERO)
    G = tl.cumsum(g_tok, 0)
    Gp = G - g_tok
    GL = _row(G, ct, C - 1)
    # reference of the off-diagonal factorisation: G' at the first token of each token's block
    Rtok = tl.zeros([C, BKS], dtype=tl.float32)
    for n in tl.static_range(0, C // SUBC):
        Rtok = tl.where((ct // SUBC == n)[:, None], _row(Gp, ct, n * SUBC)[None, :], Rtok)
    # ---- inputs
    xq = scale * tl.load(q_ptr + tok[:, None] * K + ck[None, :], mask=m_tk, other=0.0).to(tl.float32)
    if HDLA:
        kk = tl.load(k_ptr + tok[:, None] * K + ck[None, :], mask=m_tk, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        lam = tl.exp(g_tok)
        u = lam * kk
        s = _hdla_s(k_ptr, g_ptr, tok, valid, K, BKS, LOG_ZERO)
        j3 = tl.arange(0, 2)[None, :, None]
        Af = tl.reshape(tl.where(j3 == 0, (beta[:, None] * u)[:, None, :], kk[:, None, :]), (C * 2, BKS))
        b1 = beta[:, None] * u - (beta * beta * s)[:, None] * kk
        Bf = tl.reshape(tl.where(j3 == 0, kk[:, None, :], b1[:, None, :]), (C * 2, BKS))
        Kf = kk
    else:
        Kf = _load_rows(k_ptr, tok, valid, RKV, RKP, C, K, BKS, k0)
        if RAB > 0:
            Af = _load_rows(a_ptr, tok, valid, RAB, RAP, C, K, BKS, k0)
            Bf = _load_rows(b_ptr, tok, valid, RAB, RAP, C, K, BKS, k0)
    tk = tl.arange(0, C * RKP) // RKP  # token of each K row
    Gk = _expand(G, C, RKP, BKS)
    if STAGE != 1:  # stage 1 builds the decayed stacks after the inverse (fewer live tiles in its Gram pass)
        Kt = Kf * tl.exp(GL[None, :] - Gk)
    el_q = tl.exp(G - Rtok)
    if SCALAR_G:
        Gs = _row(tl.trans(G), ck, k0)  # [C]: the per-head cumsum
        Gps = _row(tl.trans(Gp), ck, k0)
        Gks = tl.reshape(tl.broadcast_to(Gs[:, None], (C, RKP)), (C * RKP,)) if RKP > 1 else Gs
        dec_qk = _scalar_decay(Gs, Gks, ct, tk, False)
    if RAB > 0:
        ta = tl.arange(0, C * RAP) // RAP
        Ga = _expand(G, C, RAP, BKS)
        Gpb = _expand(Gp, C, RAP, BKS)
        if STAGE != 1:
            At = Af * tl.exp(GL[None, :] - Ga)
            Bh = Bf * tl.exp(Gpb)
        el_b = tl.exp(Gpb - _expand(Rtok, C, RAP, BKS))
        if SCALAR_G:
            Gas = tl.reshape(tl.broadcast_to(Gs[:, None], (C, RAP)), (C * RAP,)) if RAP > 1 else Gs
            Gpbs = tl.reshape(tl.broadcast_to(Gps[:, None], (C, RAP)), (C * RAP,)) if RAP > 1 else Gps
            dec_qa = _scalar_decay(Gs, Gas, ct, ta, False)
            dec_ab = _scalar_decay(Gpbs, Gas, ta, ta, True)
            dec_kb = _scalar_decay(Gpbs, Gks, ta, tk, True)
    blk = bh64 * NT + c
    ckr = tl.arange(0, C * RKP)
    car = tl.arange(0, C * RAP)
    if STAGE == 1:
        # ---- Gram matrices (forward recompute): off-diagonal 16-token blocks, then the exact diagonal
        if SCALAR_G:
            M_QK = _mm(xq, tl.trans(Kf), LOWP) * dec_qk
        else:
            M_QK = _gram_off(xq, Kf, Gp, el_q, tk, ct, C, Gk, 1, BKS, SUBC, LOWP)
        if RAB > 0:
            if SCALAR_G:
                M_QA = _mm(xq, tl.trans(Af), LOWP) * dec_qa
                L_AB = _mm(Bf, tl.trans(Af), LOWP) * dec_ab
                L_KB = _mm(Bf, tl.trans(Kf), LOWP) * dec_kb
            else:
                M_QA = _gram_off(xq, Af, Gp, el_q, ta, ct, C, Ga, 1, BKS, SUBC, LOWP)
                L_AB = _gram_off(Bf, Af, Gp, el_b, ta, ct, C, Ga, RAP, BKS, SUBC, LOWP)
                L_KB = _gram_off(Bf, Kf, Gp, el_b, tk, ct, C, Gk, RAP, BKS, SUBC, LOWP)
        if not SCALAR_G:
            # diagonal 16-token blocks, exact: one pass over the column token i with e^{G_t - G_i}, e^{G'_t - G_i}
            ck_cols = tl.arange(0, C * RKP)
            for i in range(C):
                Gi = _row(G, ct, i)
                same = (ct // SUBC) == (i // SUBC)
                e_g = tl.exp(tl.where((same & (ct >= i))[:, None], G - Gi[None, :], float("-inf")))
                for l in tl.static_range(RKV):
                    y = _row(Kf, ck_cols, i * RKP + l)
                    M_QK = tl.where(ck_cols[None, :] == i * RKP + l, M_QK + tl.sum(xq * e_g * y[None, :], 1)[:, None],
                                    M_QK)
                if RAB > 0:
                    ca = tl.arange(0, C * RAP)
                    e_gp = tl.exp(tl.where((same & (ct > i))[:, None], Gp - Gi[None, :], float("-inf")))
                    e_gpb = _expand(e_gp, C, RAP, BKS) * Bf
                    for l in tl.static_range(RAB):
                        y = _row(Af, ca, i * RAP + l)
                        M_QA = tl.where(ca[None, :] == i * RAP + l, M_QA + tl.sum(xq * e_g * y[None, :], 1)[:, None],
                                        M_QA)
                        L_AB = tl.where(ca[None, :] == i * RAP + l, L_AB + tl.sum(e_gpb * y[None, :], 1)[:, None],
                                        L_AB)
                    for l in tl.static_range(RKV):
                        y = _row(Kf, ck_cols, i * RKP + l)
                        L_KB = tl.where(ck_cols[None, :] == i * RKP + l,
                                        L_KB + tl.sum(e_gpb * y[None, :], 1)[:, None], L_KB)
        # ---- T = (I + L_AB)^-1 by forward substitution (fp32), W = T Bh, U = T L_KB
        Kt = Kf * tl.exp(GL[None, :] - Gk)
        if RAB > 0:
            ra = tl.arange(0, C * RAP)
            Tm = tl.where(ra[:, None] == ra[None, :], 1.0, 0.0)
            for r in range(1, C * RAP):
                l_row = _row(L_AB, ra, r)
                new = tl.where(ra == r, 1.0, 0.0) - tl.sum(l_row[:, None] * Tm, 0)
                Tm = tl.where(ra[:, None] == r, new[None, :], Tm)
            W = _mm(Tm, Bf * tl.exp(Gpb), LOWP)
            U = _mm(Tm, L_KB, LOWP)
            At = Af * tl.exp(GL[None, :] - Ga)
            Mo = M_QK - _mm(M_QA, U, LOWP)
            Et = Kt - _mm(tl.trans(U), At, LOWP)  # E^T = Kt - U^T At  [C*RKP, BK]
        else:
            Mo = M_QK
            Et = Kt
        # ---- the V contractions, one V block at a time; dv stored per block
        dQeff = tl.zeros([C, BKS], dtype=tl.float32)
        dMo = tl.zeros([C, C * RKP], dtype=tl.float32)
        dN = tl.zeros([BKS, BKS], dtype=tl.float32)
        dE = tl.zeros([BKS, C * RKP], dtype=tl.float32)
        dgam = tl.zeros([BKS], dtype=tl.float32)
        for v0 in range(0, V, BV):
            cv = v0 + tl.arange(0, BV)
            mkv = mk[:, None] & (cv[None, :] < V)
            s_in = tl.load(h_ptr + blk * K * V + ck[:, None] * V + cv[None, :], mask=mkv, other=0.0).to(tl.float32)
            ds = tl.load(ds_ptr + blk * K * V + ck[:, None] * V + cv[None, :], mask=mkv, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + tok[:, None] * V + cv[None, :], mask=valid[:, None] & (cv[None, :] < V),
                         other=0.0).to(tl.float32)
            vf = _load_rows(v_ptr, tok, valid, RKV, RKP, C, V, BV, v0)
            dQeff += _mm(do, tl.trans(s_in), LOWP)
            dMo += _mm(do, tl.trans(vf), LOWP)
            dN -= _mm(ds, tl.trans(s_in), LOWP)
            dE += _mm(ds, tl.trans(vf), LOWP)
            dgam += tl.sum(ds * s_in, 1)
            dvf = _mm(tl.trans(Mo), do, LOWP) + _mm(Et, ds, LOWP)
            _store_rows(dv_ptr, dvf, tok, valid, RKV, RKP, C, V, BV, v0)
        dMo = tl.where(tk[None, :] <= ct[:, None], dMo, 0.0)
        # ---- back through Mo, Qeff, N, E, W, U, T to the Gram cotangents; stored for stage 2
        tl.store(sq_ptr + blk * C * BK + ct[:, None] * BK + ck[None, :], dQeff)
        tl.store(sk_ptr + blk * C * RKP * BK + ckr[:, None] * BK + ck[None, :], tl.trans(dE))
        tl.store(sgam_ptr + blk * BK + ck, dgam)
        tl.store(dqk_ptr + blk * C * C * RKP + ct[:, None] * (C * RKP) + ckr[None, :], dMo)
        if RAB > 0:
            dAt = -_mm(U, tl.trans(dE), LOWP) + _mm(W, tl.trans(dN), LOWP)
            dU = -_mm(At, dE, LOWP) - _mm(tl.trans(M_QA), dMo, LOWP)
            dW = _mm(At, dN, LOWP) - _mm(tl.trans(M_QA), dQeff, LOWP)
            dM_QA = -_mm(dQeff, tl.trans(W), LOWP) - _mm(dMo, tl.trans(U), LOWP)
            dWp = _mm(tl.trans(Tm), dW, LOWP)
            dUp = _mm(tl.trans(Tm), dU, LOWP)
            dL_AB = -_mm(dWp, tl.trans(W), LOWP) - _mm(dUp, tl.trans(U), LOWP)
            dL_AB = tl.where(ta[None, :] < ta[:, None], dL_AB, 0.0)
            dL_KB = tl.where(tk[None, :] < ta[:, None], dUp, 0.0)
            dM_QA = tl.where(ta[None, :] <= ct[:, None], dM_QA, 0.0)
            tl.store(sa_ptr + blk * C * RAP * BK + car[:, None] * BK + ck[None, :], dAt)
            tl.store(sb_ptr + blk * C * RAP * BK + car[:, None] * BK + ck[None, :], dWp)
            tl.store(dqa_ptr + blk * C * C * RAP + ct[:, None] * (C * RAP) + car[None, :], dM_QA)
            tl.store(dab_ptr + blk * C * RAP * C * RAP + car[:, None] * (C * RAP) + car[None, :], dL_AB)
            tl.store(dkb_ptr + blk * C * RAP * C * RKP + car[:, None] * (C * RKP) + ckr[None, :], dL_KB)
    elif STAGE == 2:
        dQeff = tl.load(sq_ptr + blk * C * BK + ct[:, None] * BK + ck[None, :])
        dKt = tl.load(sk_ptr + blk * C * RKP * BK + ckr[:, None] * BK + ck[None, :])
        dgam = tl.load(sgam_ptr + blk * BK + ck)
        if RAB > 0:
            dAt = tl.load(sa_ptr + blk * C * RAP * BK + car[:, None] * BK + ck[None, :])
            dWp = tl.load(sb_ptr + blk * C * RAP * BK + car[:, None] * BK + ck[None, :])
        # ---- stage 2: the direct (elementwise) terms, then the Gram VJP; each Gram cotangent is loaded
        # right before its matmuls so that no two of the full tiles are live at once
        dGL = tl.exp(GL) * dgam + tl.sum(Kt * dKt, 0)
        dKf = dKt * tl.exp(GL[None, :] - Gk)
        dGk = -(Kt * dKt)
        dq_acc = dQeff * tl.exp(G)  # d(scale q) from Qh = scale q e^G
        dG = xq * dq_acc
        if SCALAR_G:
            Dq = _tile(dqk_ptr, blk, ct, ckr, C, C * RKP) * dec_qk
            dxq = _mm(Dq, Kf, LOWP)
            dyk = _mm(tl.trans(Dq), xq, LOWP)
        else:
            dxq, dyk = _gram_off_vjp(_tile(dqk_ptr, blk, ct, ckr, C, C * RKP),
                                     xq, Kf, Gp, el_q, tk, ct, C, Gk, 1, BKS, SUBC, LOWP)
        if RAB > 0:
            dGL += tl.sum(At * dAt, 0)
            dAf = dAt * tl.exp(GL[None, :] - Ga)
            dGa = -(At * dAt)
            dBf = dWp * tl.exp(Gpb)
            dGpb = Bh * dWp
            if SCALAR_G:
                D1 = _tile(dqa_ptr, blk, ct, car, C, C * RAP) * dec_qa
                dxq += _mm(D1, Af, LOWP)
                dya = _mm(tl.trans(D1), xq, LOWP)
                D2 = _tile(dab_ptr, blk, car, car, C * RAP, C * RAP) * dec_ab
                dxb = _mm(D2, Af, LOWP)
                dya += _mm(tl.trans(D2), Bf, LOWP)
                D3 = _tile(dkb_ptr, blk, car, ckr, C * RAP, C * RKP) * dec_kb
                dxb += _mm(D3, Kf, LOWP)
                dyk += _mm(tl.trans(D3), Bf, LOWP)
            else:
                dx1, dya = _gram_off_vjp(_tile(dqa_ptr, blk, ct, car, C, C * RAP),
                                         xq, Af, Gp, el_q, ta, ct, C, Ga, 1, BKS, SUBC, LOWP)
                dxq += dx1
                dxb, dy2 = _gram_off_vjp(_tile(dab_ptr, blk, car, car, C * RAP, C * RAP),
                                         Bf, Af, Gp, el_b, ta, ct, C, Ga, RAP, BKS, SUBC, LOWP)
                dya += dy2
                dx3, dy3 = _gram_off_vjp(_tile(dkb_ptr, blk, car, ckr, C * RAP, C * RKP),
                                         Bf, Kf, Gp, el_b, tk, ct, C, Gk, RAP, BKS, SUBC, LOWP)
                dxb += dx3
                dyk += dy3
        if not SCALAR_G:
            # diagonal 16-token blocks, exact (the transposes of the forward's diagonal pass); the
            # cotangents' columns are loaded from scratch so that their full tiles are dead after the matmuls
            ck_cols = tl.arange(0, C * RKP)
            for i in range(C):
                Gi = _row(G, ct, i)
                same = (ct // SUBC) == (i // SUBC)
                e_g = tl.exp(tl.where((same & (ct >= i))[:, None], G - Gi[None, :], float("-inf")))
                xe = xq * e_g
                for l in tl.static_range(RKV):
                    sig = i * RKP + l
                    dcol = tl.load(dqk_ptr + blk * C * C * RKP + ct * (C * RKP) + sig)
                    dxq += dcol[:, None] * e_g * _row(Kf, ck_cols, sig)[None, :]
                    dyk = tl.where(ck_cols[:, None] == sig, dyk + tl.sum(dcol[:, None] * xe, 0)[None, :], dyk)
                if RAB > 0:
                    ca = tl.arange(0, C * RAP)
                    e_gp = _expand(tl.exp(tl.where((same & (ct > i))[:, None], Gp - Gi[None, :], float("-inf"))),
                                   C, RAP, BKS)
                    be = Bf * e_gp
                    for l in tl.static_range(RAB):
                        sig = i * RAP + l
                        y = _row(Af, ca, sig)
                        d1 = tl.load(dqa_ptr + blk * C * C * RAP + ct * (C * RAP) + sig)
                        dxq += d1[:, None] * e_g * y[None, :]
                        d2 = tl.load(dab_ptr + blk * C * RAP * C * RAP + car * (C * RAP) + sig)
                        dxb += d2[:, None] * e_gp * y[None, :]
                        dy_row = tl.sum(d1[:, None] * xe, 0) + tl.sum(d2[:, None] * be, 0)
                        dya = tl.where(ca[:, None] == sig, dya + dy_row[None, :], dya)
                    for l in tl.static_range(RKV):
                        sig = i * RKP + l
                        d3 = tl.load(dkb_ptr + blk * C * RAP * C * RKP + car * (C * RKP) + sig)
                        dxb += d3[:, None] * e_gp * _row(Kf, ck_cols, sig)[None, :]
                        dyk = tl.where(ck_cols[:, None] == sig, dyk + tl.sum(d3[:, None] * be, 0)[None, :], dyk)
        # ---- assemble: dX += x (.) dx, dY -= y (.) dy on the decays
        dG += xq * dxq
        dKf += dyk
        dGk -= Kf * dyk
        dG += _collapse(dGk, C, RKP, BKS)
        dGp = tl.zeros([C, BKS], dtype=tl.float32)
        if RAB > 0:
            dAf += dya
            dGa -= Af * dya
            dBf += dxb
            dGpb += Bf * dxb
            dG += _collapse(dGa, C, RAP, BKS)
            dGp += _collapse(dGpb, C, RAP, BKS)
        dG = tl.where(ct[:, None] == C - 1, dG + dGL[None, :], dG)
        dq = scale * (dq_acc + dxq)
        # dg_s = sum_{t >= s} (dG + dG')_t - dG'_s: a chunk-local reverse cumsum
        dg = tl.cumsum(dG + dGp, 0, reverse=True) - dGp
        tl.store(dq_ptr + tok[:, None] * K + ck[None, :], dq.to(dq_ptr.dtype.element_ty), mask=m_tk)
        if HDLA:
            ca = tl.arange(0, C * 2)
            j3 = tl.arange(0, 2)[None, :, None]
            dA3 = tl.reshape(dAf, (C, 2, BKS))
            dB3 = tl.reshape(dBf, (C, 2, BKS))
            da0 = tl.sum(tl.where(j3 == 0, dA3, 0.0), 1)
            da1 = tl.sum(tl.where(j3 == 1, dA3, 0.0), 1)
            db0 = tl.sum(tl.where(j3 == 0, dB3, 0.0), 1)
            db1 = tl.sum(tl.where(j3 == 1, dB3, 0.0), 1)
            # the full-K sums of s_t's and beta_t's chain rule come from every K tile: stage 3 adds them
            _store_red(red_ptr, blk, tl.program_id(2), NKT, ct, tl.sum(db1 * kk, 1), tl.sum(u * (da0 + db1), 1), C)
            dk_out = dKf + da1 + db0 + beta[:, None] * lam * (da0 + db1) - (beta * beta * s)[:, None] * db1
            dg = dg + beta[:, None] * u * (da0 + db1)
            tl.store(dk_ptr + tok[:, None] * K + ck[None, :], dk_out.to(dk_ptr.dtype.element_ty), mask=m_tk)
        else:
            _store_rows(dk_ptr, dKf, tok, valid, RKV, RKP, C, K, BKS, k0)
            if RAB > 0:
                _store_rows(da_ptr, dAf, tok, valid, RAB, RAP, C, K, BKS, k0)
                _store_rows(db_ptr, dBf, tok, valid, RAB, RAP, C, K, BKS, k0)
        if SCALAR_G:
            dgs = tl.sum(tl.where(mk[None, :], dg, 0.0), 1)
            _store_red(red_ptr, blk, tl.program_id(2), NKT, ct, dgs, dgs, C)
        else:
            tl.store(dg_ptr + tok[:, None] * K + ck[None, :],
                     tl.where(g_raw < LOG_ZERO, 0.0, dg).to(dg_ptr.dtype.element_ty), mask=m_tk)
    else:
        # ---- stage 3: the full-K reductions (sums of the K tiles' partials)
        p1, p2 = _load_red(red_ptr, blk, NKT, ct, C)
        if HDLA:
            # s_t = k.u: ds_t = -beta^2 sum_k db1 k; d k += 2 ds u, d g += ds u k; beta's own chain rule
            ds_s = -beta * beta * p1
            dk_out = tl.load(dk_ptr + tok[:, None] * K + ck[None, :], mask=m_tk, other=0.0).to(tl.float32)
            dk_out += 2.0 * ds_s[:, None] * u
            tl.store(dk_ptr + tok[:, None] * K + ck[None, :], dk_out.to(dk_ptr.dtype.element_ty), mask=m_tk)
            dg = tl.load(dg_ptr + tok[:, None] * K + ck[None, :], mask=m_tk, other=0.0).to(tl.float32)
            dg = tl.where(g_raw < LOG_ZERO, 0.0, dg + ds_s[:, None] * u * kk)
            tl.store(dg_ptr + tok[:, None] * K + ck[None, :], dg.to(dg_ptr.dtype.element_ty), mask=m_tk)
            if tl.program_id(2) == 0:
                dbeta = p2 - 2.0 * beta * s * p1
                tl.store(dbeta_ptr + tok, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)
        else:
            tl.store(dg_ptr + tok, tl.where(g_raw < LOG_ZERO, 0.0, p1).to(dg_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _tile(ptr, blk, rows, cols, NR: tl.constexpr, NC: tl.constexpr):
    """Chunk blk's [NR, NC] scratch tile, rows x cols of it."""
    return tl.load(ptr + blk * NR * NC + rows[:, None] * NC + cols[None, :])


@triton.jit
def _store_red(red_ptr, blk, i_k, NKT, ct, x, y, C: tl.constexpr):
    """K tile i_k's partial sums x, y [C] of a chunk into red [blocks, NKT, 2, C]."""
    base = red_ptr + (blk * NKT + i_k) * 2 * C
    tl.store(base + ct, x)
    tl.store(base + C + ct, y)


@triton.jit
def _load_red(red_ptr, blk, NKT, ct, C: tl.constexpr):
    """The sums over K tiles of the partials of :func:`_store_red`: ([C], [C])."""
    x = tl.zeros([C], dtype=tl.float32)
    y = tl.zeros([C], dtype=tl.float32)
    for i_k in range(NKT):
        base = red_ptr + (blk * NKT + i_k) * 2 * C
        x += tl.load(base + ct)
        y += tl.load(base + C + ct)
    return x, y


def b1_config(dk: int, dv: int) -> dict:
    """B1's tiles per head dim: the state's K rows in one block (K <= 128) or two (K = 256), BV columns
    per program, warps. The one place to tune (or autotune) B1 on a device."""
    bk = max(16, triton.next_power_of_2(dk))
    two = bk > 128
    bk = bk // 2 if two else bk
    bv = max(16, min(64 if bk <= 64 else 32, triton.next_power_of_2(dv)))
    if two:  # K = 256: pipelining the four N blocks would need 316-458 KB of shared memory (AOT)
        return dict(BK=bk, BV=bv, TWO=two, num_warps=8, num_stages=1)
    return dict(BK=bk, BV=bv, TWO=two, num_warps=4 if bk * bv <= 64 * 64 else 8, num_stages=3)


def b2_config(dk: int, dv: int, chunk: int, r_kv: int, r_ab: int) -> dict:
    """B2's tiles and warps per shape, the one place to tune (or autotune) B2: BV (stage 1's V block),
    BKS (the K columns of one stage-2/3 program), warps and pipeline stages of stages 1, 2, 3."""
    bk = max(16, triton.next_power_of_2(dk))
    bks = min(bk, 32)
    rows = chunk * max(_pow2(r_ab), _pow2(r_kv), 1)
    warps1 = 4 if bk * rows <= 4096 else 8
    warps2 = 4 if bks * rows < 2048 else 8
    # one stage in flight: the V loop of stage 1 stays under the 227 KB of shared memory at K = 128
    return dict(BV=max(16, min(64, triton.next_power_of_2(dv))), BKS=bks, num_warps=(warps1, warps2, 4),
                num_stages=(1, 1, 1))


def _pow2(n: int) -> int:
    return 1 if n <= 1 else triton.next_power_of_2(n)


def _chunk_prepare(q, k, v, a, b, g, scale, reverse, hdla_beta=None, chunk=None):
    """The forward's chunk preparation (``fwd.chunk_prepare``: N, Qeff, gamma per chunk and the chunk
    size, with the same default chunk rule, so it matches the forward's h; ``chunk`` forces one, for tests). The layouts agree with B1/B2:
    N ``[B, H, NT, K, K]``, Qeff ``[B, H, NT*C, K]`` in scan order, gamma ``[B, H, NT, K]`` fp32. At
    r_ab = 0 the forward has no N (its state pass skips the product); B1 always reads one, so it gets
    zeros here. B2 reads none of prep (it recomputes its Gram matrices); G, W, U are not reused."""
    prep = fwd.chunk_prepare(q, k, v, a, b, g, scale, reverse, hdla_beta=hdla_beta, chunk=chunk)
    if prep["N"] is None:
        batch, heads, n_chunks, dk = prep["gamma"].shape
        prep["N"] = prep["Qeff"].new_zeros(batch, heads, n_chunks, dk, dk)
    return prep


def _check(do, dht, q, k, v, a, b, g, initial_state, h, hdla_beta):
    """Shape checks (ValueError naming the argument) before any launch."""
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    if hdla_beta is not None:
        if k.shape != q.shape or v.dim() != 4 or tuple(hdla_beta.shape) != (batch, seq_len, heads):
            raise ValueError("HDLA backward: k must be [B, T, H, K] like q, v [B, T, H, V], hdla_beta [B, T, H]")
        if g.shape != q.shape:
            raise ValueError(f"g must be [B, T, H, K] = {list(q.shape)} for HDLA, got {list(g.shape)}")
    else:
        if k.dim() != 5 or k.shape[:3] != q.shape[:3] or k.shape[4] != dk or v.shape[:4] != k.shape[:4]:
            raise ValueError("k must be [B, T, H, r_kv, K] and v [B, T, H, r_kv, V] matching q [B, T, H, K]")
        if a.shape != b.shape or a.dim() != 5 or a.shape[:3] != q.shape[:3] or a.shape[4] != dk:
            raise ValueError("a and b must both be [B, T, H, r_ab, K] matching q")
        if g.shape != q.shape and tuple(g.shape) != (batch, seq_len, heads):
            raise ValueError(f"g must be [B, T, H, K] or [B, T, H], got {list(g.shape)}")
    if tuple(do.shape) != (batch, seq_len, heads, dv):
        raise ValueError(f"do must be [B, T, H, V] = {[batch, seq_len, heads, dv]}, got {list(do.shape)}")
    for name, x in (("dht", dht), ("initial_state", initial_state)):
        if x is not None and tuple(x.shape) != (batch, heads, dk, dv):
            raise ValueError(f"{name} must be [B, H, K, V] = {[batch, heads, dk, dv]}, got {list(x.shape)}")
    if h.dim() != 5 or tuple(h.shape[:2]) != (batch, heads) or tuple(h.shape[3:]) != (dk, dv):
        raise ValueError(f"h must be [B, H, NT, K, V] with B, H, K, V = {batch, heads, dk, dv}, got {list(h.shape)}")


def generalized_backward(do, dht, q, k, v, a, b, g, scale, initial_state, h, reverse, hdla_beta=None,
                         prep=None, stages=None):
    """Gradients of the chunked generalized op by B1 and B2 (module docstring).

    Args (kernel_plan.md): do ``[B, T, H, V]``; dht ``[B, H, K, V]`` or None; q ``[B, T, H, K]``;
        k ``[B, T, H, r_kv, K]``, v ``[B, T, H, r_kv, V]``, a, b ``[B, T, H, r_ab, K]`` (HDLA: k
        ``[B, T, H, K]``, v ``[B, T, H, V]``, a = b = None, ``hdla_beta [B, T, H]``); g ``[B, T, H, K]``
        or ``[B, T, H]``; h ``[B, H, NT, K, V]`` the states entering each chunk (the forward's);
        prep: the forward's ``chunk_prepare`` dict if the caller kept it (else recomputed).
        stages: a dict that, if given, receives ``b1`` and ``b2``: closures that relaunch each kernel
            with the same arguments (per-kernel timing, benchmarks/kernel_stages_bwd.py).
    Returns:
        ``(dq, dk, dv, da, db, dg, dh0)`` (HDLA: ``(dq, dk, dv, dbeta, dg, dh0)``), each in its input's
        dtype (dg in g's shape; dh0 fp32, None without an initial state).
    """
    hdla = hdla_beta is not None
    _check(do, dht, q, k, v, a, b, g, initial_state, h, hdla_beta)
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    if prep is None:
        prep = _chunk_prepare(q, k, v, a, b, g, scale, reverse, hdla_beta)
    c = prep["chunk"]
    nt = triton.cdiv(seq_len, c)
    if h.shape[2] != nt:
        raise ValueError(f"h has {h.shape[2]} chunks; the chunk size {c} gives {nt}")
    r_kv = 1 if hdla else k.shape[3]
    r_ab = 2 if hdla else a.shape[3]
    bk = max(16, triton.next_power_of_2(dk))
    lowp = q.dtype in (torch.bfloat16, torch.float16)
    dev = q.device
    q, k, v, g, do = (x.contiguous() for x in (q, k, v, g, do))
    f32 = dict(device=dev, dtype=torch.float32)
    ds = torch.empty(batch, heads, nt, dk, dv, device=dev, dtype=q.dtype if lowp else torch.float32)
    dh0 = torch.empty(batch, heads, dk, dv, **f32)
    cfg1 = b1_config(dk, dv)
    b1_args = (prep["N"].contiguous(), prep["Qeff"].contiguous(), prep["gamma"].contiguous(), do,
               dht.contiguous() if dht is not None else ds, ds, dh0, seq_len, heads, dk, dv, nt)
    b1_meta = dict(C=c, REVERSE=reverse, HAS_DHT=dht is not None, LOWP=lowp, **cfg1)

    def b1():
        _bwd_state_kernel[(triton.cdiv(dv, cfg1["BV"]), batch * heads)](*b1_args, **b1_meta)

    b1()
    empty = torch.empty(0, **f32)
    dq, dk_, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg = torch.empty_like(g)
    if hdla:
        beta = hdla_beta.contiguous()
        dbeta = torch.empty_like(beta)
        a_ = b_ = da = db = empty
    else:
        beta = dbeta = empty
        a_, b_ = a.contiguous(), b.contiguous()
        da, db = torch.empty_like(a_), torch.empty_like(b_)
    rkp, rap = _pow2(r_kv), (_pow2(r_ab) if r_ab else 1)
    blocks = batch * heads * nt
    scratch = dict(sq=(c, bk), sk=(c * rkp, bk), sa=(c * rap, bk), sb=(c * rap, bk), sgam=(bk,),
                   dqk=(c, c * rkp), dqa=(c, c * rap), dab=(c * rap, c * rap), dkb=(c * rap, c * rkp))
    if not r_ab:
        scratch.update(sa=(0,), sb=(0,), dqa=(0,), dab=(0,), dkb=(0,))
    cfg2 = b2_config(dk, dv, c, r_kv, r_ab)
    nkt = triton.cdiv(dk, cfg2["BKS"])
    third = hdla or g.dim() == 3  # a full-K reduction (s, beta; or the per-head dg) after stage 2
    scratch["red"] = (nkt, 2, c) if third else (0,)
    scratch = {name: torch.empty(blocks, *shape, **f32) for name, shape in scratch.items()}
    b2_args = (q, k, v, a_ if r_ab else empty, b_ if r_ab else empty, beta, g, h.contiguous(), ds, do,
               dq, dk_, dv_, da if r_ab else empty, db if r_ab else empty, dbeta, dg, *scratch.values(),
               seq_len, heads, dk, dv, nt, nkt, float(scale))
    b2_meta = dict(C=c, BK=bk, BV=cfg2["BV"], RKV=r_kv, RKP=rkp, RAB=r_ab, RAP=rap,
                   HDLA=hdla, SCALAR_G=g.dim() == 3, REVERSE=reverse, LOWP=lowp, SUBC=SUB, LOG_ZERO=LOG_ZERO_FP32)

    def b2():
        for stage in (1, 2, 3) if third else (1, 2):
            grid = (nt, batch * heads, 1 if stage == 1 or (stage == 3 and not hdla) else nkt)
            _bwd_chunk_kernel[grid](*b2_args, **b2_meta, STAGE=stage, BKS=bk if stage == 1 else cfg2["BKS"],
                                    num_warps=cfg2["num_warps"][stage - 1], num_stages=cfg2["num_stages"][stage - 1])

    b2()
    if stages is not None:
        stages.update(b1=b1, b2=b2)
    dh0 = dh0 if initial_state is not None else None
    if hdla:
        return dq, dk_, dv_, dbeta, dg, dh0
    if not r_ab:
        da, db = torch.zeros_like(a), torch.zeros_like(b)
    return dq, dk_, dv_, da, db, dg, dh0
