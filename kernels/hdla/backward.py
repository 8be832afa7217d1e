"""Fused epilogue of HDLA's backward: from the scans' dq, dK, dA, dB to dk, dbeta, dg.

Per token, with A = [beta u, k], B = [k, beta u - beta^2 s k], u = lambda * k, s = k . u:

* the gauge identity (kernels/generalized/chunk.py) gives the diagonal part of dg as a
  cumulative sum over later scan steps of ``q dq - k dK - A . dA`` (at or after s) and
  ``B . dB`` (strictly after s), plus ``rowsum(S_T * dS_T)``;
* the chain rule through A, B adds to dk, dbeta and dg;
* g is clamped at ``LOG_ZERO`` as in the scans, so dg is 0 where g is below it (g = -inf included).

One program per (batch, head) walks its sequence from the last scanned token to the first in
blocks of BT tokens, carrying the running sum.
"""
import triton
import triton.language as tl

from ..generalized.scan import LOG_ZERO


@triton.jit
def hdla_backward_epilogue_kernel(
    q_ptr, k_ptr, beta_ptr, g_ptr, dq_ptr, dkw_ptr, da_ptr, db_ptr, final_ptr,
    dk_ptr, dbeta_ptr, dg_ptr,
    T, H, K,
    BT: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr, HAS_FINAL: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_b = i_bh // H
    i_h = i_bh % H
    ck = tl.arange(0, BK)
    mk = ck < K
    rows = tl.arange(0, BT)
    if HAS_FINAL:  # rowsum(S_T * dS_T), the same for every step
        carry = tl.load(final_ptr + i_bh.to(tl.int64) * K + ck, mask=mk, other=0.0)
    else:
        carry = tl.zeros([BK], dtype=tl.float32)
    for i_blk in range(0, tl.cdiv(T, BT)):
        # scan steps p = n - 1 - (i_blk * BT + rows): the block of latest steps first
        p = tl.cdiv(T, BT) * BT - 1 - (i_blk * BT + rows)
        valid = (p >= 0) & (p < T)
        if REVERSE:
            t = T - 1 - p
        else:
            t = p
        tok = ((i_b * T + t) * H + i_h).to(tl.int64)
        m2 = valid[:, None] & mk[None, :]
        off = tok[:, None] * K + ck[None, :]
        off2 = tok[:, None] * (2 * K) + ck[None, :]
        q = tl.load(q_ptr + off, mask=m2, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + off, mask=m2, other=0.0).to(tl.float32)
        g_in = tl.load(g_ptr + off, mask=m2, other=0.0).to(tl.float32)
        g = tl.maximum(g_in, LOG_ZERO)  # as the scans do: g = -inf is the exact reset
        beta_t = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        beta = beta_t[:, None]
        dq = tl.load(dq_ptr + off, mask=m2, other=0.0)
        dkw = tl.load(dkw_ptr + off, mask=m2, other=0.0)
        da0 = tl.load(da_ptr + off2, mask=m2, other=0.0)
        da1 = tl.load(da_ptr + off2 + K, mask=m2, other=0.0)
        db0 = tl.load(db_ptr + off2, mask=m2, other=0.0)
        db1 = tl.load(db_ptr + off2 + K, mask=m2, other=0.0)
        lam = tl.exp(g)
        u = lam * k
        s_t = tl.sum(u * k, 1)
        s = s_t[:, None]
        a0 = beta * u
        b1 = beta * u - beta * beta * s * k
        own = q * dq - k * dkw - a0 * da0 - k * da1
        later = k * db0 + b1 * db1
        # rows are in decreasing scan order: a cumulative sum down the rows sums later steps
        total = own + later
        dg_diag = carry[None, :] + tl.cumsum(total, 0) - later
        carry += tl.sum(total, 0)
        # chain rule through A0 = beta u, A1 = k, B0 = k, B1 = beta u - beta^2 s k
        ds = -beta * beta * tl.sum(db1 * k, 1)[:, None]
        dk = dkw + da1 + db0 + beta * lam * da0 + beta * lam * db1 - beta * beta * s * db1 + 2.0 * ds * u
        dg = dg_diag + beta * u * da0 + beta * u * db1 + ds * u * k
        dbeta = tl.sum(u * da0 + u * db1, 1) - 2.0 * beta_t * s_t * tl.sum(db1 * k, 1)
        tl.store(dk_ptr + off, dk, mask=m2)
        tl.store(dg_ptr + off, tl.where(g_in < LOG_ZERO, 0.0, dg), mask=m2)  # clamped: dL/dg = 0
        tl.store(dbeta_ptr + tok, dbeta, mask=valid)
