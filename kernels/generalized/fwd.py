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
    F1ab ``chunk_intra_kernel``  W, U (fp32 ``[B*H*NT, C*RAP, BK]`` / ``[B*H*NT, C*RAP, C*RKP]``, for
                                 F1c) and Qeff, Mo, one 16-token row block at a time: block forward
                                 substitution over sub-blocks loaded from memory (details below).
    F1c ``chunk_nc_kernel``      N = At^T W and Cc = (Kt - U^T At)^T Vbar (64+-row wgmma products).
    F2  ``chunk_state_kernel``   grid (V/BV, B*H), serial over chunks: one [K x K].[K x BV] product
                                 per chunk on the chain; gamma (.) S exact in fp32; in 16-bit mode N
                                 (16-bit) times S split as hi + lo in N's dtype (two products).
                                 Few programs: the two-level scan over groups of chunks (two_level.py).
    F3  ``chunk_output_kernel``  grid (NT, V/BV, B*H): O = Qeff h + Mo Vbar.
Every kernel reads what an earlier launch wrote, except F1ab's own scratch (written and read
back by one program, across ``tl.debug_barrier``).

Decays (design/KERNELS.md "Numerics"). F1ab walks the chunk in 16-token row blocks n. The
entries between row block n and an earlier 16-token column block m < n (A, K loaded directly, 16
tokens) factor through the reference R_n = G' at row block n's first token: e^{X_t - R_n} <= 1 and
e^{R_n - G_i} <= 1 (X = G' or G), one tensor-core product per sub-block and Gram. The diagonal
16 x 16 token blocks factor the same way through the block's own reference, the per-channel
midpoint of its 16 G values, when their half range lim is below ``DIAG_LIMIT`` (= 35: every factor
<= e^35, the entries outside the token mask, dropped by a select after the product, <= e^70 times
sum |x y|): one product per Gram. A block with a faster channel (lim >= 35, e.g. log lambda = -20
per step, or g = -inf clamped at ``LOG_ZERO_FP32``) takes its pairs by levels instead
(``_diag_levels``, kernels/generalized/diag_levels.py): the pairs across its halves, quarters, ...
through the reference G at each boundary (factors <= 1), and those within groups of 8, 4, 2 or 1
tokens through each group's midpoint, the largest groups whose bound stays below DIAG_LIMIT; 2 to 5
products per Gram, exact for any gates. The choice is per row block, never per chunk. Scalar
decay per head (g [B, T, H]) multiplies the plain products by the exact decay matrix instead. The
diagonal blocks go to per-chunk scratch (and L_KB's to U's row block) and come back as tiles after a
barrier. The inverse is never formed: W_n = T_nn (Bh_n - L_AB[n, <n] W_<n) (U likewise), with T_nn
the inverse of the 16-token diagonal block by doubling, and W_m, U_m (m < n) read back from this
program's own stores; then Qeff_n = Qh_n - M_QA[n, <=n] W_<=n, Mo_n = M_QK[n, <=n] - M_QA[n, <=n] U_<=n.
Precision: Gram products with q in the input's 16-bit dtype, products with B, W, U, T in TF32 (exact
fp32 for fp32 input; the 16-token inverse in exact fp32 at one rank slot), fp32 accumulation.

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

from ..utils import LOG_ZERO_FP32, cdiv, env_switch, next_power_of_2
from . import diag_levels as levels
from . import two_level
from .directions import scan_time, split_direction

LOG_ZERO = tl.constexpr(LOG_ZERO_FP32)
SUB = tl.constexpr(16)  # tokens per row block (the exact diagonal block and the inverse's diagonal block)
CHUNKS = (16, 32, 64)
# F1's diagonal blocks (vector decay) take one tensor-core product each where G's half range over the
# 16-token block is below this (kernels/README.md §8 Numerics): factors <= e^35 ~ 1.6e15, entries outside
# the token mask <= e^70 ~ 2.5e30 times sum_k |x_k y_k| (finite in fp32 and bf16); else by levels, whose
# group products keep the same bounds (diag_levels.py). 35: -20 per step keeps 4-token groups (e^30).
DIAG_LIMIT = 35.0
# F1 for HDLA from six base Grams of q and k (chunk_intra_kernel's HDLA_GRAM; kernels/README.md §8, HDLA's Grams as
# one product): ``$HDLA_VISION_F1_GRAM=1``. Off by default until a device times it against the rank-stack Grams
# (``python -m benchmarks.launch_configs --variants base f1_gram``): exact under the interpreter, not yet run on a GPU.
F1_HDLA_GRAM = False


def f1_hdla_gram() -> bool:
    """Whether F1 takes HDLA's Grams as one product: ``$HDLA_VISION_F1_GRAM``, else :data:`F1_HDLA_GRAM`."""
    return env_switch("HDLA_VISION_F1_GRAM", F1_HDLA_GRAM)


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
def _gram(x, y, F32: tl.constexpr, LOWP: tl.constexpr):
    """``x @ y^T`` (x ``[M, D]``, y ``[N, D]``) as :func:`_mm`."""
    return _mm(x, tl.trans(y), F32, LOWP)


@triton.jit
def _steps(c, tok0, NTOK: tl.constexpr, RP: tl.constexpr, T, C: tl.constexpr, REVERSE, DIRS: tl.constexpr):
    """Rows ``tok * RP + rank`` of NTOK chunk tokens from ``tok0``: (chunk token, rank, time index,
    valid); an invalid step (past T; the reversed scan's first steps when both directions run,
    directions.py) is an identity step (masked loads)."""
    rows = tl.arange(0, NTOK * RP)
    tok = tok0 + rows // RP
    rank = rows % RP
    t, valid = scan_time(c * C + tok, T, C, REVERSE, DIRS)
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
def _from_last(x, g_last, g_rows, SCALAR: tl.constexpr):
    """x_i e^{G_last - G_i}."""
    if SCALAR:
        return x * tl.exp(g_last - g_rows)[:, None]
    else:
        return x * tl.exp(g_last[None, :] - g_rows)


@triton.jit
def chunk_cumsum_kernel(g_ptr, gs_ptr, gamma_ptr, sgb, sgt, sgh, T, H, K, NT, sgd,
                        C: tl.constexpr, BK: tl.constexpr, SCALAR: tl.constexpr, REVERSE: tl.constexpr,
                        DIRS: tl.constexpr):
    """F0 for chunk ``program_id(0)`` of head ``program_id(1)``: G, the chunk-local inclusive cumsum of
    the clamped g (scan order, fp32, ``[C, BK]`` or ``[C]``), and gamma = e^{G_last} ``[K]``. Its own
    kernel so that F1ab (and the backward) read G from memory written by a finished launch. DIRS = 2:
    both directions (directions.py), g of direction d at ``g_ptr + d * sgd``."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    i_b = bh // H
    i_h = bh % H
    if DIRS == 2:
        d, i_b, REVERSE = split_direction(bh, H, tl.num_programs(1))
        g_ptr += d * sgd
    cols = tl.arange(0, BK)
    cmask = cols < K
    tok, rank, t, valid = _steps(c, 0, C, 1, T, C, REVERSE, DIRS)
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
def chunk_nc_kernel(
    k_ptr, v_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, w_ptr, u_ptr, n_ptr, cc_ptr,
    skb, skt, skh, skr, svb, svt, svh, svr, sab, sat, sah, sar, sbb, sbt, sbh, sbr,
    sgb, sgt, sgh, sbeb, sbet, sbeh,
    T, H, K, V, NT, skd, svd, sad, sbd, sgd, sbed,
    RAB: tl.constexpr, RAP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, SCALAR: tl.constexpr, HDLA: tl.constexpr, REVERSE: tl.constexpr,
    F32: tl.constexpr, LOWP: tl.constexpr, DIRS: tl.constexpr,
):
    """F1c for chunk ``program_id(0)`` of head ``program_id(1)``: N = At^T W ``[K, K]`` (r_ab > 0) and
    Cc = (Kt - U^T At)^T Vbar ``[K, V]`` (Kt^T Vbar at r_ab = 0), from W, U (F1ab) and G (F0). DIRS = 2:
    both directions, each input of direction d at its pointer + d * its direction stride (0: shared)."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    i_b = bh // H
    i_h = bh % H
    if DIRS == 2:
        d, i_b, REVERSE = split_direction(bh, H, tl.num_programs(1))
        k_ptr += d * skd
        v_ptr += d * svd
        a_ptr += d * sad
        b_ptr += d * sbd
        g_ptr += d * sgd
        beta_ptr += d * sbed
    chunk = (bh * NT + c).to(tl.int64)
    cols = tl.arange(0, BK)
    cmask = cols < K
    g_last = _cumsum_at(gs_ptr, bh, c, C - 1, cols, NT, C, BK, SCALAR)
    tk, rk, t_k, v_k = _steps(c, 0, C, RKP, T, C, REVERSE, DIRS)
    gk_all = _load_cumsum(gs_ptr, bh, c, tk, cols, NT, C, BK, SCALAR)
    k_all = _key_rows(k_ptr, skb, skt, skh, skr, i_b, i_h, t_k, v_k, rk, cols, cmask, RKV, HDLA)
    keff = _from_last(k_all, g_last, gk_all, SCALAR)  # Kt, then Kt - U^T At
    if RAB > 0:
        ta, ra, t_a, v_a = _steps(c, 0, C, RAP, T, C, REVERSE, DIRS)
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


# ----------------------------------------------------------------------------- F1 tiles from memory
@triton.jit
def _tokens(c, tok, T, C: tl.constexpr, REVERSE, DIRS: tl.constexpr):
    """(time index, valid) of chunk tokens ``tok`` (a tensor of any shape): :func:`directions.scan_time`."""
    return scan_time(c * C + tok, T, C, REVERSE, DIRS)


@triton.jit
def _gather(ptr, sb, st, sh, sr, i_b, i_h, t, valid, rank, cols, cmask, R: tl.constexpr):
    """fp32 entries of a ``[B, T, H, (R,) D]`` tensor at steps t, rank slots ``rank`` and columns
    ``cols`` (all broadcast against each other: a row block ``[rows, 1] x [1, BK]``, a 3-D
    ``[16, RP, BK]`` block or one row ``[BK]``); rank slots >= R and invalid steps read 0."""
    off = i_b.to(tl.int64) * sb + t.to(tl.int64) * st + i_h * sh + rank * sr
    return tl.load(ptr + off + cols, mask=valid & (rank < R) & cmask, other=0.0).to(tl.float32)


@triton.jit
def _ab_tile(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh, beta_ptr, sbeb, sbet, sbeh,
             g_ptr, sgb, sgt, sgh, i_b, i_h, t, valid, rank, cols, cmask, RAB: tl.constexpr, HDLA: tl.constexpr):
    """(A, B) entries at (t, rank, cols) as :func:`_gather`; HDLA builds A = [beta u, k] and
    B = [k, beta u - beta^2 s k] (u = e^g k, s = k.u, rank slot 0 and 1) from (k, beta, g), one
    exponential per token and channel (the rank axis, if any, is broadcast)."""
    if HDLA:
        kk = _gather(k_ptr, skb, skt, skh, 0, i_b, i_h, t, valid, t * 0, cols, cmask, 1)
        g = tl.maximum(_gather(g_ptr, sgb, sgt, sgh, 0, i_b, i_h, t, valid, t * 0, cols, cmask, 1), LOG_ZERO)
        beta = tl.load(beta_ptr + i_b.to(tl.int64) * sbeb + t.to(tl.int64) * sbet + i_h * sbeh,
                       mask=valid, other=0.0).to(tl.float32)
        u = tl.exp(g) * kk
        s = tl.sum(u * kk, axis=len(kk.shape) - 1, keep_dims=True)
        first = rank == 0
        a = tl.where(first, beta * u, kk)
        b = tl.where(first, kk, beta * u - beta * beta * s * kk)
        return a, b
    else:
        a = _gather(a_ptr, sab, sat, sah, sar, i_b, i_h, t, valid, rank, cols, cmask, RAB)
        b = _gather(b_ptr, sbb, sbt, sbh, sbr, i_b, i_h, t, valid, rank, cols, cmask, RAB)
        return a, b


@triton.jit
def _k_tile(k_ptr, skb, skt, skh, skr, i_b, i_h, t, valid, rank, cols, cmask, RKV: tl.constexpr, HDLA: tl.constexpr):
    """Write-key entries K at (t, rank, cols) as :func:`_gather` (HDLA: k, one rank)."""
    if HDLA:
        return _gather(k_ptr, skb, skt, skh, 0, i_b, i_h, t, valid, rank, cols, cmask, 1)
    else:
        return _gather(k_ptr, skb, skt, skh, skr, i_b, i_h, t, valid, rank, cols, cmask, RKV)


@triton.jit
def _cum(gs_ptr, bh, c, NT, tok, cols, C: tl.constexpr, BK: tl.constexpr, SCALAR: tl.constexpr):
    """G (F0's chunk-local inclusive cumsum) at chunk tokens ``tok``: ``tok`` broadcast against
    ``cols`` (vector decay), or the shape of ``tok`` (scalar decay)."""
    row = (bh * NT + c).to(tl.int64) * C + tok
    if SCALAR:
        return tl.load(gs_ptr + row)
    else:
        return tl.load(gs_ptr + row * BK + cols)


@triton.jit
def _cum_excl(gs_ptr, bh, c, NT, tok, cols, C: tl.constexpr, BK: tl.constexpr, SCALAR: tl.constexpr):
    """G' = G - g at chunk tokens ``tok``: G of the token before (0 at the chunk's first token)."""
    row = (bh * NT + c).to(tl.int64) * C + tok - 1
    if SCALAR:
        return tl.load(gs_ptr + row, mask=tok > 0, other=0.0)
    else:
        return tl.load(gs_ptr + row * BK + cols, mask=(tok > 0) & (cols >= 0), other=0.0)


@triton.jit
def _unit_lower_inverse(d, RP: tl.constexpr, EXACT: tl.constexpr):
    """``(I + d)^{-1}`` for d ``[16 RP, 16 RP]`` strictly lower by token (r x r blocks, token-major),
    by doubling: with P the block-diagonal inverse over 2^l-token groups and X the entries between the
    halves of each 2^(l+1)-token group, the next inverse is P - P X P. fp32 accumulation; the products
    in exact fp32 (EXACT) or TF32 on tensor cores."""
    rows = tl.arange(0, SUB * RP)
    tok = rows // RP
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    inv = eye - tl.where((tok[:, None] >> 1) == (tok[None, :] >> 1), d, 0.0)
    for level in tl.static_range(1, 4):
        cross = ((tok[:, None] >> (level + 1)) == (tok[None, :] >> (level + 1))) & (
            (tok[:, None] >> level) != (tok[None, :] >> level))
        px = _mm(inv, tl.where(cross, d, 0.0), EXACT, 0)
        inv = inv - _mm(px, inv, EXACT, 0)
    return inv


@triton.jit
def _store_diag_scalar(x, gx, y, gy, tok_x, tok_y, ptr, ld_rows, ld_cols, STRICT: tl.constexpr,
                       F32: tl.constexpr, LOWP: tl.constexpr):
    """Scalar decay per head, the diagonal token block: the plain product ``x y^T`` times the exact
    decay matrix e^{gx_t - gy_i} (token(i) < token(t), or <= unless STRICT), stored at ``ptr``
    (row stride ``ld_rows``, column offsets ``ld_cols``)."""
    if STRICT:
        live = tok_x[:, None] > tok_y[None, :]
    else:
        live = tok_x[:, None] >= tok_y[None, :]
    blk = _mm(x, tl.trans(y), F32, LOWP) * tl.exp(tl.where(live, gx[:, None] - gy[None, :], float("-inf")))
    tl.store(ptr + tl.arange(0, x.shape[0])[:, None] * ld_rows + ld_cols[None, :], blk)


@triton.jit
def _block_reference(gq):
    """The reference of a row block's factored diagonal (kernels/README.md §8 Numerics): per channel
    the midpoint R of G over the block's 16 tokens (gq ``[16, BK]``), and lim = the largest half range
    over the channels, so that |G_t - R| <= lim at every token t of the block. Returns (R ``[BK]``, lim)."""
    g_hi = tl.max(gq, 0)
    g_lo = tl.min(gq, 0)
    return (g_hi + g_lo) * 0.5, tl.max(g_hi - g_lo, 0) * 0.5


@triton.jit
def _undo_reference(x, gx, ref, SCALAR: tl.constexpr):
    """Bh or Qh from the x side of the off-diagonal products: x e^{ref} = y e^{G} for vector decay
    (x = y e^{G - ref}, both factors <= 1), y e^{gx} for scalar decay (x = y)."""
    if SCALAR:
        return x * tl.exp(gx)
    else:
        return x * tl.exp(ref)


@triton.jit
def _decayed_mm(x, gx, y, gy, SCALAR: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr):
    """An off-diagonal Gram block ``x y^T``: vector decay has its factors in x and y already (:func:`_gram`); scalar
    decay multiplies by the exact decay matrix e^{gx_t - gy_i} (gx ``[rows, 1]``, gy ``[1, cols]``)."""
    if SCALAR:
        return _gram(x, y, F32, LOWP) * tl.exp(gx - gy)
    else:
        return _gram(x, y, F32, LOWP)


@triton.jit
def _key_block(k_ptr, skb, skt, skh, skr, gs_ptr, i_b, i_h, bh, c, m0, T, NT, ref, cols, cmask,
               RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, SCALAR: tl.constexpr,
               HDLA: tl.constexpr, REVERSE, DIRS: tl.constexpr):
    """The write keys of the column block at chunk token m0 ``[16 RKP, BK]``: K e^{R - G} (vector decay,
    R the row block's reference), or K and its G as a row ``[1, 16 RKP]`` (scalar decay)."""
    rows_k = tl.arange(0, SUB * RKP)
    tok = rows_k // RKP + m0
    t, valid = _tokens(c, tok, T, C, REVERSE, DIRS)
    k_m = _k_tile(k_ptr, skb, skt, skh, skr, i_b, i_h, t[:, None], valid[:, None], (rows_k % RKP)[:, None],
                  cols[None, :], cmask[None, :], RKV, HDLA)
    if SCALAR:
        return k_m, _cum(gs_ptr, bh, c, NT, tok[None, :], cols, C, BK, SCALAR)
    else:
        return k_m * tl.exp(ref - _cum(gs_ptr, bh, c, NT, tok[:, None], cols[None, :], C, BK, SCALAR)), ref


@triton.jit
def _a_block(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh, beta_ptr, sbeb, sbet, sbeh,
             g_ptr, sgb, sgt, sgh, gs_ptr, i_b, i_h, bh, c, m0, T, NT, ref, cols, cmask,
             RAB: tl.constexpr, RAP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, SCALAR: tl.constexpr,
             HDLA: tl.constexpr, REVERSE, DIRS: tl.constexpr):
    """As :func:`_key_block` for the A stack ``[16 RAP, BK]``."""
    rows_a = tl.arange(0, SUB * RAP)
    tok = rows_a // RAP + m0
    t, valid = _tokens(c, tok, T, C, REVERSE, DIRS)
    a_m, b_m = _ab_tile(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                        beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, i_b, i_h, t[:, None], valid[:, None],
                        (rows_a % RAP)[:, None], cols[None, :], cmask[None, :], RAB, HDLA)
    if SCALAR:
        return a_m, _cum(gs_ptr, bh, c, NT, tok[None, :], cols, C, BK, SCALAR)
    else:
        return a_m * tl.exp(ref - _cum(gs_ptr, bh, c, NT, tok[:, None], cols[None, :], C, BK, SCALAR)), ref


@triton.jit
def _row_block(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, sqb, sqt, sqh, skb, skt, skh,
               sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh, sbeb, sbet, sbeh,
               i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask, RAB: tl.constexpr, RAP: tl.constexpr,
               C: tl.constexpr, BK: tl.constexpr, SCALAR: tl.constexpr, HDLA: tl.constexpr, REVERSE, DIRS: tl.constexpr):
    """The operands of the row block at chunk token n0: scale q ``[16, BK]`` and its G ``[16, BK]``
    (``[16, 1]`` for scalar decay); A, B ``[16 RAP, BK]`` (row t * RAP + r) and B's G' (0s at r_ab = 0)."""
    tq = tl.arange(0, SUB)
    t_q, v_q = _tokens(c, tq + n0, T, C, REVERSE, DIRS)
    q_n = _gather(q_ptr, sqb, sqt, sqh, 0, i_b, i_h, t_q[:, None], v_q[:, None], tq[:, None] * 0,
                  cols[None, :], cmask[None, :], 1) * scale
    gq = _cum(gs_ptr, bh, c, NT, tq[:, None] + n0, cols[None, :], C, BK, SCALAR)
    if RAB > 0:
        rows_a = tl.arange(0, SUB * RAP)
        tok_b = rows_a // RAP + n0
        t_b, v_b = _tokens(c, tok_b, T, C, REVERSE, DIRS)
        a_n, b_n = _ab_tile(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                            beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, i_b, i_h, t_b[:, None],
                            v_b[:, None], (rows_a % RAP)[:, None], cols[None, :], cmask[None, :], RAB, HDLA)
        gbp = _cum_excl(gs_ptr, bh, c, NT, tok_b[:, None], cols[None, :], C, BK, SCALAR)
        return q_n, gq, a_n, b_n, gbp
    else:
        return q_n, gq, q_n, q_n, gq


@triton.jit
def _hdla_terms(k_ptr, skb, skt, skh, g_ptr, sgb, sgt, sgh, beta_ptr, sbeb, sbet, sbeh, i_b, i_h, c, tok, T, cols,
                cmask, C: tl.constexpr, REVERSE, DIRS: tl.constexpr, WITH_C: tl.constexpr):
    """HDLA's inputs at chunk tokens ``tok`` [16] for its Grams as one product (kernels/README.md §8): k
    [16, BK] fp32, beta [16] and, WITH_C, c = beta^2 s [16] with s = k . (e^g k) (else 0), as :func:`_ab_tile`
    forms them."""
    t, valid = _tokens(c, tok, T, C, REVERSE, DIRS)
    kk = _gather(k_ptr, skb, skt, skh, 0, i_b, i_h, t[:, None], valid[:, None], tok[:, None] * 0, cols[None, :],
                 cmask[None, :], 1)
    beta = tl.load(beta_ptr + i_b.to(tl.int64) * sbeb + t.to(tl.int64) * sbet + i_h * sbeh, mask=valid,
                   other=0.0).to(tl.float32)
    if WITH_C:
        g = tl.maximum(_gather(g_ptr, sgb, sgt, sgh, 0, i_b, i_h, t[:, None], valid[:, None], tok[:, None] * 0,
                               cols[None, :], cmask[None, :], 1), LOG_ZERO)
        u = tl.exp(g) * kk
        return kk, beta, beta * beta * tl.sum(u * kk, 1)
    return kk, beta, beta * 0.0


@triton.jit
def _hdla_columns(kk, gs_ptr, bh, c, NT, tok, cols, ref, C: tl.constexpr, BK: tl.constexpr):
    """The column stacks of HDLA's base Grams at chunk tokens ``tok`` through the reference ref [1, BK]:
    (k e^{ref - G}, k e^{ref - G'}), each [16, BK]. A's columns are beta_i k e^{-G'} and k e^{-G}, since
    u_i e^{-G_i} = k_i e^{-G'_i}."""
    cg = kk * tl.exp(ref - _cum(gs_ptr, bh, c, NT, tok[:, None], cols[None, :], C, BK, False))
    cp = kk * tl.exp(ref - _cum_excl(gs_ptr, bh, c, NT, tok[:, None], cols[None, :], C, BK, False))
    return cg, cp


@triton.jit
def _rank_rows(base, m, ld, cols, mask, RA: tl.constexpr):
    """Rank-0 and rank-1 rows of token block m of a token-major rank-2 stack at ``base`` (row stride ld):
    two [16, len(cols)] tiles."""
    rows = (2 * tl.arange(0, SUB) + m * RA)[:, None] * ld + cols[None, :]
    return tl.load(base + rows, mask=mask, other=0.0), tl.load(base + rows + ld, mask=mask, other=0.0)


@triton.jit
def _ranks_merge(x0, x1, D: tl.constexpr):
    """Rank-0 and rank-1 rows [16, D] interleaved into a token-major stack [32, D] (row 2t + r)."""
    return tl.reshape(tl.permute(tl.join(x0, x1), (0, 2, 1)), (2 * SUB, D))


@triton.jit
def _hdla_substitution_sums(k_ptr, g_ptr, beta_ptr, gs_ptr, w_base, u_base, skb, skt, skh, sgb, sgt, sgh, sbeb, sbet,
                            sbeh, i_b, i_h, bh, c, n, T, NT, ref, cols, cmask, C: tl.constexpr, BK: tl.constexpr,
                            REVERSE, DIRS: tl.constexpr, F32: tl.constexpr):
    """F1's step (b) for HDLA from base Grams: (L_AB[n, <n] W_<n - Bh_n [32, BK], L_AB[n, <n] U_<n [32, C]),
    storing L_KB[n, m] into U's row block n (rows (t, 0) pg, (t, 1) beta_t gg - c_t pg). With rows p = k e^{G'-ref},
    g = k e^{G-ref} of block n and columns k e^{ref-G}, k e^{ref-G'} of each block m < n (every factor <= 1),
    rank 0 of the sums is pp beta_i W0 + pg W1 and rank 1 is beta_t (gp beta_i W0 + gg W1) - c_t (rank 0), W0, W1
    the ranks' rows of W_m (U_m alike); Bh = [k e^{G'}, beta k e^{G} - c k e^{G'}] starts both."""
    RA: tl.constexpr = 2 * SUB
    tq = tl.arange(0, SUB)
    tok = tq + n * SUB
    ucols = tl.arange(0, C)
    kk, beta, cc = _hdla_terms(k_ptr, skb, skt, skh, g_ptr, sgb, sgt, sgh, beta_ptr, sbeb, sbet, sbeh, i_b, i_h, c,
                               tok, T, cols, cmask, C, REVERSE, DIRS, True)
    px = kk * tl.exp(_cum_excl(gs_ptr, bh, c, NT, tok[:, None], cols[None, :], C, BK, False) - ref)
    gx = kk * tl.exp(_cum(gs_ptr, bh, c, NT, tok[:, None], cols[None, :], C, BK, False) - ref)
    w0 = -px * tl.exp(ref)  # rank 0 of -Bh; rank 1 is beta (-g e^ref) - c (rank 0)
    wg = -gx * tl.exp(ref)
    u0 = tl.zeros([SUB, C], dtype=tl.float32)
    ug = tl.zeros([SUB, C], dtype=tl.float32)
    bt = beta[:, None]
    ct = cc[:, None]
    for m in range(n):
        tok_m = tq + m * SUB
        km, beta_m, _ = _hdla_terms(k_ptr, skb, skt, skh, g_ptr, sgb, sgt, sgh, beta_ptr, sbeb, sbet, sbeh, i_b, i_h,
                                    c, tok_m, T, cols, cmask, C, REVERSE, DIRS, False)
        cg, cp = _hdla_columns(km, gs_ptr, bh, c, NT, tok_m, cols, ref, C, BK)
        pg = _mm(px, tl.trans(cg), F32, 0)
        pp = _mm(px, tl.trans(cp), F32, 0) * beta_m[None, :]
        gg = _mm(gx, tl.trans(cg), F32, 0)
        gp = _mm(gx, tl.trans(cp), F32, 0) * beta_m[None, :]
        kb = u_base + (2 * tq + n * RA)[:, None] * C + tok_m[None, :]
        tl.store(kb, pg)
        tl.store(kb + C, bt * gg - ct * pg)
        w_m0, w_m1 = _rank_rows(w_base, m, BK, cols, cols[None, :] < BK, RA)
        u_m0, u_m1 = _rank_rows(u_base, m, C, ucols, (ucols < (m + 1) * SUB)[None, :], RA)
        w0 += _mm(pp, w_m0, F32, 0) + _mm(pg, w_m1, F32, 0)
        wg += _mm(gp, w_m0, F32, 0) + _mm(gg, w_m1, F32, 0)
        u0 += _mm(pp, u_m0, F32, 0) + _mm(pg, u_m1, F32, 0)
        ug += _mm(gp, u_m0, F32, 0) + _mm(gg, u_m1, F32, 0)
    return _ranks_merge(w0, bt * wg - ct * w0, BK), _ranks_merge(u0, bt * ug - ct * u0, C)


@triton.jit
def _hdla_query_sums(acc_q, acc_mo, xq, k_ptr, g_ptr, beta_ptr, gs_ptr, w_base, u_base, s_qk, skb, skt, skh, sgb, sgt,
                     sgh, sbeb, sbet, sbeh, i_b, i_h, bh, c, n, T, NT, ref, cols, cmask, C: tl.constexpr,
                     BK: tl.constexpr, REVERSE, DIRS: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr):
    """F1's step (c) for HDLA from base Grams over the column blocks m < n: M_QK[n, m] = qg into s_qk's row block,
    and acc_q += M_QA[n, m] W_m = qp beta_i W0 + qg W1, acc_mo += M_QA[n, m] U_m alike (xq = q e^{G-ref} of
    block n, the columns as in :func:`_hdla_substitution_sums`; M's products in LOWP as the rank-stack path)."""
    RA: tl.constexpr = 2 * SUB
    tq = tl.arange(0, SUB)
    ucols = tl.arange(0, C)
    for m in range(n):
        tok_m = tq + m * SUB
        km, beta_m, _ = _hdla_terms(k_ptr, skb, skt, skh, g_ptr, sgb, sgt, sgh, beta_ptr, sbeb, sbet, sbeh, i_b, i_h,
                                    c, tok_m, T, cols, cmask, C, REVERSE, DIRS, False)
        cg, cp = _hdla_columns(km, gs_ptr, bh, c, NT, tok_m, cols, ref, C, BK)
        qg = _mm(xq, tl.trans(cg), F32, LOWP)
        qp = _mm(xq, tl.trans(cp), F32, LOWP) * beta_m[None, :]
        tl.store(s_qk + tq[:, None] * C + tok_m[None, :], qg)
        w_m0, w_m1 = _rank_rows(w_base, m, BK, cols, cols[None, :] < BK, RA)
        u_m0, u_m1 = _rank_rows(u_base, m, C, ucols, (ucols < (m + 1) * SUB)[None, :], RA)
        acc_q += _mm(qp, w_m0, F32, 0) + _mm(qg, w_m1, F32, 0)
        acc_mo += _mm(qp, u_m0, F32, 0) + _mm(qg, u_m1, F32, 0)
    return acc_q, acc_mo


@triton.jit
def _hdla_diag_factored(q_ptr, k_ptr, g_ptr, beta_ptr, gs_ptr, s_ab, s_qa, s_qk, u_diag, sqb, sqt, sqh, skb, skt,
                        skh, sgb, sgt, sgh, sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask, ref,
                        C: tl.constexpr, BK: tl.constexpr, REVERSE, DIRS: tl.constexpr, F32: tl.constexpr,
                        DIAG_LOWP: tl.constexpr):
    """:func:`_diag_factored` for HDLA from six base Grams (kernels/README.md §8, HDLA's Grams as one product):
    the rows q e^{G-R}, k e^{G'-R} (p; 0 at the block's first token, whose L rows are all masked) and k e^{G-R}
    (g) against the columns k e^{R-G} (g) and k e^{R-G'} (p), R the block's reference; M_QK = qg, M_QA =
    [qp beta_i, qg], L_AB = [[pp beta_i, pg], [(beta_t gp - c_t pp) beta_i, beta_t gg - c_t pg]], L_KB = [pg,
    beta_t gg - c_t pg] with c_t = beta_t^2 s_t, stored where :func:`_diag_factored` stores them, in its
    operand precisions. 6 products of 16 x 16 per block instead of 9."""
    RA: tl.constexpr = 2 * SUB
    tq = tl.arange(0, SUB)
    tok = tq + n0
    r = ref[None, :]
    kk, beta, cc = _hdla_terms(k_ptr, skb, skt, skh, g_ptr, sgb, sgt, sgh, beta_ptr, sbeb, sbet, sbeh, i_b, i_h, c,
                               tok, T, cols, cmask, C, REVERSE, DIRS, True)
    t_q, v_q = _tokens(c, tok, T, C, REVERSE, DIRS)
    G = _cum(gs_ptr, bh, c, NT, tok[:, None], cols[None, :], C, BK, False)
    Gp = _cum_excl(gs_ptr, bh, c, NT, tok[:, None], cols[None, :], C, BK, False)
    qx = _gather(q_ptr, sqb, sqt, sqh, 0, i_b, i_h, t_q[:, None], v_q[:, None], tq[:, None] * 0, cols[None, :],
                 cmask[None, :], 1) * scale * tl.exp(G - r)
    cg = kk * tl.exp(r - G)
    cp = kk * tl.exp(r - Gp)
    live = tq[:, None] >= tq[None, :]
    strict = tq[:, None] > tq[None, :]
    bi = beta[None, :]
    qg = _mm(qx, tl.trans(cg), F32, DIAG_LOWP)
    qp = _mm(qx, tl.trans(cp), F32, DIAG_LOWP)
    tl.store(s_qk + tq[:, None] * C + tq[None, :], tl.where(live, qg, 0.0))
    qa = s_qa + tq[:, None] * RA + 2 * tq[None, :]
    tl.store(qa, tl.where(live, qp * bi, 0.0))
    tl.store(qa + 1, tl.where(live, qg, 0.0))
    px = kk * tl.exp(tl.where((tq > 0)[:, None], Gp - r, float("-inf")))
    gx = kk * tl.exp(G - r)
    pg = _mm(px, tl.trans(cg), F32, 0)
    pp = _mm(px, tl.trans(cp), F32, 0)
    l1g = beta[:, None] * _mm(gx, tl.trans(cg), F32, 0) - cc[:, None] * pg
    l1p = beta[:, None] * _mm(gx, tl.trans(cp), F32, 0) - cc[:, None] * pp
    ab = s_ab + (2 * tq)[:, None] * RA + 2 * tq[None, :]  # row (t, 0), column (i, 0)
    tl.store(ab, tl.where(strict, pp * bi, 0.0))
    tl.store(ab + 1, tl.where(strict, pg, 0.0))
    tl.store(ab + RA, tl.where(strict, l1p * bi, 0.0))
    tl.store(ab + RA + 1, tl.where(strict, l1g, 0.0))
    kb = u_diag + (2 * tq)[:, None] * C + tq[None, :]
    tl.store(kb, tl.where(strict, pg, 0.0))
    tl.store(kb + C, tl.where(strict, l1g, 0.0))


@triton.jit
def chunk_intra_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, w_ptr, u_ptr, scr_ptr, qe_ptr, mo_ptr, path_ptr,
    sqb, sqt, sqh, skb, skt, skh, skr, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh, sbeb, sbet, sbeh,
    T, H, K, NT, scale, n_blocks, n_cols, sqd, skd, sad, sbd, sgd, sbed,
    RAB: tl.constexpr, RAP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, SCALAR: tl.constexpr, HDLA: tl.constexpr, REVERSE: tl.constexpr,
    F32: tl.constexpr, LOWP: tl.constexpr, INV_EXACT: tl.constexpr,
    DIAG_LIMIT: tl.constexpr, DIAG_LOWP: tl.constexpr, RECORD_PATH: tl.constexpr, DIRS: tl.constexpr,
    HDLA_GRAM: tl.constexpr = False,
):
    """F1a+F1b for chunk ``program_id(0)`` of head ``program_id(1)``, one 16-token row block n at a time
    (kernels/README.md §8, module docstring), in three steps per row block:

    (a) the diagonal blocks to per-chunk scratch ``scr`` (the L_AB and M_QA diagonal blocks, the M_QK
        row block; fp32) and L_KB's to U's row block n: vector decay one product each through the
        block's reference (:func:`_diag_factored`) where the block's half range of G, lim, is below
        DIAG_LIMIT, else by levels (:func:`_diag_levels`); DIAG_LIMIT = 0: the exact column loop
        (:func:`_diag_vector`) everywhere; a decision per row block, recorded (1 one product, 2..5 the
        levels, 0 loop) in ``path [B*H*NT, C/16]`` if RECORD_PATH; scalar decay the product times the
        exact decay matrix;
    (b) W_n = T_nn (Bh_n - L_AB[n, <n] W_<n),  U_n = T_nn (L_KB[n, <=n] - L_AB[n, <n] U_<n);
    (c) Qeff_n = Qh_n - M_QA[n, <=n] W_<=n,     Mo_n = M_QK[n, <=n] - M_QA[n, <=n] U_<=n.

    Every operand is a sub-block loaded from memory: the earlier column blocks m < n of A and K, and
    W_m, U_m from this program's own earlier stores (barriers between), one tensor-core product per
    (n, m) and Gram; (b) and (c) are separate loops over m so that few tiles are live at once.
    W ``[C RAP, BK]`` and U ``[C RAP, C RKP]`` (token-major stacks, fp32) are stored for F1c; Qeff and
    Mo (q's dtype) are outputs. r_ab = 0: Qeff = Qh, Mo = M_QK. ``n_blocks = C / 16`` and ``n_cols = 16``
    are runtime loop bounds (rolled loops: fewer registers). Bh_n and Qh_n come from the x sides of
    (b)'s and (c)'s products and start their accumulators (:func:`_undo_reference`), so the row block
    is loaded (HDLA: A, B built) once per step, not again after each loop. DIRS = 2: both directions,
    each input of direction d at its pointer + d * its direction stride (0: shared). HDLA_GRAM (HDLA, vector
    decay, DIAG_LIMIT > 0): the Grams of (a)'s factored blocks, (b) and (c) from six base Grams of q and k
    (kernels/README.md §8, HDLA's Grams as one product; :func:`_hdla_diag_factored`), the products with W_m
    and U_m per rank; the levels keep the rank stacks."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    i_b = bh // H
    i_h = bh % H
    if DIRS == 2:
        d, i_b, REVERSE = split_direction(bh, H, tl.num_programs(1))
        q_ptr += d * sqd
        k_ptr += d * skd
        a_ptr += d * sad
        b_ptr += d * sbd
        g_ptr += d * sgd
        beta_ptr += d * sbed
    chunk = (bh * NT + c).to(tl.int64)
    cols = tl.arange(0, BK)
    cmask = cols < K
    RA: tl.constexpr = SUB * RAP
    RK: tl.constexpr = SUB * RKP
    CK: tl.constexpr = C * RKP
    rows_a = tl.arange(0, RA)
    rows_k = tl.arange(0, RK)
    tq = tl.arange(0, SUB)
    ucols = tl.arange(0, CK)
    s_ab = scr_ptr + chunk * (RA * RA + SUB * RA + SUB * CK)  # L_AB diagonal block [RA, RA]
    s_qa = s_ab + RA * RA                                      # M_QA diagonal block [16, RA]
    s_qk = s_qa + SUB * RA                                     # M_QK row block [16, C RKP]
    w_base = w_ptr + chunk * (C * RAP) * BK
    u_base = u_ptr + chunk * (C * RAP) * CK
    # runtime bounds: rolled loops (ptxas would unroll constant ones)
    for n in tl.range(n_blocks):
        n0 = n * SUB
        u_row = u_base + (rows_a + n * RA)[:, None] * CK
        # (a) the diagonal blocks, to scratch (L_KB's to U's row block n)
        u_diag = u_base + (n * RA) * CK + n * RK
        if SCALAR:
            q_n, gq, a_n, b_n, gbp = _row_block(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, sqb, sqt, sqh,
                                            skb, skt, skh, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh,
                                            sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask,
                                            RAB, RAP, C, BK, SCALAR, HDLA, REVERSE, DIRS)
            t_k, v_k = _tokens(c, rows_k // RKP + n0, T, C, REVERSE, DIRS)
            k_n = _k_tile(k_ptr, skb, skt, skh, skr, i_b, i_h, t_k[:, None], v_k[:, None], (rows_k % RKP)[:, None],
                          cols[None, :], cmask[None, :], RKV, HDLA)
            gk_n = _cum(gs_ptr, bh, c, NT, rows_k // RKP + n0, cols, C, BK, SCALAR)
            gq_r = _cum(gs_ptr, bh, c, NT, tq + n0, cols, C, BK, SCALAR)
            _store_diag_scalar(q_n, gq_r, k_n, gk_n, tq, rows_k // RKP, s_qk + n * RK, CK, rows_k, False, F32, LOWP)
            if RAB > 0:
                ga_n = _cum(gs_ptr, bh, c, NT, rows_a // RAP + n0, cols, C, BK, SCALAR)
                gbp_r = _cum_excl(gs_ptr, bh, c, NT, rows_a // RAP + n0, cols, C, BK, SCALAR)
                _store_diag_scalar(q_n, gq_r, a_n, ga_n, tq, rows_a // RAP, s_qa, RA, rows_a, False, F32, LOWP)
                _store_diag_scalar(b_n, gbp_r, a_n, ga_n, rows_a // RAP, rows_a // RAP, s_ab, RA, rows_a, True, F32, 0)
                _store_diag_scalar(b_n, gbp_r, k_n, gk_n, rows_a // RAP, rows_k // RKP, u_diag, CK, rows_k, True, F32, 0)
        else:
            if DIAG_LIMIT > 0:  # the product where the block's half range of G allows it, else the loop
                ref_d, lim = _block_reference(_cum(gs_ptr, bh, c, NT, tq[:, None] + n0, cols[None, :], C, BK, SCALAR))
                if lim < DIAG_LIMIT:
                    if HDLA_GRAM:
                        _hdla_diag_factored(q_ptr, k_ptr, g_ptr, beta_ptr, gs_ptr, s_ab, s_qa, s_qk + n * RK, u_diag,
                                            sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh, sbeb, sbet, sbeh, i_b, i_h,
                                            bh, c, n0, T, NT, scale, cols, cmask, ref_d, C, BK, REVERSE, DIRS, F32,
                                            DIAG_LOWP)
                    else:
                        _diag_factored(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, s_ab, s_qa, s_qk + n * RK,
                                       u_diag, sqb, sqt, sqh, skb, skt, skh, skr, sab, sat, sah, sar, sbb, sbt, sbh,
                                       sbr, sgb, sgt, sgh, sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols,
                                       cmask, ref_d, RAB, RAP, RKV, RKP, C, BK, HDLA, REVERSE, DIRS, F32, DIAG_LOWP)
                    path = n * 0 + 1
                else:
                    path = _diag_levels(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, s_ab, s_qa, s_qk + n * RK,
                                        u_diag, sqb, sqt, sqh, skb, skt, skh, skr, sab, sat, sah, sar, sbb, sbt, sbh,
                                        sbr, sgb, sgt, sgh, sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols,
                                        cmask, RAB, RAP, RKV, RKP, C, BK, HDLA, REVERSE, DIRS, F32, DIAG_LOWP,
                                        DIAG_LIMIT)
                if RECORD_PATH:
                    tl.store(path_ptr + chunk * (C // SUB) + n, path.to(tl.int8))
            else:  # DIAG_LIMIT = 0: the loop only (nothing else compiled; the launcher records 0s)
                _diag_vector(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, s_ab, s_qa, s_qk + n * RK, u_diag,
                             sqb, sqt, sqh, skb, skt, skh, skr, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh,
                             sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask, n_cols,
                             RAB, RAP, RKV, RKP, C, BK, HDLA, REVERSE, DIRS)
        # x sides of the off-diagonal products: reference R = G' at the row block's first token (0 at the
        # chunk's first token, so that Bh, Qh = x e^R there too)
        ref = _cum_excl(gs_ptr, bh, c, NT, n0, cols[None, :], C, BK, SCALAR)  # [1, BK]
        if RAB > 0:
            # (b) W_n = T_nn (Bh_n - L_AB[n, <n] W_<n), U_n = T_nn (L_KB[n, <=n] - L_AB[n, <n] U_<n)
            if HDLA_GRAM:
                acc_w, acc_u = _hdla_substitution_sums(k_ptr, g_ptr, beta_ptr, gs_ptr, w_base, u_base, skb, skt, skh,
                                                       sgb, sgt, sgh, sbeb, sbet, sbeh, i_b, i_h, bh, c, n, T, NT,
                                                       ref, cols, cmask, C, BK, REVERSE, DIRS, F32)
            else:
                q_n, gq, a_n, b_n, gbp = _row_block(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, sqb, sqt,
                                                    sqh, skb, skt, skh, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb,
                                                    sgt, sgh, sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols,
                                                    cmask, RAB, RAP, C, BK, SCALAR, HDLA, REVERSE, DIRS)
                if SCALAR:
                    xb = b_n
                else:
                    xb = b_n * tl.exp(gbp - ref)
                acc_w = -_undo_reference(xb, gbp, ref, SCALAR)  # L_AB[n, <n] W_<n - Bh_n
                acc_u = tl.zeros([RA, CK], dtype=tl.float32)
                for m in tl.range(n):  # earlier column blocks, one at a time
                    yk, gk_m = _key_block(k_ptr, skb, skt, skh, skr, gs_ptr, i_b, i_h, bh, c, m * SUB, T, NT, ref,
                                          cols, cmask, RKV, RKP, C, BK, SCALAR, HDLA, REVERSE, DIRS)
                    tl.store(u_row + (rows_k + m * RK)[None, :], _decayed_mm(xb, gbp, yk, gk_m, SCALAR, F32, 0))
                    ya, ga_m = _a_block(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                                        beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, gs_ptr, i_b, i_h, bh, c,
                                        m * SUB, T, NT, ref, cols, cmask, RAB, RAP, C, BK, SCALAR, HDLA, REVERSE, DIRS)
                    l_ab = _decayed_mm(xb, gbp, ya, ga_m, SCALAR, F32, 0)
                    w_m = tl.load(w_base + (rows_a + m * RA)[:, None] * BK + cols[None, :])
                    u_m = tl.load(u_base + (rows_a + m * RA)[:, None] * CK + ucols[None, :],
                                  mask=(ucols < (m + 1) * RK)[None, :], other=0.0)
                    acc_w += _mm(l_ab, w_m, F32, 0)
                    acc_u += _mm(l_ab, u_m, F32, 0)
            tl.debug_barrier()
            tok_c = rows_a // RAP
            l_d = tl.load(s_ab + rows_a[:, None] * RA + rows_a[None, :],
                          mask=(tok_c[:, None] > tok_c[None, :]) & ((rows_a % RAP) < RAB)[None, :], other=0.0)
            t_nn = _unit_lower_inverse(l_d, RAP, INV_EXACT)
            in_diag = (ucols >= n * RK)[None, :]
            rhs_u = tl.load(u_row + ucols[None, :], mask=(ucols < (n + 1) * RK)[None, :] & (ucols % RKP < RKV)[None, :]
                            & (~in_diag | (tok_c > 0)[:, None]), other=0.0)
            w_n = _mm(t_nn, -acc_w, F32, 0)
            u_n = _mm(t_nn, rhs_u - acc_u, F32, 0)
            tl.debug_barrier()  # every thread has read U's row block n before it is overwritten
            tl.store(w_base + (rows_a + n * RA)[:, None] * BK + cols[None, :], w_n)
            tl.store(u_row + ucols[None, :], u_n)
        # (c) Qeff_n = Qh_n - M_QA[n, <=n] W_<=n, Mo_n = M_QK[n, <=n] - M_QA[n, <=n] U_<=n
        q_n, gq, a_n, b_n, gbp = _row_block(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, sqb, sqt, sqh,
                                            skb, skt, skh, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh,
                                            sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask,
                                            0 if HDLA_GRAM else RAB, RAP, C, BK, SCALAR, HDLA, REVERSE, DIRS)
        if SCALAR:
            xq = q_n
        else:
            xq = q_n * tl.exp(gq - ref)
        acc_q = -_undo_reference(xq, gq, ref, SCALAR)  # M_QA[n, <n] W_<n - Qh_n
        acc_mo = tl.zeros([SUB, CK], dtype=tl.float32)
        if HDLA_GRAM:  # M_QK[n, m] = qg, M_QA[n, m] = [qp beta_i, qg]
            acc_q, acc_mo = _hdla_query_sums(acc_q, acc_mo, xq, k_ptr, g_ptr, beta_ptr, gs_ptr, w_base, u_base, s_qk,
                                             skb, skt, skh, sgb, sgt, sgh, sbeb, sbet, sbeh, i_b, i_h, bh, c, n, T, NT,
                                             ref, cols, cmask, C, BK, REVERSE, DIRS, F32, LOWP)
        else:
            for m in tl.range(n):
                yk, gk_m = _key_block(k_ptr, skb, skt, skh, skr, gs_ptr, i_b, i_h, bh, c, m * SUB, T, NT, ref, cols,
                                      cmask, RKV, RKP, C, BK, SCALAR, HDLA, REVERSE, DIRS)
                tl.store(s_qk + tq[:, None] * CK + (rows_k + m * RK)[None, :],
                         _decayed_mm(xq, gq, yk, gk_m, SCALAR, F32, LOWP))
                if RAB > 0:
                    ya, ga_m = _a_block(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                                        beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, gs_ptr, i_b, i_h, bh, c,
                                        m * SUB, T, NT, ref, cols, cmask, RAB, RAP, C, BK, SCALAR, HDLA, REVERSE, DIRS)
                    m_qa = _decayed_mm(xq, gq, ya, ga_m, SCALAR, F32, LOWP)
                    acc_q += _mm(m_qa, tl.load(w_base + (rows_a + m * RA)[:, None] * BK + cols[None, :]), F32, 0)
                    acc_mo += _mm(m_qa, tl.load(u_base + (rows_a + m * RA)[:, None] * CK + ucols[None, :],
                                                mask=(ucols < (m + 1) * RK)[None, :], other=0.0), F32, 0)
        tl.debug_barrier()
        qh = -acc_q
        mo = tl.load(s_qk + tq[:, None] * CK + ucols[None, :],
                     mask=((ucols < (n + 1) * RK) & (ucols % RKP < RKV))[None, :], other=0.0) - acc_mo
        if RAB > 0:
            m_qa_d = tl.load(s_qa + tq[:, None] * RA + rows_a[None, :], mask=((rows_a % RAP) < RAB)[None, :],
                             other=0.0)
            qh -= _mm(m_qa_d, tl.load(w_base + (rows_a + n * RA)[:, None] * BK + cols[None, :]), F32, 0)
            mo -= _mm(m_qa_d, tl.load(u_row + ucols[None, :]), F32, 0)
        qrow = chunk * C + n0 + tq
        tl.store(qe_ptr + qrow[:, None] * K + cols[None, :], qh.to(qe_ptr.dtype.element_ty), mask=cmask[None, :])
        mo_col = (ucols // RKP) * RKV + ucols % RKP
        tl.store(mo_ptr + qrow[:, None] * (C * RKV) + mo_col[None, :], mo.to(mo_ptr.dtype.element_ty),
                 mask=(ucols % RKP < RKV)[None, :])
        tl.debug_barrier()  # the scratch is read before the next row block writes it


@triton.jit
def _diag_vector(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, s_ab, s_qa, s_qk, u_diag,
                 sqb, sqt, sqh, skb, skt, skh, skr, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh,
                 sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask, n_cols,
                 RAB: tl.constexpr, RAP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr,
                 BK: tl.constexpr, HDLA: tl.constexpr, REVERSE, DIRS: tl.constexpr):
    """The four diagonal 16 x 16 token blocks of row block n0 / 16 (vector decay), exact: a loop over
    the block's 16 columns j, each loading row j of A and K (every rank) as vectors, with one
    exponential tile e_tj = e^{G_t - G_j} (t >= j, masked before exp) shared by all four Grams:
    M_QA[t, j] = sum_k q_t e_tj a_j and, as G'_{t+1} = G_t inside a chunk, L_AB[t + 1, j] =
    sum_k b_{t+1} e_tj a_j from B's rows shifted by one token (L_KB, M_QK alike with k_j). Each column
    is stored to its place: s_ab ``[16 RAP, 16 RAP]``, s_qa ``[16, 16 RAP]``, s_qk / u_diag (row
    strides C RKP, column offset of the block applied). L's row 0 is never written (zero: the reader
    masks it)."""
    RA: tl.constexpr = SUB * RAP
    CK: tl.constexpr = C * RKP
    tq = tl.arange(0, SUB)
    t3 = tq[:, None, None]
    r3 = tl.arange(0, RAP)[None, :, None]
    c3 = cols[None, None, :]
    cm3 = cmask[None, None, :]
    g3 = _cum(gs_ptr, bh, c, NT, t3 + n0, c3, C, BK, False)  # [16, 1, BK]
    t_q, v_q = _tokens(c, t3 + n0, T, C, REVERSE, DIRS)
    q3 = _gather(q_ptr, sqb, sqt, sqh, 0, i_b, i_h, t_q, v_q, t3 * 0, c3, cm3, 1) * scale
    if RAB > 0:
        t_s, v_s = _tokens(c, t3 + 1 + n0, T, C, REVERSE, DIRS)
        a3, b3 = _ab_tile(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                          beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, i_b, i_h, t_s, v_s & (t3 + 1 < SUB),
                          r3, c3, cm3, RAB, HDLA)  # B of token t + 1: [16, RAP, BK]
    shifted = (tq + 1 < SUB)[:, None]
    l_rows = ((tq[:, None] + 1) * RAP + tl.arange(0, RAP)[None, :])  # [16, RAP]
    for j in range(n_cols):  # = 16, a runtime bound: a rolled loop
        t_j, v_j = _tokens(c, n0 + j, T, C, REVERSE, DIRS)
        g_j = _cum(gs_ptr, bh, c, NT, n0 + j, cols, C, BK, False)
        e3 = tl.exp(tl.where(t3 >= j, g3 - g_j[None, None, :], float("-inf")))
        qe = q3 * e3
        if RAB > 0:
            be = b3 * e3
            for l in tl.static_range(RAB):
                ya, yb = _ab_tile(a_ptr, sab, sat, sah, sar, b_ptr, sbb, sbt, sbh, sbr, k_ptr, skb, skt, skh,
                                  beta_ptr, sbeb, sbet, sbeh, g_ptr, sgb, sgt, sgh, i_b, i_h, t_j, v_j, t_j * 0 + l,
                                  cols, cmask, RAB, HDLA)
                y3 = ya[None, None, :]
                tl.store(s_qa + tq[:, None] * RA + (j * RAP + l), tl.sum(qe * y3, 2))
                tl.store(s_ab + l_rows * RA + (j * RAP + l), tl.sum(be * y3, 2), mask=shifted)
        for l in tl.static_range(RKV):
            yk = _k_tile(k_ptr, skb, skt, skh, skr, i_b, i_h, t_j, v_j, t_j * 0 + l, cols, cmask, RKV, HDLA)
            y3 = yk[None, None, :]
            tl.store(s_qk + tq[:, None] * CK + (j * RKP + l), tl.sum(qe * y3, 2))
            if RAB > 0:
                tl.store(u_diag + l_rows * CK + (j * RKP + l), tl.sum(be * y3, 2), mask=shifted)


@triton.jit
def _diag_factored(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, s_ab, s_qa, s_qk, u_diag,
                   sqb, sqt, sqh, skb, skt, skh, skr, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh,
                   sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask, ref,
                   RAB: tl.constexpr, RAP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, HDLA: tl.constexpr, REVERSE, DIRS: tl.constexpr, F32: tl.constexpr,
                   DIAG_LOWP: tl.constexpr):
    """The four diagonal 16 x 16 token blocks of row block n0 / 16 (vector decay) as one tensor-core
    product each, through the block's reference ref ``[BK]`` (:func:`_block_reference`, lim below the
    launch's limit): e^{X_t - G_i} = e^{X_t - ref} e^{ref - G_i}, every factor <= e^lim, so an entry
    outside the token mask is at most e^{2 lim} sum_k |x_k y_k| (finite) and is dropped by a select
    after the product. L's row 0 (token n0, whose G' = G_{n0-1} lies outside the block) is all outside
    the strict mask: its factor is 0, so only the block's own 16 G values enter. Stored where
    :func:`_diag_vector` stores. M_QA, M_QK in bf16 operands for bf16 input, TF32 for fp16 input (fp16
    cannot hold e^lim), exact fp32 for fp32 input; L_AB, L_KB in TF32 / exact fp32 as their
    off-diagonal blocks."""
    RA: tl.constexpr = SUB * RAP
    RK: tl.constexpr = SUB * RKP
    CK: tl.constexpr = C * RKP
    tq = tl.arange(0, SUB)
    rows_a = tl.arange(0, RA)
    rows_k = tl.arange(0, RK)
    tok_a = rows_a // RAP
    tok_k = rows_k // RKP
    r = ref[None, :]
    q_n, gq, a_n, b_n, gbp = _row_block(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, sqb, sqt, sqh,
                                        skb, skt, skh, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh,
                                        sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask,
                                        RAB, RAP, C, BK, False, HDLA, REVERSE, DIRS)
    t_k, v_k = _tokens(c, tok_k + n0, T, C, REVERSE, DIRS)
    k_n = _k_tile(k_ptr, skb, skt, skh, skr, i_b, i_h, t_k[:, None], v_k[:, None], (rows_k % RKP)[:, None],
                  cols[None, :], cmask[None, :], RKV, HDLA)
    ky = k_n * tl.exp(r - _cum(gs_ptr, bh, c, NT, (tok_k + n0)[:, None], cols[None, :], C, BK, False))
    qx = q_n * tl.exp(gq - r)
    m_qk = _gram(qx, ky, F32, DIAG_LOWP)
    tl.store(s_qk + tq[:, None] * CK + rows_k[None, :], tl.where(tq[:, None] >= tok_k[None, :], m_qk, 0.0))
    if RAB > 0:
        ay = a_n * tl.exp(r - _cum(gs_ptr, bh, c, NT, (tok_a + n0)[:, None], cols[None, :], C, BK, False))
        bx = b_n * tl.exp(tl.where((tok_a > 0)[:, None], gbp - r, float("-inf")))
        m_qa = _gram(qx, ay, F32, DIAG_LOWP)
        tl.store(s_qa + tq[:, None] * RA + rows_a[None, :], tl.where(tq[:, None] >= tok_a[None, :], m_qa, 0.0))
        l_ab = _gram(bx, ay, F32, 0)
        tl.store(s_ab + rows_a[:, None] * RA + rows_a[None, :], tl.where(tok_a[:, None] > tok_a[None, :], l_ab, 0.0))
        l_kb = _gram(bx, ky, F32, 0)
        tl.store(u_diag + rows_a[:, None] * CK + rows_k[None, :], tl.where(tok_a[:, None] > tok_k[None, :], l_kb, 0.0))


@triton.jit
def _diag_levels(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, s_ab, s_qa, s_qk, u_diag,
                 sqb, sqt, sqh, skb, skt, skh, skr, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh,
                 sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask,
                 RAB: tl.constexpr, RAP: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr,
                 BK: tl.constexpr, HDLA: tl.constexpr, REVERSE, DIRS: tl.constexpr, F32: tl.constexpr,
                 DIAG_LOWP: tl.constexpr, LIMIT: tl.constexpr):
    """The four diagonal 16 x 16 token blocks of row block n0 / 16 (vector decay) by levels
    (kernels/generalized/diag_levels.py), where one product through the block's reference could overflow
    (lim >= LIMIT): the cross levels 3 .. s_g, factors <= 1, and the group level s_g, factors within
    [e^-LIMIT, e^LIMIT], each one masked product per Gram; the group level's factors come from G (M's
    rows and every column) and from G' with each group's first row 0 (L's rows). Stored where
    :func:`_diag_factored` stores, in the same operand precisions. Returns the path, 1 + the cross levels
    taken (2..5)."""
    RA: tl.constexpr = SUB * RAP
    RK: tl.constexpr = SUB * RKP
    CK: tl.constexpr = C * RKP
    tq = tl.arange(0, SUB)
    rows_a = tl.arange(0, RA)
    rows_k = tl.arange(0, RK)
    tok_q = tq + n0
    tok_a = rows_a // RAP + n0
    tok_k = rows_k // RKP + n0
    t_k, v_k = _tokens(c, tok_k, T, C, REVERSE, DIRS)
    g_base = gs_ptr + (bh * NT + c).to(tl.int64) * C * BK
    s_g = levels.group_shift(_cum(gs_ptr, bh, c, NT, tok_q[:, None], cols[None, :], C, BK, False), tok_q, g_base, BK,
                             cols, cmask, LIMIT)
    # one Gram at a time, every operand loaded afresh per level (HDLA builds A, B again): few live tiles
    m_qk = tl.zeros([SUB, RK], dtype=tl.float32)
    for lvl in tl.range(0, 5 - s_g):
        q_n, gq, a_n, b_n, gbp = _row_block(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, sqb, sqt, sqh,
                                            skb, skt, skh, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh,
                                            sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask,
                                            0, RAP, C, BK, False, HDLA, REVERSE, DIRS)
        qx = q_n * levels.level_row_exp(gq, tok_q, lvl, s_g, g_base, BK, cols, cmask, False)
        k_n = _k_tile(k_ptr, skb, skt, skh, skr, i_b, i_h, t_k[:, None], v_k[:, None], (rows_k % RKP)[:, None],
                      cols[None, :], cmask[None, :], RKV, HDLA)
        ky = k_n * levels.level_col_exp(_cum(gs_ptr, bh, c, NT, tok_k[:, None], cols[None, :], C, BK, False), tok_k,
                                        lvl, s_g, g_base, BK, cols, cmask)
        m_qk += tl.where(levels.level_live(tok_q, tok_k, lvl, s_g, False), _gram(qx, ky, F32, DIAG_LOWP), 0.0)
    tl.store(s_qk + tq[:, None] * CK + rows_k[None, :], m_qk)
    if RAB > 0:
        m_qa = tl.zeros([SUB, RA], dtype=tl.float32)
        for lvl in tl.range(0, 5 - s_g):
            q_n, gq, a_n, b_n, gbp = _row_block(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, sqb, sqt, sqh,
                                                skb, skt, skh, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh,
                                                sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask,
                                                RAB, RAP, C, BK, False, HDLA, REVERSE, DIRS)
            qx = q_n * levels.level_row_exp(gq, tok_q, lvl, s_g, g_base, BK, cols, cmask, False)
            ay = a_n * levels.level_col_exp(_cum(gs_ptr, bh, c, NT, tok_a[:, None], cols[None, :], C, BK, False),
                                            tok_a, lvl, s_g, g_base, BK, cols, cmask)
            m_qa += tl.where(levels.level_live(tok_q, tok_a, lvl, s_g, False), _gram(qx, ay, F32, DIAG_LOWP),
                             0.0)
        tl.store(s_qa + tq[:, None] * RA + rows_a[None, :], m_qa)
        l_ab = tl.zeros([RA, RA], dtype=tl.float32)
        l_kb = tl.zeros([RA, RK], dtype=tl.float32)
        for lvl in tl.range(0, 5 - s_g):
            q_n, gq, a_n, b_n, gbp = _row_block(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, gs_ptr, sqb, sqt, sqh,
                                                skb, skt, skh, sab, sat, sah, sar, sbb, sbt, sbh, sbr, sgb, sgt, sgh,
                                                sbeb, sbet, sbeh, i_b, i_h, bh, c, n0, T, NT, scale, cols, cmask,
                                                RAB, RAP, C, BK, False, HDLA, REVERSE, DIRS)
            bx = b_n * levels.level_row_exp(gbp, tok_a, lvl, s_g, g_base, BK, cols, cmask, True)
            ay = a_n * levels.level_col_exp(_cum(gs_ptr, bh, c, NT, tok_a[:, None], cols[None, :], C, BK, False),
                                            tok_a, lvl, s_g, g_base, BK, cols, cmask)
            l_ab += tl.where(levels.level_live(tok_a, tok_a, lvl, s_g, True), _gram(bx, ay, F32, 0), 0.0)
            l_kb += _level_kb(bx, k_ptr, skb, skt, skh, skr, gs_ptr, i_b, i_h, bh, c, NT, t_k, v_k, rows_k, tok_a,
                              tok_k, lvl, s_g, g_base, cols, cmask, RKV, RKP, C, BK, HDLA, F32)
        tl.store(s_ab + rows_a[:, None] * RA + rows_a[None, :], l_ab)
        tl.store(u_diag + rows_a[:, None] * CK + rows_k[None, :], l_kb)
    return 5 - s_g


@triton.jit
def _level_kb(bx, k_ptr, skb, skt, skh, skr, gs_ptr, i_b, i_h, bh, c, NT, t_k, v_k, rows_k, tok_a, tok_k, lvl, s_g,
              g_base, cols, cmask, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              HDLA: tl.constexpr, F32: tl.constexpr):
    """Level ``lvl``'s share of the diagonal L_KB block (:func:`_diag_levels`): the B rows ``bx`` (their level
    factors applied) against the block's keys with theirs, masked to the pairs of that level."""
    k_n = _k_tile(k_ptr, skb, skt, skh, skr, i_b, i_h, t_k[:, None], v_k[:, None], (rows_k % RKP)[:, None],
                  cols[None, :], cmask[None, :], RKV, HDLA)
    ky = k_n * levels.level_col_exp(_cum(gs_ptr, bh, c, NT, tok_k[:, None], cols[None, :], C, BK, False), tok_k,
                                    lvl, s_g, g_base, BK, cols, cmask)
    return tl.where(levels.level_live(tok_a, tok_k, lvl, s_g, True), _gram(bx, ky, F32, 0), 0.0)


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
    tok, rank, t, valid = _steps(c, 0, C, 1, T, C, REVERSE, 1)
    qe = tl.load(qe_ptr + (chunk * C + tok)[:, None] * K + cols[None, :], mask=(cols < K)[None, :], other=0.0)
    h = tl.load(h_ptr + chunk * K * V + cols[:, None] * V + vcols[None, :],
                mask=(cols < K)[:, None] & vmask[None, :], other=0.0)
    mcols = tl.arange(0, C * RKP)
    mo = tl.load(mo_ptr + (chunk * C + tok)[:, None] * (C * RKV) + ((mcols // RKP) * RKV + mcols % RKP)[None, :],
                 mask=(mcols % RKP < RKV)[None, :], other=0.0)
    tk, rk, t_k, v_k = _steps(c, 0, C, RKP, T, C, REVERSE, 1)
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



@triton.jit
def _scan_output(qe_ptr, mo_ptr, h_ptr, v_ptr, svb, svt, svh, svr, i_b, i_h, chunk, c_scan, rows, T, K, V,
                 vcols, vmask, REVERSE, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                 HDLA: tl.constexpr, F32: tl.constexpr, OWN: tl.constexpr):
    """One direction's share of the bidirectional output: ``Qeff h + Mo Vbar`` at the scan rows ``rows``
    ``[C]`` of scan chunk ``c_scan`` (``chunk`` its scratch index) in the both-directions map
    (directions.py), fp32 ``[C, BV]``. Without OWN, Mo's entries of a row's own token (its diagonal,
    ``scale q_t . K_t``: the token's own write) are left out."""
    cols = tl.arange(0, BK)
    kmask = cols < K
    qe = tl.load(qe_ptr + (chunk * C + rows)[:, None] * K + cols[None, :], mask=kmask[None, :], other=0.0)
    h = tl.load(h_ptr + chunk * K * V + cols[:, None] * V + vcols[None, :], mask=kmask[:, None] & vmask[None, :],
                other=0.0)
    mcols = tl.arange(0, C * RKP)
    keep = (mcols % RKP < RKV)[None, :]
    if not OWN:
        keep = keep & ((mcols // RKP)[None, :] != rows[:, None])
    mo = tl.load(mo_ptr + (chunk * C + rows)[:, None] * (C * RKV) + ((mcols // RKP) * RKV + mcols % RKP)[None, :],
                 mask=keep, other=0.0)
    tk, rk, t_k, v_k = _steps(c_scan, 0, C, RKP, T, C, REVERSE, 2)
    if HDLA:
        vb = _load_stack(v_ptr, svb, svt, svh, 0, i_b, i_h, t_k, v_k, rk, vcols, vmask, 1)
    else:
        vb = _load_stack(v_ptr, svb, svt, svh, svr, i_b, i_h, t_k, v_k, rk, vcols, vmask, RKV)
    if F32:
        return tl.dot(qe, h, input_precision="ieee") + tl.dot(mo, vb, input_precision="ieee")
    else:
        return tl.dot(qe, h) + tl.dot(mo, vb.to(mo.dtype))


@triton.jit
def chunk_output_bidir_kernel(qe_ptr, mo_ptr, h_ptr, v_ptr, o_ptr, svb, svt, svh, svr, sob, sot, soh,
                              T, H, K, V, NT, svd, RKV: tl.constexpr, RKP: tl.constexpr, C: tl.constexpr,
                              BK: tl.constexpr, BV: tl.constexpr, HDLA: tl.constexpr, F32: tl.constexpr):
    """F3 of both directions with the bidirectional epilogue, grid (NT, V/BV, B*H): tokens ``c C + j`` of
    one head are row j of the forward scan's chunk c and row C-1-j of the reversed scan's chunk NT-1-c
    (directions.py), so ``y = O_fwd + O_bwd - own write`` is summed in registers and stored once; the
    reversed scan's own write is its Mo's diagonal, left out (kernels/README.md §9). The scratch holds
    the forward scan at batch-heads ``[0, B H)`` and the reversed one at ``[B H, 2 B H)``; v of the
    reversed scan is at ``v_ptr + svd`` (0: shared)."""
    c = tl.program_id(0)
    i_v = tl.program_id(1)
    bh = tl.program_id(2)
    i_b = bh // H
    i_h = bh % H
    vcols = i_v * BV + tl.arange(0, BV)
    vmask = vcols < V
    rows = tl.arange(0, C)
    fwd = (bh * NT + c).to(tl.int64)
    y = _scan_output(qe_ptr, mo_ptr, h_ptr, v_ptr, svb, svt, svh, svr, i_b, i_h, fwd, c, rows, T, K, V, vcols, vmask,
                     False, RKV, RKP, C, BK, HDLA, F32, True)
    bwd = ((bh + tl.num_programs(2)) * NT + NT - 1 - c).to(tl.int64)
    y += _scan_output(qe_ptr, mo_ptr, h_ptr, v_ptr + svd, svb, svt, svh, svr, i_b, i_h, bwd, NT - 1 - c, C - 1 - rows,
                      T, K, V, vcols, vmask, True, RKV, RKP, C, BK, HDLA, F32, False)
    t, valid = scan_time(c * C + rows, T, C, False, 1)
    off = i_b.to(tl.int64) * sob + t.to(tl.int64) * sot + i_h * soh
    tl.store(o_ptr + off[:, None] + vcols[None, :], y.to(o_ptr.dtype.element_ty), mask=valid[:, None] & vmask[None, :])


# ----------------------------------------------------------------------------- launchers
def _pow2(n: int) -> int:
    return 1 if n <= 1 else next_power_of_2(n)


def default_chunk(r_ab: int, r_kv: int, dk: int) -> int:
    """C = 32 where the rank stacks r_ab*C and r_kv*C fit 128 rows (64 at K > 128: F1's shared memory on
    an H100, sm_90 compile), else 16. 64-token chunks halve the state passes' steps but double the
    chunk-local work per token, and the chunk-local kernels dominate: on the H100 (2026-11-24,
    kernels/README.md §8 Status) the forward took 0.78 / 0.99 / 4.73 ms at C = 32 against 1.07 / 1.15 /
    5.41 at C = 64 (HDLA; vision, high-res, LM shapes) and B2 2.51 against 4.11 ms (HDLA, vision).
    ``chunk_prepare(chunk=64)`` still runs 64."""
    rows = 128 if dk <= 128 else 64
    if _pow2(max(r_ab, 1)) * 32 <= rows and _pow2(r_kv) * 32 <= rows:
        return 32
    return 16


def intra_scratch_floats(c: int, rap: int, rkp: int) -> int:
    """fp32 scratch per chunk of :func:`chunk_intra_kernel`: the L_AB and M_QA diagonal blocks and
    the M_QK row block (``[16 rap, 16 rap] + [16, 16 rap] + [16, c rkp]``)."""
    return 16 * rap * 16 * rap + 16 * 16 * rap + 16 * c * rkp


def launch_warps(stage: str, c: int, rap: int, rkp: int, bk: int) -> int:
    """num_warps per forward stage from the tile sizes (chunk c, padded ranks, key block bk): each entry
    the smallest count that compiled for sm_90a without spills (``--part aot``), except where a device
    timed another one faster (``python -m benchmarks.launch_configs``: F1ab at rank 2 and K <= 64)."""
    rows = c * max(rap, rkp)
    if stage == "F0":
        return 4 if c * bk <= 64 * 64 else 8
    if stage == "F1ab":  # row-block tiles: [16 rap, width] with width = max(bk, c rkp)
        width = max(bk, c * rkp)
        # rank 2 at width 64 (HDLA at d = 64): 4 warps timed 40% faster than 8 (benchmarks/launch_configs.py,
        # H100); both spill ~80 bytes on sm_90a
        return 4 if 16 * rap * width < 32 * 64 or (rap == 2 and width <= 64) else 8
    if stage == "F1c":
        # 4 warps up to 64 x 128 tiles: at the LM shape (K = 128, rank 2, C = 32) 8 warps of 142 registers held one
        # block per SM (Nsight Compute, benchmarks/results/ncu_h200); 4 took chunk_nc_kernel 791 -> 567 us on an H200
        # (launch_configs f1c_w4, results/launch_configs_h200/occupancy.json), outputs bit-equal
        return 4 if rows * bk <= 64 * 128 else 8
    if stage == "F2":
        return 4 if bk <= 64 else 8
    raise ValueError(f"unknown stage {stage!r}")


def launch_register_cap(stage: str) -> dict:
    """Extra launch options of a forward stage: ``{"maxnreg": n}`` to cap its registers per thread, or none (the
    default: ptxas takes up to 255). A hook for ``benchmarks.launch_configs`` (F1ab holds 255 registers at every head
    dim, one block per SM at 8 warps; benchmarks/results/NOTES.md, 2026-11-28)."""
    return {}


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


def chunk_prepare(q, k, v, a, b, g, scale, reverse, hdla_beta=None, chunk=None, num_warps=None,
                  diag_limit=DIAG_LIMIT, record_path=False, direction_strides=None):
    """F1. Shapes: q [B, T, H, K]; k [B, T, H, r_kv, K], v [B, T, H, r_kv, V], a, b [B, T, H, r_ab, K]
    (HDLA: k [B, T, H, K], v [B, T, H, V], a = b = None, hdla_beta [B, T, H]); g [B, T, H, K] or
    [B, T, H]. Returns a dict with N [B, H, NT, K, K] (None at r_ab = 0), Cc [B, H, NT, K, V] fp32,
    Qeff [B, H, NT*C, K], Mo [B, H, NT, C, r_kv*C], gamma [B, H, NT, K] fp32, G (scratch cumsum),
    chunk, and the launch facts F2/F3 reuse (see the module docstring for layouts and dtypes).
    ``diag_limit``: the largest half range of G over a 16-token block whose diagonal Grams are one
    factored product, and over the groups of the levels that take the other blocks (vector decay; 0:
    every block takes the exact loop). ``record_path``: also return ``diag_path`` [B, H, NT, C/16] int8,
    1 where a row block took one product, 2..5 the levels (1 + the cross levels), 0 the loop (-1: scalar
    decay, always the product with the exact decay matrix).

    ``direction_strides``: both scan directions in one launch (directions.py; kernels/README.md §9):
    a dict ``{name: stride}`` naming the inputs (of q, k, v, a, b, g, hdla_beta) that differ by
    direction: the tensor passed is the forward scan's slice, the reversed scan's is ``stride``
    elements after it; the inputs not named are shared. Every input must have a contiguous last dim. The outputs then hold the forward scan at
    batches [0, B) and the reversed one at [B, 2B) (``2B`` in place of ``B`` above), and
    ``reverse`` is ignored."""
    _check(q, k, v, a, b, g, hdla_beta, chunk)
    if not 0.0 <= diag_limit <= DIAG_LIMIT:
        raise ValueError(f"diag_limit must be in [0, {DIAG_LIMIT}] (larger factors can overflow fp32), got {diag_limit}")
    if q.dtype == torch.float64:
        raise ValueError("q is float64: the Triton kernels run fp32/bf16/fp16 (use the float64 loop)")
    hdla = hdla_beta is not None
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    r_kv = 1 if hdla else k.shape[3]
    r_ab = 2 if hdla else a.shape[3]
    if direction_strides is None:
        q, k, v, a, b, g, hdla_beta = (_last_contiguous(x) for x in (q, k, v, a, b, g, hdla_beta))
    else:
        _check_direction_strides(direction_strides, q=q, k=k, v=v, a=a, b=b, g=g, hdla_beta=hdla_beta)
    key = (r_ab, r_kv, dk, dv, g.dim() == 3, hdla, q.dtype, num_warps)
    candidates = [chunk] if chunk is not None else _chunk_candidates(key)
    for c in candidates:
        try:
            return _prepare(q, k, v, a, b, g, scale, reverse, hdla_beta, c, num_warps, diag_limit, record_path,
                            direction_strides)
        except OutOfResources:  # raised when the binary is loaded, before anything ran
            if c == candidates[-1]:
                raise
            _TOO_BIG.add(key + (c,))


DIRECTION_INPUTS = ("q", "k", "v", "a", "b", "g", "hdla_beta")


def _check_direction_strides(direction_strides: dict, **inputs) -> None:
    """``direction_strides`` names only inputs (ValueError otherwise); each input given has a
    contiguous last dim (the kernels add the direction's offset to its pointer, never copy it)."""
    unknown = set(direction_strides) - set(DIRECTION_INPUTS)
    if unknown:
        raise ValueError(f"direction_strides: unknown inputs {sorted(unknown)}; expected some of {DIRECTION_INPUTS}")
    for name, x in inputs.items():
        if x is not None and x.dim() and x.stride(-1) != 1:
            raise ValueError(f"{name}: both directions in one launch need a contiguous last dim, got strides "
                             f"{tuple(x.stride())}")


def _direction_offsets(direction_strides, *names) -> tuple:
    """The kernels' direction strides of ``names`` (0 for a shared input or one direction)."""
    return tuple((direction_strides or {}).get(name, 0) for name in names)


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


def _prepare(q, k, v, a, b, g, scale, reverse, hdla_beta, c, num_warps, diag_limit, record_path,
             direction_strides=None):
    """F1 launch with chunk size c (see :func:`chunk_prepare`)."""
    hdla = hdla_beta is not None
    dirs = 1 if direction_strides is None else 2
    batch, seq_len, heads, dk = q.shape
    batch *= dirs  # the scratch and outputs: both directions' batches, direction-major
    dv = v.shape[-1]
    r_kv = 1 if hdla else k.shape[3]
    r_ab = 2 if hdla else a.shape[3]
    n_chunks = cdiv(seq_len, c)
    f32 = q.dtype == torch.float32
    store_dtype = torch.float32 if f32 else q.dtype
    scalar = g.dim() == 3
    bk = max(16, next_power_of_2(dk))
    bv = max(16, min(64, next_power_of_2(dv)))
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
    tiles = dict(C=c, BK=bk, SCALAR=scalar, REVERSE=bool(reverse) and dirs == 1, DIRS=dirs)
    chunk_cumsum_kernel[grid](g, gs, gamma, *_strides(g, 3), seq_len, heads, dk, n_chunks,
                              *_direction_offsets(direction_strides, "g"), **tiles,
                              num_warps=launch_warps("F0", c, rap, rkp, bk))
    a_in, b_in = (a, b) if r_ab and not hdla else (dummy, dummy)
    beta_in = hdla_beta if hdla else dummy
    w_mat = torch.empty(bhn * c * rap * bk if r_ab else 1, device=dev, dtype=torch.float32)
    u_mat = torch.empty(bhn * c * rap * c * rkp if r_ab else 1, device=dev, dtype=torch.float32)
    ranks = dict(RAB=r_ab, RAP=rap, RKV=r_kv, RKP=rkp, HDLA=hdla, F32=f32, LOWP=lowp)
    scratch = torch.empty(bhn * intra_scratch_floats(c, rap, rkp), device=dev, dtype=torch.float32)
    path = None
    if record_path:  # -1: scalar decay (no choice); 0 where the kernel takes the loop with nothing to record
        path = torch.full((batch, heads, n_chunks, c // 16), -1 if scalar else (0 if diag_limit == 0 else -2),
                          device=dev, dtype=torch.int8)
    chunk_intra_kernel[grid](
        q, k, a_in, b_in, g, beta_in, gs, w_mat, u_mat, scratch, qe, mo, path if record_path else dummy,
        *_strides(q, 3), *k_str, *ab_str, *bb_str, *_strides(g, 3), *_strides(hdla_beta, 3),
        seq_len, heads, dk, n_chunks, float(scale), c // 16, 16,
        *_direction_offsets(direction_strides, "q", "k", "a", "b", "g", "hdla_beta"), **ranks, **tiles,
        INV_EXACT=f32 or rap == 1,
        DIAG_LIMIT=float(diag_limit), DIAG_LOWP=int(q.dtype == torch.bfloat16), RECORD_PATH=record_path,
        HDLA_GRAM=hdla and diag_limit > 0 and f1_hdla_gram(),
        num_warps=num_warps or launch_warps("F1ab", c, rap, rkp, bk), num_stages=1, **launch_register_cap("F1ab"),
    )
    chunk_nc_kernel[grid](
        k, v, a_in, b_in, g, beta_in, gs, w_mat, u_mat, n_mat if r_ab else dummy, cc,
        *k_str, *v_str, *ab_str, *bb_str, *_strides(g, 3), *_strides(hdla_beta, 3),
        seq_len, heads, dk, dv, n_chunks, *_direction_offsets(direction_strides, "k", "v", "a", "b", "g", "hdla_beta"),
        **ranks, **tiles, BV=bv,
        num_warps=num_warps or launch_warps("F1c", c, rap, rkp, bk),
    )
    return dict(N=n_mat, Cc=cc, Qeff=qe, Mo=mo, gamma=gamma, G=gs, chunk=c, r_kv=r_kv, r_ab=r_ab, hdla=hdla,
                seq_len=seq_len, dtype=q.dtype, diag_path=path, dirs=dirs)


def f2_block_v(heads_total: int, dv: int, bk: int) -> int:
    """F2's state columns per program: the widest of 64 (32 at K > 128) that still gives ``heads_total``
    (B x H) x V / BV >= 264 programs (two per SM of an H100), at least 16."""
    bv = max(16, min(64 if bk <= 128 else 32, next_power_of_2(dv)))
    while bv > 16 and heads_total * cdiv(dv, bv) < 264:
        bv //= 2
    return bv


def chunk_state_pass(prep, initial_state=None, bv=None, num_warps=None, num_stages=None, groups=None):
    """F2. Returns (h [B, H, NT, K, V] the state entering each chunk, in q's dtype (fp32 for fp32 q),
    final [B, H, K, V] fp32). ``groups``: chunk groups of the two-level scan (two_level.py; None: its
    rule :func:`two_level.state_pass_groups`, or ``$HDLA_VISION_STATE_GROUPS``; 1: one level)."""
    cc = prep["Cc"]
    batch, heads, n_chunks, dk, dv = cc.shape
    f32 = prep["dtype"] == torch.float32
    h = torch.empty(batch, heads, n_chunks, dk, dv, device=cc.device,
                    dtype=torch.float32 if f32 else prep["dtype"])
    final = torch.empty(batch, heads, dk, dv, device=cc.device, dtype=torch.float32)
    bk = max(16, next_power_of_2(dk))
    if bv is None:
        bv = f2_block_v(batch * heads, dv, bk)
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
    programs = batch * heads * cdiv(dv, bv)
    groups = two_level.state_pass_groups(programs, n_chunks, two_level.device_sm_count(cc.device), dk, groups)
    prep["f2_groups"] = groups  # what ran, for the stage benchmarks
    if groups > 1:
        lowp = 0 if f32 else (1 if prep["dtype"] == torch.bfloat16 else 2)
        two_level.two_level_chain(n_mat, cc, prep["gamma"], initial_state, h, final, groups, bv,
                                  trans=False, reverse=False, lowp=lowp, num_warps=num_warps)
        return h, final
    chunk_state_kernel[(cdiv(dv, bv), batch * heads)](
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
    bk = max(16, next_power_of_2(dk))
    if bv is None:
        bv = max(16, min(64, next_power_of_2(dv)))
    if num_warps is None:
        num_warps = 4
    hdla = prep["hdla"]
    v_str = _strides(v, 3) + ((0,) if hdla else (v.stride(3),))
    chunk_output_kernel[(n_chunks, cdiv(dv, bv), batch * heads)](
        qe, prep["Mo"], h, v, o, *v_str, *_strides(o, 3), seq_len, heads, dk, dv, n_chunks,
        RKV=r_kv, RKP=_pow2(r_kv), C=c, BK=bk, BV=bv, HDLA=hdla, REVERSE=bool(reverse),
        F32=prep["dtype"] == torch.float32, num_warps=num_warps,
    )
    return o


def chunk_output_bidir(prep, h, v, v_direction_stride=0, bv=None, num_warps=4):
    """F3 of both directions (``prep`` and ``h`` from a both-directions launch, ``2B`` batches) with the
    bidirectional epilogue (:func:`chunk_output_bidir_kernel`): returns ``y [B, T, H, V]`` in q's dtype,
    the forward scan plus the reversed scan minus the reversed scan's own write. v as given to
    :func:`chunk_prepare` (its forward slice) and its direction stride (0: shared)."""
    qe = prep["Qeff"]
    batch2, heads, n_chunks, dk, dv = h.shape
    c, r_kv, seq_len = prep["chunk"], prep["r_kv"], prep["seq_len"]
    y = torch.empty(batch2 // 2, seq_len, heads, dv, device=qe.device, dtype=prep["dtype"])
    bk = max(16, next_power_of_2(dk))
    bv = bv or max(16, min(64, next_power_of_2(dv)))
    hdla = prep["hdla"]
    v_str = _strides(v, 3) + ((0,) if hdla else (v.stride(3),))
    chunk_output_bidir_kernel[(n_chunks, cdiv(dv, bv), batch2 // 2 * heads)](
        qe, prep["Mo"], h, v, y, *v_str, *_strides(y, 3), seq_len, heads, dk, dv, n_chunks, v_direction_stride,
        RKV=r_kv, RKP=_pow2(r_kv), C=c, BK=bk, BV=bv, HDLA=hdla, F32=prep["dtype"] == torch.float32,
        num_warps=num_warps,
    )
    return y


def generalized_forward(q, k, v, a, b, g, scale, initial_state, reverse, hdla_beta=None, chunk=None,
                        diag_limit=DIAG_LIMIT, direction_strides=None):
    """F1, F2, F3: returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32, h
    [B, H, NT, K, V] the state entering each chunk). Shapes and ``diag_limit`` as :func:`chunk_prepare`.

    ``direction_strides`` (:func:`chunk_prepare`): both directions in one launch; ``initial_state``
    is then ``[2B, H, K, V]`` (forward, reversed) or None, the final state and h have ``2B`` batches,
    and o is the bidirectional sum ``y = o_fwd + o_bwd - own write of the reversed scan``
    (:func:`chunk_output_bidir`)."""
    scale = 1.0 if scale is None else scale
    prep = chunk_prepare(q, k, v, a, b, g, scale, reverse, hdla_beta=hdla_beta, chunk=chunk, diag_limit=diag_limit,
                         direction_strides=direction_strides)
    h, final = chunk_state_pass(prep, initial_state)
    if direction_strides is not None:
        return chunk_output_bidir(prep, h, v, direction_strides.get("v", 0)), final, h
    return chunk_output(prep, h, v, reverse), final, h
