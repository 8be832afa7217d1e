"""The Triton chunk-scan kernel behind every op in this package.

Two kernels. Per chunk of ``BT = 16`` tokens, with G the inclusive and G' = G - g the
exclusive cumulative log-decay (fp32) and ``X_t = S_{t-1}^T B_t`` the read of the previous
state (HDLA paper eq. 13-18, UT form):

    X   = (I + L_AB)^{-1} (Bhat S + L_KB V)  = Wx S + Ur V    L_AB[t,i] = B_t^T diag(e^{G'_t - G_i}) A_i, i < t
    O   = Qhat S + M_QK V - M_QA X           = Qeff S + Mo V  M_QK[t,i] = q_t^T diag(e^{G_t - G_i}) K_i, i <= t
    S  <- e^{G_C} S + Ktil^T V - Atil^T X                      Ktil_i = e^{G_C - G_i} K_i

``chunk_local_kernel`` computes Wx, Ur, Qeff and Mo, which do not depend on the state, for
all chunks in parallel (the Gram matrices and the triangular inverse live there).
``chunk_scan_kernel`` then walks the chunks of one (batch, head, V-block) in order with the
state ``S`` (``[K, BV]``, fp32) in registers, doing only products with the state.

Decay factors are only ever exp of a difference whose sign is known (kernels/README.md §3). The
Gram matrices take one of two routes per chunk: if ``max |G| <= THRESH`` they factor as
``(R e^{G_t}) (W e^{-G_i})^T`` (tensor-core products, both factors finite), otherwise they
are built column by column with the exact pairwise ``e^{G_t - G_i}``.

Besides the forward outputs the same kernel computes what the backward needs:
"V-readouts" ``S_t^T q`` for any stack of query vectors, "K-readouts" ``S_t w`` (post-update)
and ``S_{t-1} w`` (pre-update) for stacks of V-vectors, the read ``X`` itself, and it can run
the adjoint recurrence (transposed transition taken from the previous scan step).
"""
import triton
import triton.language as tl

from ..utils import LOG_ZERO_FP32

BT = 16
LOG2_BT = 4
THRESH = 60.0  # |G| bound under which e^{G} and e^{-G} are both finite in fp32
# Every kernel clamps g at this floor where it loads it: exp is exactly 0 there in fp32, so g = -inf
# (a full reset) gives the exact limit, never -inf - (-inf) = NaN (kernels/utils.py)
LOG_ZERO = tl.constexpr(LOG_ZERO_FP32)


@triton.jit
def _tok_index(p0, T, BT: tl.constexpr, RP: tl.constexpr, SHIFT: tl.constexpr, REVERSE: tl.constexpr):
    """Rows ``token * RP + rank`` of a chunk tile -> (token, rank, time index, valid)."""
    rows = tl.arange(0, BT * RP)
    tok = rows // RP
    rank = rows % RP
    p = p0 + tok - SHIFT
    valid = (p >= 0) & (p0 + tok < T)  # a padded step past the end stays the identity
    if REVERSE:
        t = T - 1 - p
    else:
        t = p
    return tok, rank, t, valid


@triton.jit
def _load_rows(ptr, i_b, i_h, p0, T, H, cols, cmask, D, R: tl.constexpr, RP: tl.constexpr,
               BT: tl.constexpr, SHIFT: tl.constexpr, REVERSE: tl.constexpr):
    """Tile ``[BT*RP, BD]`` of a ``[B, T, H, R, D]`` tensor (rank slots >= R and tokens past T are 0)."""
    tok, rank, t, valid = _tok_index(p0, T, BT, RP, SHIFT, REVERSE)
    base = ((i_b * T + t) * H + i_h).to(tl.int64) * (R * D) + rank * D
    mask = (valid & (rank < R))[:, None] & cmask[None, :]
    return tl.load(ptr + base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, val, i_b, i_h, p0, T, H, cols, cmask, D, R: tl.constexpr, RP: tl.constexpr,
                BT: tl.constexpr, REVERSE: tl.constexpr):
    tok, rank, t, valid = _tok_index(p0, T, BT, RP, 0, REVERSE)
    base = ((i_b * T + t) * H + i_h).to(tl.int64) * (R * D) + rank * D
    mask = (valid & (rank < R))[:, None] & cmask[None, :]
    tl.store(ptr + base[:, None] + cols[None, :], val.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_token_rows(ptr, i_b, i_h, p0, T, H, cols, cmask, D, RP: tl.constexpr,
                     BT: tl.constexpr, SHIFT: tl.constexpr, REVERSE: tl.constexpr):
    """A per-token ``[B, T, H, D]`` tensor repeated over RP rank slots: ``[BT*RP, BD]``."""
    tok, rank, t, valid = _tok_index(p0, T, BT, RP, SHIFT, REVERSE)
    base = ((i_b * T + t) * H + i_h).to(tl.int64) * D
    return tl.load(ptr + base[:, None] + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _load_token_scalar(ptr, i_b, i_h, p0, T, H, RP: tl.constexpr, BT: tl.constexpr,
                       SHIFT: tl.constexpr, REVERSE: tl.constexpr):
    tok, rank, t, valid = _tok_index(p0, T, BT, RP, SHIFT, REVERSE)
    return tl.load(ptr + ((i_b * T + t) * H + i_h).to(tl.int64), mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _expand(x, BT: tl.constexpr, RP: tl.constexpr, BD: tl.constexpr):
    """``[BT, BD] -> [BT*RP, BD]``, each token row repeated for its RP rank slots."""
    if RP == 1:
        return x
    return tl.reshape(tl.broadcast_to(x[:, None, :], (BT, RP, BD)), (BT * RP, BD))


@triton.jit
def _hdla_rows(kh_ptr, beta_ptr, g_ptr, i_b, i_h, p0, T, H, cols, cmask, K,
               BT: tl.constexpr, SHIFT: tl.constexpr, REVERSE: tl.constexpr):
    """HDLA's A and B (rank 2) built from (k, beta, g): ``A = [b u, k]``, ``B = [k, b u - b^2 s k]``
    with ``u = lambda * k`` and ``s = k^T Diag(lambda) k`` (kernels/README.md §2). Returns two ``[2*BT, BK]`` tiles."""
    kh = _load_token_rows(kh_ptr, i_b, i_h, p0, T, H, cols, cmask, K, 2, BT, SHIFT, REVERSE)
    gh = tl.maximum(_load_token_rows(g_ptr, i_b, i_h, p0, T, H, cols, cmask, K, 2, BT, SHIFT, REVERSE), LOG_ZERO)
    beta = _load_token_scalar(beta_ptr, i_b, i_h, p0, T, H, 2, BT, SHIFT, REVERSE)[:, None]
    first = ((tl.arange(0, 2 * BT) % 2) == 0)[:, None]
    u = tl.exp(gh) * kh
    s = tl.sum(u * kh, 1)[:, None]
    a = tl.where(first, beta * u, kh)
    b = tl.where(first, kh, beta * u - beta * beta * s * kh)
    return a, b


@triton.jit
def _row_of(x, rows, r):
    """Row ``r`` of a 2-D tile as a 1-D vector."""
    return tl.sum(tl.where((rows == r)[:, None], x, 0.0), 0)


@triton.jit
def _pair_mask(BT: tl.constexpr, RPR: tl.constexpr, RPW: tl.constexpr, STRICT: tl.constexpr):
    """Reader rows' tokens, writer column indices, and the causal mask token(col) <= token(row)
    (``<`` if STRICT) for a ``[BT*RPR, BT*RPW]`` pair matrix."""
    tok_r = tl.arange(0, BT * RPR) // RPR
    cols = tl.arange(0, BT * RPW)
    tok_w = cols // RPW
    if STRICT:
        keep = tok_w[None, :] < tok_r[:, None]
    else:
        keep = tok_w[None, :] <= tok_r[:, None]
    return tok_r, cols, keep


@triton.jit
def _exact_decay(g_rd, g_tok, tok_r, i, BT: tl.constexpr, STRICT: tl.constexpr):
    """``exp(g_rd[n] - G_i)`` for reader rows after writer token i (at or after unless STRICT),
    else 0: the exponent is <= 0 wherever it is taken, so nothing overflows."""
    g_i = _row_of(g_tok, tl.arange(0, BT), i)
    if STRICT:
        live = tok_r > i
    else:
        live = tok_r >= i
    return tl.exp(tl.where(live[:, None], g_rd - g_i[None, :], float("-inf")))


@triton.jit
def _gram(rd, g_rd, wr, g_wr, g_tok, fast, BT: tl.constexpr, RPR: tl.constexpr, RPW: tl.constexpr,
          STRICT: tl.constexpr):
    """``M[n, m] = sum_k rd[n,k] wr[m,k] exp(g_rd[n,k] - g_wr[m,k])`` for token(m) <= token(n)
    (``<`` if STRICT), else 0. rd ``[BT*RPR, BK]``, wr ``[BT*RPW, BK]``; g_tok ``[BT, BK]`` is the
    writers' per-token log-decay (g_wr expanded)."""
    tok_r, cols, keep = _pair_mask(BT, RPR, RPW, STRICT)
    if fast:
        m = tl.dot(rd * tl.exp(g_rd), tl.trans(wr * tl.exp(-g_wr)))
    else:
        m = tl.zeros([BT * RPR, BT * RPW], dtype=tl.float32)
        for i in range(BT):
            e = _exact_decay(g_rd, g_tok, tok_r, i, BT, STRICT)
            rde = rd * e
            for r in tl.static_range(RPW):
                w = _row_of(wr, cols, i * RPW + r)
                col = tl.sum(rde * w[None, :], 1)
                m = tl.where((cols == i * RPW + r)[None, :], col[:, None], m)
    return tl.where(keep, m, 0.0)


@triton.jit
def _k_readout(coef, g_rd, wr, g_wr, g_tok, fast, BT: tl.constexpr, RPR: tl.constexpr,
               RPW: tl.constexpr, STRICT: tl.constexpr, BK: tl.constexpr):
    """``out[n, :] = sum_m coef[n, m] exp(g_rd[n] - g_wr[m]) * wr[m, :]`` over token(m) <= token(n)
    (``<`` if STRICT): ``[BT*RPR, BK]``."""
    tok_r, cols, keep = _pair_mask(BT, RPR, RPW, STRICT)
    coef = tl.where(keep, coef, 0.0)
    if fast:
        out = tl.exp(g_rd) * tl.dot(coef, wr * tl.exp(-g_wr))
    else:
        out = tl.zeros([BT * RPR, BK], dtype=tl.float32)
        for i in range(BT):
            e = _exact_decay(g_rd, g_tok, tok_r, i, BT, STRICT)
            for r in tl.static_range(RPW):
                c = tl.sum(tl.where((cols == i * RPW + r)[None, :], coef, 0.0), 1)
                w = _row_of(wr, cols, i * RPW + r)
                out += e * c[:, None] * w[None, :]
    return out


@triton.jit
def _unit_lower_inverse(lmat, N: tl.constexpr, LEVELS: tl.constexpr, RP: tl.constexpr):
    """``(I + L)^{-1}`` for L strictly lower block-triangular over tokens (r x r blocks; paper
    eq. 13-14) by block doubling: with D the inverse restricted to blocks of n tokens and C the
    entries of L between the two halves of each 2n-token block, the 2n-block inverse is
    D - D C D. Starts from 2-token blocks ([[I, 0], [C, I]]^{-1} = [[I, 0], [-C, I]]);
    LEVELS = log2(tokens per chunk)."""
    rows = tl.arange(0, N)
    tok = rows // RP
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    inv = eye - tl.where((tok[:, None] >> 1) == (tok[None, :] >> 1), lmat, 0.0)
    for level in tl.static_range(1, LEVELS):
        cross = ((tok[:, None] >> (level + 1)) == (tok[None, :] >> (level + 1))) & (
            (tok[:, None] >> level) != (tok[None, :] >> level))
        dc = tl.dot(inv, tl.where(cross, lmat, 0.0), input_precision="tf32x3")
        inv = inv - tl.dot(dc, inv, input_precision="tf32x3")
    return inv


@triton.jit
def chunk_local_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr, kh_ptr, beta_ptr, g_ptr,
    wx_ptr, ur_ptr, qe_ptr, mo_ptr, ktil_ptr, atil_ptr, gam_ptr,
    T, H, K, scale, thresh,
    NQ: tl.constexpr, NQP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr,
    RAB: tl.constexpr, RAP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HDLA: tl.constexpr, SWAP_AB: tl.constexpr, SHIFT: tl.constexpr, REVERSE: tl.constexpr,
    SOLVE: tl.constexpr, LOG2_BT: tl.constexpr,
):
    """State-independent part of one chunk, stored for the sequential kernel:
    Wx ``[BT*RAP, K]`` and Ur ``[BT*RAP, BT*RKP]`` (X = Wx S + Ur V), Qeff ``[BT*NQP, K]`` and
    Mo ``[BT*NQP, BT*RKP]`` (O = Qeff S + Mo V), Ktil, Atil (rows scaled by e^{G_C - G_t}) and
    gamma = e^{G_C} ``[K]`` (S_C = gamma S + Ktil^T V - Atil^T X)."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    n_chunks = tl.num_programs(0)
    i_b = i_bh // H
    i_h = i_bh % H
    p0 = i_c * BT
    ck = tl.arange(0, BK)
    mk = ck < K
    g_tok = tl.maximum(_load_rows(g_ptr, i_b, i_h, p0, T, H, ck, mk, K, 1, 1, BT, SHIFT, REVERSE), LOG_ZERO)
    g_cum = tl.cumsum(g_tok, 0)
    g_exc = g_cum - g_tok
    g_last = _row_of(g_cum, tl.arange(0, BT), BT - 1)
    fast = tl.max(tl.abs(g_cum)) <= thresh
    kt = _load_rows(k_ptr, i_b, i_h, p0, T, H, ck, mk, K, RKV, RKP, BT, 0, REVERSE)
    g_k = _expand(g_cum, BT, RKP, BK)
    cols_k = tl.arange(0, BT * RKP)
    tile = i_bh.to(tl.int64) * n_chunks + i_c
    tl.store(gam_ptr + tile * K + ck, tl.exp(g_last), mask=mk)
    _store_rows(ktil_ptr, kt * tl.exp(g_last[None, :] - g_k), i_b, i_h, p0, T, H, ck, mk, K, RKV, RKP, BT, REVERSE)

    if RAB > 0:
        if HDLA:
            a_t, b_t = _hdla_rows(kh_ptr, beta_ptr, g_ptr, i_b, i_h, p0, T, H, ck, mk, K, BT, SHIFT, REVERSE)
            if SWAP_AB:  # transposed transition D - B A^T (the adjoint scan); generic a, b are swapped by the caller
                a_t, b_t = b_t, a_t
        else:
            a_t = _load_rows(a_ptr, i_b, i_h, p0, T, H, ck, mk, K, RAB, RAP, BT, SHIFT, REVERSE)
            b_t = _load_rows(b_ptr, i_b, i_h, p0, T, H, ck, mk, K, RAB, RAP, BT, SHIFT, REVERSE)
        g_a = _expand(g_cum, BT, RAP, BK)
        _store_rows(atil_ptr, a_t * tl.exp(g_last[None, :] - g_a), i_b, i_h, p0, T, H, ck, mk, K, RAB, RAP, BT, REVERSE)
        if SOLVE:
            g_b = _expand(g_exc, BT, RAP, BK)
            inv = _unit_lower_inverse(_gram(b_t, g_b, a_t, g_a, g_cum, fast, BT, RAP, RAP, True), BT * RAP, LOG2_BT, RAP)
            wx = tl.dot(inv, b_t * tl.exp(g_b))
            ur = tl.dot(inv, _gram(b_t, g_b, kt, g_k, g_cum, fast, BT, RAP, RKP, True))
            _store_rows(wx_ptr, wx, i_b, i_h, p0, T, H, ck, mk, K, RAB, RAP, BT, REVERSE)
            rows_a = tl.arange(0, BT * RAP)
            tl.store(ur_ptr + tile * (BT * RAP * BT * RKP) + rows_a[:, None] * (BT * RKP) + cols_k[None, :], ur)

    if NQ > 0:
        qt = _load_rows(q_ptr, i_b, i_h, p0, T, H, ck, mk, K, NQ, NQP, BT, 0, REVERSE) * scale
        g_q = _expand(g_cum, BT, NQP, BK)
        qeff = qt * tl.exp(g_q)
        mo = _gram(qt, g_q, kt, g_k, g_cum, fast, BT, NQP, RKP, False)
        if RAB > 0:
            m_qa = _gram(qt, g_q, a_t, g_a, g_cum, fast, BT, NQP, RAP, False)
            qeff -= tl.dot(m_qa, wx)
            mo -= tl.dot(m_qa, ur)
        _store_rows(qe_ptr, qeff, i_b, i_h, p0, T, H, ck, mk, K, NQ, NQP, BT, REVERSE)
        rows_q = tl.arange(0, BT * NQP)
        tl.store(mo_ptr + tile * (BT * NQP * BT * RKP) + rows_q[:, None] * (BT * RKP) + cols_k[None, :], mo)


@triton.jit
def _state_readout(acc_ptr, wv_ptr, s, i_b, i_h, p0, T, H, cv, mv, ck, mk, K, V, NW: tl.constexpr,
                   NWP: tl.constexpr, BT: tl.constexpr, REVERSE: tl.constexpr, ATOMIC: tl.constexpr):
    """Accumulate ``S w_t`` (``[BT*NWP, BK]``, this program's V-block) into the K-readout buffer."""
    w = _load_rows(wv_ptr, i_b, i_h, p0, T, H, cv, mv, V, NW, NWP, BT, 0, REVERSE)
    part = tl.dot(w, tl.trans(s))
    tok, rank, t, valid = _tok_index(p0, T, BT, NWP, 0, REVERSE)
    base = ((i_b * T + t) * H + i_h).to(tl.int64) * (NW * K) + rank * K
    mask = (valid & (rank < NW))[:, None] & mk[None, :]
    if ATOMIC:
        tl.atomic_add(acc_ptr + base[:, None] + ck[None, :], part, mask=mask)
    else:
        tl.store(acc_ptr + base[:, None] + ck[None, :], part, mask=mask)


@triton.jit
def chunk_scan_kernel(
    v_ptr, ktil_ptr, atil_ptr, gam_ptr, wx_ptr, ur_ptr, qe_ptr, mo_ptr, xin_ptr, wp_ptr, wq_ptr,
    o_ptr, xout_ptr, kp_ptr, kq_ptr, h0_ptr, ht_ptr,
    T, H, K, V,
    NQ: tl.constexpr, NQP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr,
    RAB: tl.constexpr, RAP: tl.constexpr, NWP: tl.constexpr, NWPP: tl.constexpr,
    NWQ: tl.constexpr, NWQP: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr,
    X_GIVEN: tl.constexpr, STORE_X: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """Sequential pass over the chunks of one (batch, head, V-block): products with the state only."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    n_chunks = tl.cdiv(T, BT)
    ck = tl.arange(0, BK)
    mk = ck < K
    cv = i_v * BV + tl.arange(0, BV)
    mv = cv < V
    cols_k = tl.arange(0, BT * RKP)
    state_offs = i_bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    if USE_H0:
        s = tl.load(h0_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)

    for i_c in range(0, n_chunks):
        p0 = i_c * BT
        tile = i_bh.to(tl.int64) * n_chunks + i_c
        gamma = tl.load(gam_ptr + tile * K + ck, mask=mk, other=0.0)
        vt = _load_rows(v_ptr, i_b, i_h, p0, T, H, cv, mv, V, RKV, RKP, BT, 0, REVERSE)
        ktil = _load_rows(ktil_ptr, i_b, i_h, p0, T, H, ck, mk, K, RKV, RKP, BT, 0, REVERSE)
        s_next = gamma[:, None] * s + tl.dot(tl.trans(ktil), vt)
        if RAB > 0:
            if X_GIVEN:
                x = _load_rows(xin_ptr, i_b, i_h, p0, T, H, cv, mv, V, RAB, RAP, BT, 0, REVERSE)
            else:
                wx = _load_rows(wx_ptr, i_b, i_h, p0, T, H, ck, mk, K, RAB, RAP, BT, 0, REVERSE)
                rows_a = tl.arange(0, BT * RAP)
                ur = tl.load(ur_ptr + tile * (BT * RAP * BT * RKP) + rows_a[:, None] * (BT * RKP) + cols_k[None, :])
                x = tl.dot(wx, s) + tl.dot(ur, vt)
            if STORE_X:
                _store_rows(xout_ptr, x, i_b, i_h, p0, T, H, cv, mv, V, RAB, RAP, BT, REVERSE)
            atil = _load_rows(atil_ptr, i_b, i_h, p0, T, H, ck, mk, K, RAB, RAP, BT, 0, REVERSE)
            s_next -= tl.dot(tl.trans(atil), x)
        if NQ > 0:
            qeff = _load_rows(qe_ptr, i_b, i_h, p0, T, H, ck, mk, K, NQ, NQP, BT, 0, REVERSE)
            rows_q = tl.arange(0, BT * NQP)
            mo = tl.load(mo_ptr + tile * (BT * NQP * BT * RKP) + rows_q[:, None] * (BT * RKP) + cols_k[None, :])
            o = tl.dot(qeff, s) + tl.dot(mo, vt)
            _store_rows(o_ptr, o, i_b, i_h, p0, T, H, cv, mv, V, NQ, NQP, BT, REVERSE)
        if NWP > 0:  # S_{chunk start} w_t for the post-update K-readouts (gated in chunk_kread_kernel)
            _state_readout(kp_ptr, wp_ptr, s, i_b, i_h, p0, T, H, cv, mv, ck, mk, K, V, NWP, NWPP, BT, REVERSE, ATOMIC)
        if NWQ > 0:  # the same for the pre-update K-readouts
            _state_readout(kq_ptr, wq_ptr, s, i_b, i_h, p0, T, H, cv, mv, ck, mk, K, V, NWQ, NWQP, BT, REVERSE, ATOMIC)
        s = s_next

    if STORE_HT:
        tl.store(ht_ptr + state_offs, s.to(ht_ptr.dtype.element_ty), mask=state_mask)


@triton.jit
def chunk_kread_kernel(
    w_ptr, k_ptr, v_ptr, a_ptr, kh_ptr, beta_ptr, g_ptr, x_ptr, out_ptr,
    T, H, K, V, thresh,
    NW: tl.constexpr, NWP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr,
    RAB: tl.constexpr, RAP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HDLA: tl.constexpr, SWAP_AB: tl.constexpr, SHIFT: tl.constexpr, REVERSE: tl.constexpr,
    STRICT: tl.constexpr,
):
    """Finish the K-readouts for all chunks in parallel (full V per program): out_ptr holds
    ``S_0 w_t`` (S_0 the state entering the chunk); it becomes

        e^{G_t} S_0 w_t + sum_{i <= t} e^{G_t - G_i} (K_i (V_i^T w_t) - A_i (X_i^T w_t))

    (i < t and G' = G - g in place of G if STRICT, which gives S_{t-1} w_t instead of S_t w_t).
    """
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    p0 = i_c * BT
    ck = tl.arange(0, BK)
    mk = ck < K
    cv = tl.arange(0, BV)
    mv = cv < V
    g_tok = tl.maximum(_load_rows(g_ptr, i_b, i_h, p0, T, H, ck, mk, K, 1, 1, BT, SHIFT, REVERSE), LOG_ZERO)
    g_cum = tl.cumsum(g_tok, 0)
    fast = tl.max(tl.abs(g_cum)) <= thresh
    if STRICT:
        g_w = _expand(g_cum - g_tok, BT, NWP, BK)
    else:
        g_w = _expand(g_cum, BT, NWP, BK)
    w = _load_rows(w_ptr, i_b, i_h, p0, T, H, cv, mv, V, NW, NWP, BT, 0, REVERSE)
    kt = _load_rows(k_ptr, i_b, i_h, p0, T, H, ck, mk, K, RKV, RKP, BT, 0, REVERSE)
    vt = _load_rows(v_ptr, i_b, i_h, p0, T, H, cv, mv, V, RKV, RKP, BT, 0, REVERSE)
    g_k = _expand(g_cum, BT, RKP, BK)
    out = tl.exp(g_w) * _load_rows(out_ptr, i_b, i_h, p0, T, H, ck, mk, K, NW, NWP, BT, 0, REVERSE)
    out += _k_readout(tl.dot(w, tl.trans(vt)), g_w, kt, g_k, g_cum, fast, BT, NWP, RKP, STRICT, BK)
    if RAB > 0:
        if HDLA:
            a_t, b_t = _hdla_rows(kh_ptr, beta_ptr, g_ptr, i_b, i_h, p0, T, H, ck, mk, K, BT, SHIFT, REVERSE)
            if SWAP_AB:
                a_t = b_t
        else:
            a_t = _load_rows(a_ptr, i_b, i_h, p0, T, H, ck, mk, K, RAB, RAP, BT, SHIFT, REVERSE)
        x = _load_rows(x_ptr, i_b, i_h, p0, T, H, cv, mv, V, RAB, RAP, BT, 0, REVERSE)
        g_a = _expand(g_cum, BT, RAP, BK)
        out -= _k_readout(tl.dot(w, tl.trans(x)), g_w, a_t, g_a, g_cum, fast, BT, NWP, RAP, STRICT, BK)
    _store_rows(out_ptr, out, i_b, i_h, p0, T, H, ck, mk, K, NW, NWP, BT, REVERSE)
