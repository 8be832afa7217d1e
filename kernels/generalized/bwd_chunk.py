"""B2, the chunk-local VJP of the chunk64 backward (kernels/README.md §8), as a
sequence of small launches that pass per-chunk tiles through global scratch (no atomics, no walk
across chunks). Per chunk (``blk = (b*H + h)*NT + c``; stacks token-major, rank fastest, row t*RP + l):

    S1 ``_stacks_kernel``   G, G' (fp32 chunk-local cumsums of the clamped g), scale*q, the rank stacks
                            K, A, B (HDLA: built from k, beta, g), the decayed Kt, At, Bh, Vbar, dO.
    S2 ``_gram_kernel``     M_QK, M_QA, L_AB, L_KB per 16-token row block: off-diagonal blocks by one
                            product through the reference G at the column block's last token (both
                            factors <= 1); the diagonal block per K tile by one product through its own
                            reference (the midpoint of its log-decays, both factors <= e^DIAG_LIMIT)
                            masked after it, where that bound holds in every K tile; a decay per head:
                            the plain product times the exact decay matrix (kernels/README.md §8).
    S2b ``_gram_levels_kernel`` (vector decay) the diagonal blocks S2 left, each K tile by one product
                            or by levels (kernels/generalized/diag_levels.py; per block and K tile,
                            never per chunk); programs with nothing left exit at once.
    S2 for HDLA ``_hdla_gram_kernel``: the same four Grams from six base Grams of q and k mixed with beta and
                            s (kernels/README.md §8, HDLA's Grams as one product): 6 C^2 K multiply-adds
                            per chunk, not 9 C^2 K.
    S3 ``_inverse_kernel``  T = (I + L_AB)^-1: 16-token diagonal blocks by doubling, the others by block
                            forward substitution (T_nm = -T_nn sum_k L_nk T_km).
    S4 ``_gemm_group_kernel`` every plain product of the VJP (W, U, Mo, E, dQeff, dMo, dE, dN, dV, dAt,
                            dU, dW, dM_QA, T^T dW, T^T dU, dL_AB), one output tile per program, the
                            independent products in one launch (S4_LAUNCHES: 18 products in 6 launches).
    S5a ``_gram_vjp_kernel`` one launch per Gram matrix, per 16-token block and K tile: the Gram VJP
                            (same decay factoring and the same diagonal rule, the cotangent masked
                            before the products) into dx, dy scratch.
    S5a for HDLA ``_hdla_gram_vjp_kernel``: the four Gram VJPs in one launch through the six base Grams, into the
                            same buffers (12 products per block pair instead of 18).
    S5b ``_gram_vjp_levels_kernel`` (vector decay) the diagonal shares S5a left, by levels, added to
                            its dx, dy. S2b and S5b are launches of their own so that S2's and S5a's
                            registers stay those of the single product.
    S5 ``_vjp_kernel``      per K tile, over the 16-token blocks from last to first: the chain rule
                            through the decays, dq, dk, da, db, and dg as the chunk-local reverse cumsum
                            of the dG, dG' cotangents.
    S6 ``_reduce_kernel``   (HDLA or per-head decay) the full-K sums: HDLA's s = k.u and beta terms,
                            or the per-head dg; its first K tile's programs also run S7 (one launch less:
                            the op is host-bound below the LM shape, ~55 us of host per launch).
    S7 ``_unstack_kernel``  dV from the stack layout back to [B, T, H, r_kv, V] (a launch of its own only
                            where S6 does not run: vector decay without HDLA's builder).

Products take bf16 (fp16) operands with fp32 accumulation for 16-bit inputs and exact fp32 (ieee) for
fp32 inputs; the inverse's off-diagonal products use tf32 for 16-bit inputs, the factored diagonal
VJPs of M_QK and M_QA and S5b's levels tf32x3 (:data:`DIAG_PRECISION`, kernels/README.md §8 Numerics: dg needs
their precision), those of L_AB, L_KB (:data:`VJP_DIAG_PRECISIONS`) and S2's Gram blocks (:data:`GRAM_DIAG_PRECISION`)
one tf32 product.
Scratch is fp32, except for 16-bit inputs the tensors that only S4's products read (:data:`OPERAND_ONLY`,
stored in the dtype those products cast them to: the same bits, half the bytes), 16-bit copies of T and
At that S4 reads instead (:data:`OPERAND_COPIES`), and dV's stack (dv's dtype); :func:`scratch_dtypes`.
"""
import functools
import math
import os

import torch
import triton
import triton.language as tl

from . import diag_levels as levels
from .directions import earlier, later, scan_time, split_direction
from ..utils import cdiv, next_power_of_2

SUB = tl.constexpr(16)  # tokens per block of the exact decays and of the inverse's diagonal blocks
# The diagonal token blocks' factored product runs where both factors are <= e^DIAG_LIMIT (kernels/README.md
# §8 Numerics: no fp32 or bf16 overflow below it), else by levels under the same bound (diag_levels.py);
# the launchers accept any limit in [0, DIAG_LIMIT]. 35: -20 per step keeps 4-token groups (e^30).
DIAG_LIMIT = 35.0
# Operands of the factored diagonal products for 16-bit inputs (a _dot LOWP code): 3 = tf32x3. The
# diagonal blocks hold the largest entries of every Gram (nearby tokens, decays near 1) and dg is a
# reverse cumsum of products of them that cancel: with bf16 operands dg was 1e-2 to 2.4e-2 off the
# float64 loop at mild gates on the H100 (5e-3 allowed), with exact fp32 (the token loop) 1.6e-3.
# ``$HDLA_VISION_DIAG_PRECISION`` (bf16 / tf32 / tf32x3) overrides it, for the stage benchmarks.
DIAG_PRECISIONS = {"bf16": 1, "tf32": 0, "tf32x3": 3}
DIAG_PRECISION = "tf32x3"
# S2's (and S2b's) diagonal Gram blocks, which feed the inverse and S4's 16-bit products, not dg's sum directly:
# one tf32 product suffices there. On the H100 (2026-11-25, benchmarks/results/launch_configs_h100/
# diag_precision.json) S2 took 2.21 -> 1.74 ms at hdla_tiny's 1024 px batch and 2.61 -> 2.08 ms at the LM shape;
# bf16 there put HDLA's dbeta at 5.2e-3 of float64 (tf32x3: 4.9e-3); the Gram VJPs' needs: VJP_DIAG_PRECISIONS.
# ``$HDLA_VISION_DIAG_PRECISION_S2`` overrides it, then ``$HDLA_VISION_DIAG_PRECISION`` (both stages).
GRAM_DIAG_PRECISION = "tf32"
# S5a's factored diagonal blocks per Gram VJP (GRAM_VJPS' order: M_QK, M_QA, L_AB, L_KB): the VJPs of L_AB and
# L_KB take one tf32 product, M_QK's and M_QA's (and S5b's levels, DIAG_PRECISION) tf32x3. On the H100
# (2026-11-25, launch_configs_h100/s5_per_gram.json) S5a took 3.65 -> 3.23 ms at the LM shape and 2.63 -> 2.42
# at hdla_tiny's 1024 px batch with dg unchanged; M_QK's on tf32 raised dg from 1.7e-3 to 3.0e-3 of float64,
# tf32 in S5b too (every stage on tf32) put it at 7.0e-3 with -20 gates.
VJP_DIAG_PRECISIONS = ("tf32x3", "tf32x3", "tf32", "tf32")

# B2's scratch (chunk_vjp's z[...], per chunk) by producer and consumers. "operand": an S4 product's
# operand, which _dot casts to the input's 16-bit dtype for 16-bit inputs (_gemm_part's load, then _dot
# with LOWP); "cin": S4's fp32 addend; "stack": a Gram's x or y stack, multiplied by its exp factors before
# the product (S2, S5a); "D": a Gram VJP's cotangent (S5a: the factored diagonal block takes it as a
# DLOWP = tf32x3 operand, the per-head decay and the token loop elementwise); "S5"/"S6": elementwise reads.
#   gs, gps   S1    S2, S5a, S5 (exp arguments)                   fp32
#   s, bt     S1    S2, S5a (HDLA's single Gram); S5, S6 (s); S2b (HDLA's rebuilt A, B rows)   fp32
#   xq        S1    S2, S5a stack; S5                              fp32
#   kf        S1    S2, S5a stack; S5                              fp32
#   kt        S1    et cin (r_ab > 0; at r_ab = 0 it is et, dvs's operand); S5   fp32
#   af, bf    S1    S2, S5a stack; S5 (HDLA: S2b, S5b only)        fp32 (HDLA's lean stacks: S2b writes the
#                   rows of the blocks it and S5b take)
#   at        S1    et, du, dw operand; S5 (its e^{G_last} sum)     fp32, S4 reads its 16-bit copy at16 (HDLA's
#                   lean stacks: only that copy where there is one; S5 rebuilds At for HDLA)
#   bh        S1    w operand; S5 (not HDLA's)                     fp32 (HDLA's lean stacks: 16-bit)
#   vf        S1    dmo, det operand                               16-bit
#   dos       S1    dqe, dmo, dvs operand                          16-bit
#   mqk       S2    mo cin (r_ab > 0); dvs operand (r_ab = 0: mo)  16-bit at r_ab = 0, else fp32
#   mqa       S2    mo, du, dw operand                             16-bit
#   lab       S2    S3 (ieee / tf32 reads)                         fp32
#   lkb       S2    u operand                                      16-bit
#   tm        S3    S3 (earlier rows read back, tf32); w, u, dwp, dup operand   fp32, S4 reads tm16
#   w         S4    dat, dmqa, dlab operand                        16-bit
#   u         S4    mo, et, dat, dmqa, dlab operand                16-bit
#   mo, et    S4    dvs operand                                    16-bit
#   dqe       S4    dw, dmqa operand; S5                           fp32
#   dmo       S4    du, dmqa operand; D of M_QK                    fp32
#   det       S4    dat, du operand; S5                            fp32
#   dvs       S4    S7, which casts it to dv's dtype               dv's dtype (one rounding either way)
#   dn        S4    dat, dw operand                                16-bit
#   dat, dwp  S4    S5                                             fp32
#   du, dw    S4    dup, dwp operand                               16-bit
#   dmqa      S4    D of M_QA                                      fp32
#   dup       S4    dlab operand; D of L_KB                        fp32
#   dlab      S4    D of L_AB                                      fp32
#   gq, gk    S5a   S5 (S5b adds to them)                          fp32
#   ga, gb    S5a   S5 (S5b adds to them)                          fp32
#   red       S5    S6                                             fp32
# A 16-bit tensor is rounded once where it is stored instead of at each product that reads it (the same
# round-to-nearest-even conversion), so the gradients are bit-identical to fp32 scratch
# (tests/test_chunk_bwd_kernels.py::test_lowp_scratch_is_bit_identical).
OPERAND_ONLY = ("vf", "dos", "mqa", "lkb", "w", "u", "mo", "et", "dn", "du", "dw")
# fp32 tensors that S4 reads often enough to pay for a 16-bit copy written beside them by their producer
# (2 bytes written, 2 saved per product that reads it): T (S3; w, u, dwp, dup) and At (S1; et, du, dw).
OPERAND_COPIES = ("tm16", "at16")
# Scratch tensors whose lifetimes (SCRATCH_LIFETIMES) do not overlap share memory: chunk_vjp carves them
# from one pool by plan_scratch, so the transient is the most that is live at once, not the sum.
# "lowp": the above for 16-bit inputs; "fp32": every scratch tensor fp32 (the benchmarks' comparison, the
# bit-identity test). ``$HDLA_VISION_B2_SCRATCH`` overrides it, read at every chunk_vjp call.
# "lowp_stacks": "lowp" and the stacks that copy a 16-bit input (:data:`INPUT_COPIES`: Kf, and Af, Bf but for HDLA,
# whose A, B are built), in its dtype: the same values, half the bytes; off until a device times it
# (benchmarks/launch_configs.py variant stacks16).
SCRATCH_MODES = ("lowp", "fp32", "lowp_stacks")
SCRATCH = "lowp"
INPUT_COPIES = ("kf", "af", "bf")

# The Gram VJPs of S5a, in launch order: (cotangent, x stack, x's cumsum, y stack, x's gradient buffer, y's,
# strictly lower, add to the x buffer, add to the y buffer). The gradient buffers are per stack (gq: q, gk:
# the write keys, ga: A, gb: B), since S5 needs only each stack's total: a Gram that meets a buffer an
# earlier launch stored adds to it.
GRAM_VJPS = (("dmo", "q", "gs", "k", "gq", "gk", False, False, False),  # M_QK
             ("dmqa", "q", "gs", "a", "gq", "ga", False, True, False),  # M_QA
             ("dlab", "b", "gps", "a", "gb", "ga", True, False, True),  # L_AB
             ("dup", "b", "gps", "k", "gb", "gk", True, True, True))  # L_KB
STACK_OF = dict(q="xq", k="kf", a="af", b="bf")

# chunk_vjp's launches in order (S4's products by the scratch they write; qeff and n: B1's inputs).
STAGES = ("S1", "S2", "S2b", "S3", "w", "u", "mo", "et", "qeff", "n", "B1", "dqe", "dmo", "det", "dn", "dat", "du",
          "dw", "dmqa", "dwp", "dup", "dvs", "dlab", "S5a_qk", "S5a_qa", "S5a_ab", "S5a_kb", "S5b", "S5", "S6", "S7")
# S4's products that share a launch (_gemm_group_kernel: independent products, run in any order), at r_ab > 0 and
# at r_ab = 0 (no W, U, dN, ...; M_QK is M_o, so dV's product needs nothing S4 writes)
S4_LAUNCHES = (("w", "u"), ("mo", "et", "qeff", "n"), ("dqe", "dmo", "det", "dn"), ("dat", "du", "dw", "dmqa"),
               ("dwp", "dup", "dvs"), ("dlab",))
S4_LAUNCHES_RANK0 = (("dqe", "dmo", "det", "dvs"),)
# Each scratch tensor's (writer, last reader) among STAGES, from the table at the top of this module and the
# products in chunk_vjp. Two tensors may share memory only if one's last reader's launch runs before the
# other's writer's (strictly: a launch that reads one and writes the other would race).
SCRATCH_LIFETIMES = dict(
    gs=("S1", "S5"), gps=("S1", "S5"), s=("S1", "S6"), bt=("S1", "S5a_qk"), xq=("S1", "S5"), kf=("S1", "S5"),
    kt=("S1", "S5"), af=("S1", "S5"), bf=("S1", "S5"), at=("S1", "S5"), at16=("S1", "dw"), bh=("S1", "S5"),
    vf=("S1", "det"), dos=("S1", "dvs"), mqk=("S2", "mo"), mqa=("S2", "dmqa"), lab=("S2", "S3"), lkb=("S2", "u"),
    tm=("S3", "dup"), tm16=("S3", "dup"), w=("w", "dlab"), u=("u", "dlab"), mo=("mo", "dvs"), et=("et", "dvs"),
    dqe=("dqe", "S5"), dmo=("dmo", "S5b"), det=("det", "S5"), dvs=("dvs", "S7"), dn=("dn", "dw"),
    dat=("dat", "S5"), du=("du", "dup"), dw=("dw", "dwp"), dmqa=("dmqa", "S5b"), dwp=("dwp", "S5"),
    dup=("dup", "S5b"), dlab=("dlab", "S5b"), gq=("S5a_qk", "S5"), gk=("S5a_qk", "S5"), ga=("S5a_qa", "S5"),
    gb=("S5a_ab", "S5"))
# Whether chunk_vjp carves its scratch from one planned pool (True) or allocates each tensor apart (the
# tests' comparison).
SCRATCH_POOL = True
POOL_ALIGN = 16  # bytes: every tensor of the pool starts at a multiple of it per block


@triton.jit
def _dot(x, y, F32: tl.constexpr, LOWP: tl.constexpr):
    """x @ y, fp32 accumulate: ieee fp32 (F32), else bf16 (LOWP 1), fp16 (LOWP 2), tf32 (LOWP 0) or
    three tf32 products (LOWP 3: hi*hi + hi*lo + lo*hi, fp32 operands to ~2^-21) operands."""
    if F32:
        return tl.dot(x, y, input_precision="ieee")
    elif LOWP == 1:
        return tl.dot(x.to(tl.bfloat16), y.to(tl.bfloat16))
    elif LOWP == 2:
        return tl.dot(x.to(tl.float16), y.to(tl.float16))
    elif LOWP == 3:
        return tl.dot(x, y, input_precision="tf32x3")
    else:
        return tl.dot(x, y, input_precision="tf32")


@triton.jit
def _row_tokens(c, rows, RP: tl.constexpr, C: tl.constexpr, T, H, i_b, i_h, REVERSE, DIRS: tl.constexpr):
    """Stack rows of chunk c (row = chunk token * RP + rank): (memory index (b*T + t)*H + h as int64,
    valid (a token, not an identity step: directions.scan_time), rank)."""
    t, valid = scan_time(c * C + rows // RP, T, C, REVERSE, DIRS)
    t = tl.where(valid, t, 0)
    return ((i_b * T + t) * H + i_h).to(tl.int64), valid, rows % RP


@triton.jit
def _load_g(g_ptr, blk, tok, C: tl.constexpr, K, ck, mk, BKS: tl.constexpr, SCALAR: tl.constexpr):
    """A cumsum scratch (G or G', [blocks, C, K] or [blocks, C] for a decay per head) at chunk tokens
    ``tok`` ([R] vector) and columns ck: [R, BKS] (the per-head value broadcast over the columns)."""
    if SCALAR:
        x = tl.load(g_ptr + blk * C + tok)
        return x[:, None] + tl.zeros([1, BKS], dtype=tl.float32)
    else:
        return tl.load(g_ptr + (blk * C + tok)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)


@triton.jit
def _load_g_row(g_ptr, blk, tok, C: tl.constexpr, K, ck, mk, BKS: tl.constexpr, SCALAR: tl.constexpr):
    """One chunk token's row of a cumsum scratch: [BKS]."""
    if SCALAR:
        return tl.load(g_ptr + blk * C + tok) + tl.zeros([BKS], dtype=tl.float32)
    else:
        return tl.load(g_ptr + (blk * C + tok) * K + ck, mask=mk, other=0.0)


@triton.jit
def _load_tile(ptr, blk, rows, NROWS: tl.constexpr, K, ck, mk):
    """Rows of a chunk's [NROWS, K] fp32 scratch tile, columns ck: [len(rows), BKS]."""
    return tl.load(ptr + (blk * NROWS + rows)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)


# ----------------------------------------------------------------------------- S1: stacks
@triton.jit
def _store_hdla_ab(af_ptr, bf_ptr, a0, b1, kk, blk, ct, C: tl.constexpr, K, ck, mk):
    """HDLA's A = [beta u, k] and B = [k, b1] rows of chunk tokens ct (a0 = beta u, b1 = beta u - beta^2 s k,
    kk = k, each [len(ct), BKS]) into the rank stacks af, bf [blocks, 2C, K]."""
    _store_rank_rows(af_ptr, a0, blk, 0, ct, 2, C, K, ck, mk)
    _store_rank_rows(af_ptr, kk, blk, 1, ct, 2, C, K, ck, mk)
    _store_rank_rows(bf_ptr, kk, blk, 0, ct, 2, C, K, ck, mk)
    _store_rank_rows(bf_ptr, b1, blk, 1, ct, 2, C, K, ck, mk)


@triton.jit
def _hdla_ab_rows(kf_ptr, bt_ptr, s_ptr, g_ptr, af_ptr, bf_ptr, blk, c, n, T, H, K, sgd,
                  C: tl.constexpr, BKS: tl.constexpr, REVERSE: tl.constexpr, LOG_ZERO: tl.constexpr,
                  DIRS: tl.constexpr):
    """HDLA's A and B rows of token block n of chunk c (batch-head ``program_id(1)``) into af, bf as S1 writes
    them where it writes them (:func:`_stacks_kernel` with HDLA_AB): u = e^g k from the input g (clamped at
    LOG_ZERO), k, beta and s from S1's kf, bt and s scratch. S2b calls it for the blocks it takes, the only rows
    of the stacks that S2b and S5b read, when S1 left the stacks out."""
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    rev = REVERSE
    if DIRS == 2:
        d, i_b, rev = split_direction(i_bh, H, tl.num_programs(1))
        g_ptr += d * sgd
    tb = n * SUB + tl.arange(0, SUB)
    tok, valid, _ = _row_tokens(c, tb, 1, C, T, H, i_b, i_h, rev, DIRS)
    beta = tl.load(bt_ptr + blk * C + tb)
    s = tl.load(s_ptr + blk * C + tb)
    for k0 in range(0, K, BKS):
        ck = k0 + tl.arange(0, BKS)
        mk = ck < K
        kk = _load_tile(kf_ptr, blk, tb, C, K, ck, mk)
        gg = tl.maximum(tl.load(g_ptr + tok[:, None] * K + ck[None, :], mask=valid[:, None] & mk[None, :],
                                other=0.0).to(tl.float32), LOG_ZERO)
        a0 = beta[:, None] * (tl.exp(gg) * kk)
        b1 = a0 - (beta * beta * s)[:, None] * kk
        _store_hdla_ab(af_ptr, bf_ptr, a0, b1, kk, blk, tb, C, K, ck, mk)


@triton.jit
def _store_rank_rows(ptr, x, blk, l, ct, RP: tl.constexpr, C: tl.constexpr, D, cd, md):
    """Store per-token rows x [C, BD] as rank l of a [blocks, C*RP, D] stack."""
    tl.store(ptr + (blk * C * RP + ct * RP + l)[:, None] * D + cd[None, :], x.to(ptr.dtype.element_ty),
             mask=md[None, :])


@triton.jit
def _store_with_copy(ptr, copy_ptr, x, blk, l, ct, RP: tl.constexpr, C: tl.constexpr, D, cd, md,
                     COPY: tl.constexpr, MAIN: tl.constexpr = True):
    """:func:`_store_rank_rows` into ptr (if MAIN) and, with COPY, into copy_ptr (S4's 16-bit operand copy)."""
    if MAIN:
        _store_rank_rows(ptr, x, blk, l, ct, RP, C, D, cd, md)
    if COPY:
        _store_rank_rows(copy_ptr, x, blk, l, ct, RP, C, D, cd, md)


@triton.jit
def _stacks_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, beta_ptr, g_ptr, do_ptr,
    gs_ptr, gps_ptr, s_ptr, bt_ptr, xq_ptr, kf_ptr, kt_ptr, af_ptr, bf_ptr, at_ptr, at16_ptr, bh_ptr, vf_ptr, dos_ptr,
    qh_ptr, gamma_ptr,
    T, H, K, V, NT, scale, sqd, skd, svd, sad, sbd, sbed, sgd,
    C: tl.constexpr, BKS: tl.constexpr, BVS: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr,
    RAB: tl.constexpr, RAP: tl.constexpr, HDLA: tl.constexpr, SCALAR: tl.constexpr, REVERSE: tl.constexpr,
    LOG_ZERO: tl.constexpr, AT16: tl.constexpr, DIRS: tl.constexpr, STATE_INPUTS: tl.constexpr,
    HDLA_AB: tl.constexpr = True, HDLA_AT32: tl.constexpr = True,
):
    """S1, grid (NT, B*H). Writes G, G' ([blocks, C, K] or [blocks, C]), HDLA's s and beta [blocks, C], scale*q
    [blocks, C, K], Kf, Kt [blocks, C*RKP, K], Af, Bf, At, Bh [blocks, C*RAP, K] (AT16: At also into
    at16, S4's 16-bit copy), Vbar [blocks, C*RKP, V], dO [blocks, C, V]; padded rank rows and steps past
    T are 0. HDLA: Af, Bf only if HDLA_AB and the fp32 At only if HDLA_AT32 (:func:`chunk_vjp` leaves out what
    no later stage reads: the single-Gram S2 / S5a read neither stack, S2b writes the rows S2b and S5b read
    (:func:`_hdla_ab_rows`), S5 rebuilds A and At, and S4 reads the 16-bit copy of At). DIRS = 2: both
    directions (directions.py), each input of direction d at its pointer + d * its direction stride (0: shared;
    dO is always shared). STATE_INPUTS: also B1's Qh = scale q e^G [blocks, C, K]
    (Qeff at r_ab = 0) and gamma = e^{G_last} [blocks, K] (fp32), so that the backward needs no second run
    of the forward's F1."""
    c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    if DIRS == 2:
        d, i_b, REVERSE = split_direction(i_bh, H, tl.num_programs(1))
        q_ptr += d * sqd
        k_ptr += d * skd
        v_ptr += d * svd
        a_ptr += d * sad
        b_ptr += d * sbd
        beta_ptr += d * sbed
        g_ptr += d * sgd
    blk = i_bh.to(tl.int64) * NT + c
    ct = tl.arange(0, C)
    tok, valid, _ = _row_tokens(c, ct, 1, C, T, H, i_b, i_h, REVERSE, DIRS)
    if SCALAR:
        gsc = tl.maximum(tl.load(g_ptr + tok, mask=valid, other=0.0).to(tl.float32), LOG_ZERO)
        Gs = tl.cumsum(gsc, 0)
        tl.store(gs_ptr + blk * C + ct, Gs)
        tl.store(gps_ptr + blk * C + ct, Gs - gsc)
        GLs = tl.sum(gsc, 0)
    if HDLA:
        beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        s = tl.zeros([C], dtype=tl.float32)
        for k0 in range(0, K, BKS):
            ck = k0 + tl.arange(0, BKS)
            m = valid[:, None] & (ck[None, :] < K)
            kk = tl.load(k_ptr + tok[:, None] * K + ck[None, :], mask=m, other=0.0).to(tl.float32)
            gg = tl.maximum(tl.load(g_ptr + tok[:, None] * K + ck[None, :], mask=m, other=0.0).to(tl.float32),
                            LOG_ZERO)
            s += tl.sum(tl.exp(gg) * kk * kk, 1)
        tl.store(s_ptr + blk * C + ct, s)
        tl.store(bt_ptr + blk * C + ct, beta)
    for k0 in range(0, K, BKS):
        ck = k0 + tl.arange(0, BKS)
        mk = ck < K
        m = valid[:, None] & mk[None, :]
        if SCALAR:
            G = Gs[:, None] + tl.zeros([1, BKS], dtype=tl.float32)
            Gp = G - gsc[:, None]
            GL = GLs + tl.zeros([BKS], dtype=tl.float32)
        else:
            gg = tl.maximum(tl.load(g_ptr + tok[:, None] * K + ck[None, :], mask=m, other=0.0).to(tl.float32),
                            LOG_ZERO)
            G = tl.cumsum(gg, 0)
            Gp = G - gg
            GL = tl.sum(gg, 0)
            tl.store(gs_ptr + (blk * C + ct)[:, None] * K + ck[None, :], G, mask=mk[None, :])
            tl.store(gps_ptr + (blk * C + ct)[:, None] * K + ck[None, :], Gp, mask=mk[None, :])
        xq = scale * tl.load(q_ptr + tok[:, None] * K + ck[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(xq_ptr + (blk * C + ct)[:, None] * K + ck[None, :], xq, mask=mk[None, :])
        if STATE_INPUTS:
            tl.store(qh_ptr + (blk * C + ct)[:, None] * K + ck[None, :], (xq * tl.exp(G)).to(qh_ptr.dtype.element_ty),
                     mask=mk[None, :])
            tl.store(gamma_ptr + blk * K + ck, tl.exp(GL), mask=mk)
        e_last = tl.exp(GL[None, :] - G)  # e^{G_last - G_i} <= 1
        e_excl = tl.exp(Gp)  # e^{G'_t} <= 1
        if HDLA:
            kk = tl.load(k_ptr + tok[:, None] * K + ck[None, :], mask=m, other=0.0).to(tl.float32)
            _store_rank_rows(kf_ptr, kk, blk, 0, ct, 1, C, K, ck, mk)
            _store_rank_rows(kt_ptr, kk * e_last, blk, 0, ct, 1, C, K, ck, mk)
            u = tl.exp(gg) * kk  # HDLA's decay is per channel (never SCALAR)
            a0 = beta[:, None] * u
            b1 = a0 - (beta * beta * s)[:, None] * kk
            if HDLA_AB:
                _store_hdla_ab(af_ptr, bf_ptr, a0, b1, kk, blk, ct, C, K, ck, mk)
            _store_with_copy(at_ptr, at16_ptr, a0 * e_last, blk, 0, ct, 2, C, K, ck, mk, AT16, HDLA_AT32)
            _store_with_copy(at_ptr, at16_ptr, kk * e_last, blk, 1, ct, 2, C, K, ck, mk, AT16, HDLA_AT32)
            _store_rank_rows(bh_ptr, kk * e_excl, blk, 0, ct, 2, C, K, ck, mk)
            _store_rank_rows(bh_ptr, b1 * e_excl, blk, 1, ct, 2, C, K, ck, mk)
        else:
            for l in tl.static_range(RKP):
                kl = tl.load(k_ptr + (tok * RKV + l)[:, None] * K + ck[None, :], mask=m & (l < RKV),
                             other=0.0).to(tl.float32)
                _store_rank_rows(kf_ptr, kl, blk, l, ct, RKP, C, K, ck, mk)
                _store_rank_rows(kt_ptr, kl * e_last, blk, l, ct, RKP, C, K, ck, mk)
            for l in tl.static_range(RAP if RAB > 0 else 0):
                al = tl.load(a_ptr + (tok * RAB + l)[:, None] * K + ck[None, :], mask=m & (l < RAB),
                             other=0.0).to(tl.float32)
                bl = tl.load(b_ptr + (tok * RAB + l)[:, None] * K + ck[None, :], mask=m & (l < RAB),
                             other=0.0).to(tl.float32)
                _store_rank_rows(af_ptr, al, blk, l, ct, RAP, C, K, ck, mk)
                _store_rank_rows(bf_ptr, bl, blk, l, ct, RAP, C, K, ck, mk)
                _store_with_copy(at_ptr, at16_ptr, al * e_last, blk, l, ct, RAP, C, K, ck, mk, AT16)
                _store_rank_rows(bh_ptr, bl * e_excl, blk, l, ct, RAP, C, K, ck, mk)
    for v0 in range(0, V, BVS):
        cv = v0 + tl.arange(0, BVS)
        mv = cv < V
        m = valid[:, None] & mv[None, :]
        dov = tl.load(do_ptr + tok[:, None] * V + cv[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(dos_ptr + (blk * C + ct)[:, None] * V + cv[None, :], dov.to(dos_ptr.dtype.element_ty),
                 mask=mv[None, :])
        for l in tl.static_range(RKP):
            vl = tl.load(v_ptr + (tok * RKV + l)[:, None] * V + cv[None, :], mask=m & (l < RKV),
                         other=0.0).to(tl.float32)
            _store_rank_rows(vf_ptr, vl, blk, l, ct, RKP, C, V, cv, mv)


# ----------------------------------------------------------------------------- S2: Gram matrices
@triton.jit
def _token_mask(tx, ty, STRICT):
    """[len(tx), len(ty)]: the Gram entries kept, column token < row token (STRICT) or <= (:func:`directions.earlier`)."""
    return earlier(ty[None, :], tx[:, None], STRICT)


@triton.jit
def _diag_reference(X, Y):
    """The reference log-decay of a diagonal token block (kernels/README.md §8 Numerics): R [BKS] per
    channel, the midpoint of the block's X [rows, BKS] and Y [cols, BKS] values, and lim (a scalar),
    the largest |X - R| or |R - Y| over the tile, so that every e^{X_t - R} and e^{R - Y_i} is <= e^lim."""
    hi = tl.maximum(tl.max(X, 0), tl.max(Y, 0))
    lo = tl.minimum(tl.min(X, 0), tl.min(Y, 0))
    ref = 0.5 * (hi + lo)
    return ref, tl.max(tl.maximum(hi - ref, ref - lo), 0)


@triton.jit
def _record_path(path_ptr, idx, product, RECORD: tl.constexpr):
    """Tests only (RECORD): store which path a diagonal block took, 1 a product, 0 the token loop."""
    if RECORD:
        tl.store(path_ptr + idx, product)


@triton.jit
def _gram_diag_loop(acc, x, X, y_ptr, g_ptr, blk, m, tx, cy, K, ck, mk, C: tl.constexpr, RY: tl.constexpr,
                    STRICT, BKS: tl.constexpr):
    """The diagonal block's K tile token by token (the fallback where the factors could overflow):
    acc [16 RX, 16 RY] plus, for each column token j, sum_k x_tk y_jk e^{X_tk - G_jk} (masked before
    exp); x, X [16 RX, BKS] the rows' tile and cumsum."""
    for j in range(SUB):
        tj = m * SUB + j
        Yj = _load_g_row(g_ptr, blk, tj, C, K, ck, mk, BKS, False)
        live = later(tx, tj, STRICT)
        xe = x * tl.exp(tl.where(live[:, None], X - Yj[None, :], float("-inf")))
        for l in tl.static_range(RY):
            yl = tl.load(y_ptr + (blk * C * RY + m * SUB * RY + j * RY + l) * K + ck, mask=mk, other=0.0)
            col = tl.sum(xe * yl[None, :], 1)
            acc = tl.where(cy[None, :] == j * RY + l, acc + col[:, None], acc)
    return acc


@triton.jit
def _gram_diag_levels(x_ptr, xg_ptr, y_ptr, g_ptr, blk, rx, ry, K, ck, mk, C: tl.constexpr, RX: tl.constexpr,
                      RY: tl.constexpr, STRICT, BKS: tl.constexpr, F32: tl.constexpr, DLOWP: tl.constexpr,
                      LIMIT: tl.constexpr):
    """A diagonal block's K tile by levels (kernels/generalized/diag_levels.py), where one product through
    the block's reference could overflow: rows rx of the x stack (cumsum xg: G or G'), columns ry of the y
    stack (G). One masked product per level, its tiles loaded afresh (fewer live registers than keeping
    them across the levels). Returns the block [16 RX, 16 RY] (entries outside the token mask 0) and its
    path, 1 + the cross levels taken (2..5); operands in DLOWP (exact fp32 for F32)."""
    tx = rx // RX
    ty = ry // RY
    g_base = g_ptr + blk * C * K
    s_g = levels.group_shift(_load_g(g_ptr, blk, ty, C, K, ck, mk, BKS, False), ty, g_base, K, ck, mk, LIMIT)
    acc = tl.zeros([SUB * RX, SUB * RY], dtype=tl.float32)
    for lvl in range(0, levels.level_count(s_g, STRICT)):
        ex = levels.level_row_exp(_load_g(xg_ptr, blk, tx, C, K, ck, mk, BKS, False), tx, lvl, s_g, g_base, K,
                                  ck, mk, STRICT)
        ey = levels.level_col_exp(_load_g(g_ptr, blk, ty, C, K, ck, mk, BKS, False), ty, lvl, s_g, g_base, K,
                                  ck, mk)
        xf = _load_tile(x_ptr, blk, rx, C * RX, K, ck, mk) * ex
        yf = _load_tile(y_ptr, blk, ry, C * RY, K, ck, mk) * ey
        acc += tl.where(levels.level_live(tx, ty, lvl, s_g, STRICT), _dot(xf, tl.trans(yf), F32, DLOWP), 0.0)
    return acc, 5 - s_g


@triton.jit
def _diag_product(x, X, Y, ref, y_ptr, blk, ry, live, K, ck, mk, C: tl.constexpr, RY: tl.constexpr,
                  F32: tl.constexpr, DLOWP: tl.constexpr):
    """A diagonal block's K tile as one product through its reference ref (:func:`_diag_reference`, whose
    bound the caller checked): (x e^{X-R}) (y e^{R-Y})^T masked after it, [16 RX, 16 RY]."""
    xf = x * tl.exp(X - ref[None, :])
    yf = _load_tile(y_ptr, blk, ry, C * RY, K, ck, mk) * tl.exp(ref[None, :] - Y)
    return tl.where(live, _dot(xf, tl.trans(yf), F32, DLOWP), 0.0)


@triton.jit
def _gram_rows(o_ptr, x_ptr, xg_ptr, y_ptr, g_ptr, defer_ptr, path_ptr, blk, n, K, C: tl.constexpr, RX: tl.constexpr,
               RY: tl.constexpr, STRICT, BKS: tl.constexpr, SCALAR: tl.constexpr,
               F32: tl.constexpr, LOWP: tl.constexpr, DLOWP: tl.constexpr, DIAG_LIMIT: tl.constexpr,
               GID: tl.constexpr, RECORD: tl.constexpr):
    """Row block n (16 tokens) of one Gram matrix ``o[t, i] = sum_k x_tk y_ik e^{X_tk - G_ik}`` for chunk
    tokens i < t (STRICT) or i <= t, else 0; x, y are stacks [blocks, C*RX, K], [blocks, C*RY, K], X the
    cumsum scratch of x's side (G or G'), o [blocks, C*RX, C*RY]. Column blocks m < n: one product through
    the reference R = G at block m's last token (e^{X - R} <= 1, e^{R - G} <= 1). The diagonal block per
    K tile: one product through the block's own reference (:func:`_diag_reference`, operands in DLOWP)
    masked after it, where its bound is below DIAG_LIMIT; if a tile's bound is not, the whole diagonal
    block is left to :func:`_gram_levels_kernel` (``defer [blocks, 4, C/16]`` int8, Gram GID: 1), which
    overwrites it; DIAG_LIMIT = 0: token by token (:func:`_gram_diag_loop`). A decay per head: the plain
    product times the exact decay matrix. RECORD: the path of each (block, K tile) into path_ptr
    [blocks, 4, C/16, K/BKS] (int32: 1 product, 0 token loop, -1 left to the levels kernel)."""
    NRX: tl.constexpr = SUB * RX
    NRY: tl.constexpr = SUB * RY
    rx = n * NRX + tl.arange(0, NRX)
    tx = rx // RX
    cy = tl.arange(0, NRY)
    o_rows = o_ptr + (blk * C * RX + rx)[:, None] * (C * RY)
    deferred = n * 0
    for m in range(0, C // SUB):
        ry = m * NRY + cy
        acc = tl.zeros([NRX, NRY], dtype=tl.float32)
        if m < n:
            for k0 in range(0, K, BKS):
                ck = k0 + tl.arange(0, BKS)
                mk = ck < K
                ref = _load_g_row(g_ptr, blk, m * SUB + SUB - 1, C, K, ck, mk, BKS, SCALAR)
                x = _load_tile(x_ptr, blk, rx, C * RX, K, ck, mk)
                x = x * tl.exp(_load_g(xg_ptr, blk, tx, C, K, ck, mk, BKS, SCALAR) - ref[None, :])
                y = _load_tile(y_ptr, blk, ry, C * RY, K, ck, mk)
                y = y * tl.exp(ref[None, :] - _load_g(g_ptr, blk, ry // RY, C, K, ck, mk, BKS, SCALAR))
                acc += _dot(x, tl.trans(y), F32, LOWP)
        elif m == n:
            live = _token_mask(tx, ry // RY, STRICT)
            rec = ((blk * 4 + GID) * (C // SUB) + n) * tl.cdiv(K, BKS)
            for k0 in range(0, K, BKS):
                ck = k0 + tl.arange(0, BKS)
                mk = ck < K
                x = _load_tile(x_ptr, blk, rx, C * RX, K, ck, mk)
                if SCALAR:
                    acc += _dot(x, tl.trans(_load_tile(y_ptr, blk, ry, C * RY, K, ck, mk)), F32, LOWP)
                    _record_path(path_ptr, rec + k0 // BKS, 1, RECORD)
                elif DIAG_LIMIT == 0:  # the token loop only (the reference the tests compare with)
                    X = _load_g(xg_ptr, blk, tx, C, K, ck, mk, BKS, False)
                    acc = _gram_diag_loop(acc, x, X, y_ptr, g_ptr, blk, m, tx, cy, K, ck, mk, C, RY, STRICT, BKS)
                    _record_path(path_ptr, rec + k0 // BKS, 0, RECORD)
                else:
                    X = _load_g(xg_ptr, blk, tx, C, K, ck, mk, BKS, False)
                    Y = _load_g(g_ptr, blk, ry // RY, C, K, ck, mk, BKS, False)
                    ref, lim = _diag_reference(X, Y)
                    if lim < DIAG_LIMIT:
                        acc += _diag_product(x, X, Y, ref, y_ptr, blk, ry, live, K, ck, mk, C, RY, F32, DLOWP)
                    fits = (lim < DIAG_LIMIT).to(tl.int32)
                    deferred = tl.maximum(deferred, 1 - fits)
                    _record_path(path_ptr, rec + k0 // BKS, 2 * fits - 1, RECORD)
            if SCALAR:
                Xs = tl.load(xg_ptr + blk * C + tx)
                Ys = tl.load(g_ptr + blk * C + ry // RY)
                acc = acc * tl.exp(tl.where(live, Xs[:, None] - Ys[None, :], float("-inf")))
        tl.store(o_rows + ry[None, :], acc.to(o_ptr.dtype.element_ty))
    if not SCALAR and DIAG_LIMIT > 0:
        tl.store(defer_ptr + (blk * 4 + GID) * (C // SUB) + n, deferred.to(tl.int8))


@triton.jit
def _gram_kernel(xq_ptr, kf_ptr, af_ptr, bf_ptr, gs_ptr, gps_ptr, mqk_ptr, mqa_ptr, lab_ptr, lkb_ptr, defer_ptr,
                 path_ptr, H, K, NT, C: tl.constexpr, BKS: tl.constexpr, RKP: tl.constexpr, RAB: tl.constexpr,
                 RAP: tl.constexpr, SCALAR: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr,
                 DLOWP: tl.constexpr, DIAG_LIMIT: tl.constexpr, RECORD: tl.constexpr, DIRS: tl.constexpr):
    """S2, grid (NT, B*H, C/16): row block n of M_QK [C, C*RKP], M_QA [C, C*RAP], L_AB [C*RAP, C*RAP]
    (strictly lower by token) and L_KB [C*RAP, C*RKP] (strictly lower), scratch in the dtypes of
    :func:`scratch_dtypes` (fp32 but M_QA, L_KB and, at r_ab = 0, M_QK for 16-bit inputs); Grams 0..3 of
    the path record and of ``defer``. DIRS = 2 (both directions, the reversed scan at batch-heads
    [B H, 2 B H)): the reversed scan's M_QK is strictly lower, without its own write (kernels/README.md §9)."""
    blk = tl.program_id(1).to(tl.int64) * NT + tl.program_id(0)
    n = tl.program_id(2)
    if DIRS == 2:  # (a constexpr STRICT must be passed as such: a local assigned False would be a runtime flag)
        _gram_rows(mqk_ptr, xq_ptr, gs_ptr, kf_ptr, gs_ptr, defer_ptr, path_ptr, blk, n, K, C, 1, RKP,
                   tl.program_id(1) >= tl.num_programs(1) // 2, BKS, SCALAR, F32, LOWP, DLOWP, DIAG_LIMIT, 0, RECORD)
    else:
        _gram_rows(mqk_ptr, xq_ptr, gs_ptr, kf_ptr, gs_ptr, defer_ptr, path_ptr, blk, n, K, C, 1, RKP, False, BKS,
                   SCALAR, F32, LOWP, DLOWP, DIAG_LIMIT, 0, RECORD)
    if RAB > 0:
        _gram_rows(mqa_ptr, xq_ptr, gs_ptr, af_ptr, gs_ptr, defer_ptr, path_ptr, blk, n, K, C, 1, RAP, False, BKS,
                   SCALAR, F32, LOWP, DLOWP, DIAG_LIMIT, 1, RECORD)
        _gram_rows(lab_ptr, bf_ptr, gps_ptr, af_ptr, gs_ptr, defer_ptr, path_ptr, blk, n, K, C, RAP, RAP, True, BKS,
                   SCALAR, F32, LOWP, DLOWP, DIAG_LIMIT, 2, RECORD)
        _gram_rows(lkb_ptr, bf_ptr, gps_ptr, kf_ptr, gs_ptr, defer_ptr, path_ptr, blk, n, K, C, RAP, RKP, True, BKS,
                   SCALAR, F32, LOWP, DLOWP, DIAG_LIMIT, 3, RECORD)


@triton.jit
def _gram_diag_block(o_ptr, x_ptr, xg_ptr, y_ptr, g_ptr, defer_ptr, path_ptr, blk, n, K, C: tl.constexpr,
                     RX: tl.constexpr, RY: tl.constexpr, STRICT, BKS: tl.constexpr, F32: tl.constexpr,
                     DLOWP: tl.constexpr, DIAG_LIMIT: tl.constexpr, GID: tl.constexpr, RECORD: tl.constexpr):
    """The diagonal block of row block n of Gram GID (:func:`_gram_rows`) if S2 left it here: every K tile
    again, one product where its bound allows, else by levels (:func:`_gram_diag_levels`), stored over
    S2's partial block; RECORD: each K tile's path (1, or 2..5 the levels)."""
    if tl.load(defer_ptr + (blk * 4 + GID) * (C // SUB) + n) != 0:
        rx = n * SUB * RX + tl.arange(0, SUB * RX)
        ry = n * SUB * RY + tl.arange(0, SUB * RY)
        tx = rx // RX
        live = _token_mask(tx, ry // RY, STRICT)
        rec = ((blk * 4 + GID) * (C // SUB) + n) * tl.cdiv(K, BKS)
        acc = tl.zeros([SUB * RX, SUB * RY], dtype=tl.float32)
        for k0 in range(0, K, BKS):
            ck = k0 + tl.arange(0, BKS)
            mk = ck < K
            x = _load_tile(x_ptr, blk, rx, C * RX, K, ck, mk)
            X = _load_g(xg_ptr, blk, tx, C, K, ck, mk, BKS, False)
            Y = _load_g(g_ptr, blk, ry // RY, C, K, ck, mk, BKS, False)
            ref, lim = _diag_reference(X, Y)
            if lim < DIAG_LIMIT:
                acc += _diag_product(x, X, Y, ref, y_ptr, blk, ry, live, K, ck, mk, C, RY, F32, DLOWP)
                path = lim.to(tl.int32) * 0 + 1
            else:
                tile, path = _gram_diag_levels(x_ptr, xg_ptr, y_ptr, g_ptr, blk, rx, ry, K, ck, mk, C, RX, RY,
                                               STRICT, BKS, F32, DLOWP, DIAG_LIMIT)
                acc += tile
            _record_path(path_ptr, rec + k0 // BKS, path, RECORD)
        tl.store(o_ptr + (blk * C * RX + rx)[:, None] * (C * RY) + ry[None, :], acc.to(o_ptr.dtype.element_ty))


@triton.jit
def _gram_levels_kernel(xq_ptr, kf_ptr, af_ptr, bf_ptr, gs_ptr, gps_ptr, mqk_ptr, mqa_ptr, lab_ptr, lkb_ptr,
                        defer_ptr, path_ptr, bt_ptr, s_ptr, g_ptr, T, H, K, NT, sgd, C: tl.constexpr,
                        BKS: tl.constexpr, RKP: tl.constexpr, RAB: tl.constexpr, RAP: tl.constexpr,
                        F32: tl.constexpr, DLOWP: tl.constexpr, DIAG_LIMIT: tl.constexpr, RECORD: tl.constexpr,
                        DIRS: tl.constexpr, HDLA_AB: tl.constexpr = False, REVERSE: tl.constexpr = False,
                        LOG_ZERO: tl.constexpr = 0.0):
    """S2b (vector decay), grid (NT, B*H, C/16), after S2: the diagonal blocks that S2 left (a K tile whose
    single product could overflow), by :func:`_gram_diag_block`; a program whose blocks all fit exits
    after reading their flags. Its own launch keeps S2's registers as they were without the levels.
    DIRS = 2: S2's rule, the reversed scan's M_QK (batch-heads [B H, 2 B H)) strictly lower. HDLA_AB: S1 left
    HDLA's A, B stacks out; a block that M_QA, L_AB or L_KB left here first gets its rows (:func:`_hdla_ab_rows`:
    bt, s, the input g and its direction stride sgd, T, H, REVERSE)."""
    blk = tl.program_id(1).to(tl.int64) * NT + tl.program_id(0)
    n = tl.program_id(2)
    if HDLA_AB:
        flags = tl.load(defer_ptr + (blk * 4 + 1 + tl.arange(0, 4) % 3) * (C // SUB) + n)  # Grams 1..3
        if tl.max(flags, 0) != 0:
            _hdla_ab_rows(kf_ptr, bt_ptr, s_ptr, g_ptr, af_ptr, bf_ptr, blk, tl.program_id(0), n, T, H, K, sgd, C, BKS,
                          REVERSE, LOG_ZERO, DIRS)
            tl.debug_barrier()  # the rows are read back by other threads of this program
    if DIRS == 2:  # (as in _gram_kernel: a constexpr STRICT is passed as such)
        _gram_diag_block(mqk_ptr, xq_ptr, gs_ptr, kf_ptr, gs_ptr, defer_ptr, path_ptr, blk, n, K, C, 1, RKP,
                         tl.program_id(1) >= tl.num_programs(1) // 2, BKS, F32, DLOWP, DIAG_LIMIT, 0, RECORD)
    else:
        _gram_diag_block(mqk_ptr, xq_ptr, gs_ptr, kf_ptr, gs_ptr, defer_ptr, path_ptr, blk, n, K, C, 1, RKP, False,
                         BKS, F32, DLOWP, DIAG_LIMIT, 0, RECORD)
    if RAB > 0:
        _gram_diag_block(mqa_ptr, xq_ptr, gs_ptr, af_ptr, gs_ptr, defer_ptr, path_ptr, blk, n, K, C, 1, RAP, False,
                         BKS, F32, DLOWP, DIAG_LIMIT, 1, RECORD)
        _gram_diag_block(lab_ptr, bf_ptr, gps_ptr, af_ptr, gs_ptr, defer_ptr, path_ptr, blk, n, K, C, RAP, RAP, True,
                         BKS, F32, DLOWP, DIAG_LIMIT, 2, RECORD)
        _gram_diag_block(lkb_ptr, bf_ptr, gps_ptr, kf_ptr, gs_ptr, defer_ptr, path_ptr, blk, n, K, C, RAP, RKP, True,
                         BKS, F32, DLOWP, DIAG_LIMIT, 3, RECORD)


# ----------------------------------------------------------------------------- S2 for HDLA: one Gram product
@triton.jit
def _hdla_base_products(xq_ptr, kf_ptr, gs_ptr, gps_ptr, blk, rows, cols, ref, K, ck, mk, C: tl.constexpr,
                        F32: tl.constexpr, LOWP: tl.constexpr, BKS: tl.constexpr):
    """One K tile of HDLA's six base Grams (kernels/README.md §8) between row tokens ``rows``
    and column tokens ``cols`` [16] of a chunk, factored through ``ref`` [BKS] (both factors <= 1 off the
    diagonal, <= e^DIAG_LIMIT on it): the row stacks q e^{G-R}, k e^{G'-R}, k e^{G-R} against the column
    stacks k e^{R-G}, k e^{R-G'}. Returns qg, qp, pg, pp, gg, gp [16, 16] (fp32 accumulators, unmasked)."""
    Gr = _load_g(gs_ptr, blk, rows, C, K, ck, mk, BKS, False)
    kr = _load_tile(kf_ptr, blk, rows, C, K, ck, mk)
    xq = _load_tile(xq_ptr, blk, rows, C, K, ck, mk) * tl.exp(Gr - ref[None, :])
    kg = kr * tl.exp(Gr - ref[None, :])
    kp = kr * tl.exp(_load_g(gps_ptr, blk, rows, C, K, ck, mk, BKS, False) - ref[None, :])
    kc = _load_tile(kf_ptr, blk, cols, C, K, ck, mk)
    cg = tl.trans(kc * tl.exp(ref[None, :] - _load_g(gs_ptr, blk, cols, C, K, ck, mk, BKS, False)))
    cp = tl.trans(kc * tl.exp(ref[None, :] - _load_g(gps_ptr, blk, cols, C, K, ck, mk, BKS, False)))
    return (_dot(xq, cg, F32, LOWP), _dot(xq, cp, F32, LOWP), _dot(kp, cg, F32, LOWP), _dot(kp, cp, F32, LOWP),
            _dot(kg, cg, F32, LOWP), _dot(kg, cp, F32, LOWP))


@triton.jit
def _hdla_mix_store(mqk_ptr, mqa_ptr, lab_ptr, lkb_ptr, blk, rows, m, qk, qg, qp, pg, pp, gg, gp, beta_t,
                    c_t, beta_i, C: tl.constexpr):
    """Store the 16 x 16 token block (rows, column block m) of M_QK [C, C], M_QA [C, 2C], L_AB [2C, 2C] and
    L_KB [2C, C] (rank fastest) mixed from the base Grams (kernels/README.md §8; float64:
    tests/hdla_single_gram_reference.py's ``mix``): with b = beta, c_t = beta_t^2 s_t, M_QK = qk (qg, masked
    as M_QK is), M_QA = (qp b_i, qg), L_AB = ((pp b_i, pg), ((b_t gp - c_t pp) b_i, b_t gg - c_t pg)),
    L_KB = (pg, b_t gg - c_t pg); column ranks interleaved."""
    bi = beta_i[None, :]
    l1 = beta_t[:, None] * gg - c_t[:, None] * pg
    l10 = (beta_t[:, None] * gp - c_t[:, None] * pp) * bi
    cols = m * SUB + tl.arange(0, SUB)
    pair = m * 2 * SUB + tl.arange(0, 2 * SUB)  # the interleaved column ranks of tokens cols
    row2 = blk * 2 * C + 2 * rows  # rank-0 rows of the row tokens in L_AB, L_KB
    tl.store(mqk_ptr + (blk * C + rows)[:, None] * C + cols[None, :], qk.to(mqk_ptr.dtype.element_ty))
    tl.store(mqa_ptr + (blk * C + rows)[:, None] * (2 * C) + pair[None, :],
             tl.interleave(qp * bi, qg).to(mqa_ptr.dtype.element_ty))
    tl.store(lab_ptr + row2[:, None] * (2 * C) + pair[None, :],
             tl.interleave(pp * bi, pg).to(lab_ptr.dtype.element_ty))
    tl.store(lab_ptr + (row2 + 1)[:, None] * (2 * C) + pair[None, :],
             tl.interleave(l10, l1).to(lab_ptr.dtype.element_ty))
    tl.store(lkb_ptr + row2[:, None] * C + cols[None, :], pg.to(lkb_ptr.dtype.element_ty))
    tl.store(lkb_ptr + (row2 + 1)[:, None] * C + cols[None, :], l1.to(lkb_ptr.dtype.element_ty))


@triton.jit
def _hdla_gram_kernel(xq_ptr, kf_ptr, gs_ptr, gps_ptr, s_ptr, bt_ptr, mqk_ptr, mqa_ptr, lab_ptr, lkb_ptr, defer_ptr,
                      path_ptr, K, NT, C: tl.constexpr, BKS: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr,
                      DLOWP: tl.constexpr, DIAG_LIMIT: tl.constexpr, RECORD: tl.constexpr, DIRS: tl.constexpr):
    """S2 for HDLA (rank 2, r_kv = 1), grid (NT, B*H, C/16): row block n of the four Grams of
    :func:`_gram_kernel`, the same scratch and the same defer flags, from six base Grams of k and q
    (kernels/README.md §8; 6 C^2 K multiply-adds per chunk instead of 9 C^2 K, and only the q, k stacks
    read). Column blocks m < n through G at block m's last token; the diagonal block per K tile through the
    midpoint of its G and G' (one reference for the six products, :func:`_diag_reference`) where that bound
    is below DIAG_LIMIT (> 0), else the block of all four Grams is left to :func:`_gram_levels_kernel`
    (their defer flags, path -1). DIRS = 2: the reversed scan's M_QK strictly lower (kernels/README.md §9)."""
    blk = tl.program_id(1).to(tl.int64) * NT + tl.program_id(0)
    n = tl.program_id(2)
    qk_strict = (tl.program_id(1) >= tl.num_programs(1) // 2) & (DIRS == 2)
    rows = n * SUB + tl.arange(0, SUB)
    beta_t = tl.load(bt_ptr + blk * C + rows)
    c_t = beta_t * beta_t * tl.load(s_ptr + blk * C + rows)
    rec = (blk * 4 * (C // SUB) + n) * tl.cdiv(K, BKS)
    deferred = n * 0
    for m in range(0, C // SUB):
        cols = m * SUB + tl.arange(0, SUB)
        qg = tl.zeros([SUB, SUB], dtype=tl.float32)
        qp = tl.zeros([SUB, SUB], dtype=tl.float32)
        pg = tl.zeros([SUB, SUB], dtype=tl.float32)
        pp = tl.zeros([SUB, SUB], dtype=tl.float32)
        gg = tl.zeros([SUB, SUB], dtype=tl.float32)
        gp = tl.zeros([SUB, SUB], dtype=tl.float32)
        if m < n:
            for k0 in range(0, K, BKS):
                ck = k0 + tl.arange(0, BKS)
                mk = ck < K
                ref = _load_g_row(gs_ptr, blk, m * SUB + SUB - 1, C, K, ck, mk, BKS, False)
                dqg, dqp, dpg, dpp, dgg, dgp = _hdla_base_products(xq_ptr, kf_ptr, gs_ptr, gps_ptr, blk, rows, cols,
                                                                   ref, K, ck, mk, C, F32, LOWP, BKS)
                qg += dqg
                qp += dqp
                pg += dpg
                pp += dpp
                gg += dgg
                gp += dgp
        elif m == n:
            for k0 in range(0, K, BKS):
                ck = k0 + tl.arange(0, BKS)
                mk = ck < K
                ref, lim = _diag_reference(_load_g(gps_ptr, blk, rows, C, K, ck, mk, BKS, False),
                                           _load_g(gs_ptr, blk, rows, C, K, ck, mk, BKS, False))
                if lim < DIAG_LIMIT:
                    dqg, dqp, dpg, dpp, dgg, dgp = _hdla_base_products(xq_ptr, kf_ptr, gs_ptr, gps_ptr, blk, rows,
                                                                       cols, ref, K, ck, mk, C, F32, DLOWP, BKS)
                    qg += dqg
                    qp += dqp
                    pg += dpg
                    pp += dpp
                    gg += dgg
                    gp += dgp
                fits = (lim < DIAG_LIMIT).to(tl.int32)
                deferred = tl.maximum(deferred, 1 - fits)
                for gid in tl.static_range(4):
                    _record_path(path_ptr, rec + gid * (C // SUB) * tl.cdiv(K, BKS) + k0 // BKS, 2 * fits - 1, RECORD)
            live = _token_mask(rows, cols, False)
            strict = _token_mask(rows, cols, True)
            qg = tl.where(live, qg, 0.0)
            qp = tl.where(live, qp, 0.0)
            pg = tl.where(strict, pg, 0.0)
            pp = tl.where(strict, pp, 0.0)
            gg = tl.where(strict, gg, 0.0)
            gp = tl.where(strict, gp, 0.0)
        qk = tl.where(_token_mask(rows, cols, qk_strict), qg, 0.0)
        _hdla_mix_store(mqk_ptr, mqa_ptr, lab_ptr, lkb_ptr, blk, rows, m, qk, qg, qp, pg, pp, gg, gp, beta_t, c_t,
                        tl.load(bt_ptr + blk * C + cols), C)
    for gid in tl.static_range(4):
        tl.store(defer_ptr + (blk * 4 + gid) * (C // SUB) + n, deferred.to(tl.int8))


# ----------------------------------------------------------------------------- S3: T = (I + L_AB)^-1
@triton.jit
def _unit_lower_inverse16(d, RP: tl.constexpr):
    """``(I + d)^-1`` for d [16 RP, 16 RP] strictly lower by token: the inverse of 2-token groups is
    I - d, and each doubling of the groups is P - P X P (P the inverse so far, X the entries between
    the two halves of each new group). fp32 (ieee)."""
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


@triton.jit
def _inverse_kernel(lab_ptr, t_ptr, t16_ptr, NT, C: tl.constexpr, RAP: tl.constexpr, F32: tl.constexpr,
                    T16: tl.constexpr):
    """S3, grid (NT, B*H): T [blocks, C*RAP, C*RAP] (zero above the diagonal blocks). Row block n's
    off-diagonal blocks read the earlier rows of T back from scratch (a barrier after each row). T16:
    then T, read back once more (this program's own writes), into t16 (S4's 16-bit copy); a copy at
    the end, not beside each store, keeps the rows' registers as they were."""
    blk = tl.program_id(1).to(tl.int64) * NT + tl.program_id(0)
    NR: tl.constexpr = SUB * RAP
    RA: tl.constexpr = C * RAP
    r = tl.arange(0, NR)
    base = blk * RA * RA
    for n in tl.static_range(C // SUB):
        rn = n * NR + r
        tnn = _unit_lower_inverse16(tl.load(lab_ptr + base + rn[:, None] * RA + rn[None, :]), RAP)
        tl.store(t_ptr + base + rn[:, None] * RA + rn[None, :], tnn)
        for m in tl.static_range(C // SUB):
            rm = m * NR + r
            if m < n:
                acc = tl.zeros([NR, NR], dtype=tl.float32)
                for kk in tl.static_range(m, n):
                    rk = kk * NR + r
                    lnk = tl.load(lab_ptr + base + rn[:, None] * RA + rk[None, :])
                    tkm = tl.load(t_ptr + base + rk[:, None] * RA + rm[None, :])
                    acc += _dot(lnk, tkm, F32, 0)
                tl.store(t_ptr + base + rn[:, None] * RA + rm[None, :], -_dot(tnn, acc, F32, 0))
            elif m > n:
                tl.store(t_ptr + base + rn[:, None] * RA + rm[None, :], tl.zeros([NR, NR], dtype=tl.float32))
        tl.debug_barrier()
    if T16:
        cols = tl.arange(0, RA)
        for n in tl.static_range(C // SUB):
            rn = n * NR + r
            off = base + rn[:, None] * RA + cols[None, :]
            tl.store(t16_ptr + off, tl.load(t_ptr + off).to(t16_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------- S4: plain products
@triton.jit
def _gemm_part(a_ptr, sar, sac, b_ptr, sbr, sbc, rm, rn, mm, mn, KD, BKD: tl.constexpr, F32: tl.constexpr,
               LOWP: tl.constexpr):
    """sum_k a[rm, k] b[k, rn] over k < KD (strided operands, fp32 or 16-bit, masked): [BM, BN] fp32."""
    acc = tl.zeros([rm.shape[0], rn.shape[0]], dtype=tl.float32)
    for k0 in range(0, KD, BKD):
        ck = k0 + tl.arange(0, BKD)
        mk = ck < KD
        a = tl.load(a_ptr + rm[:, None] * sar + ck[None, :] * sac, mask=mm[:, None] & mk[None, :], other=0.0)
        b = tl.load(b_ptr + ck[:, None] * sbr + rn[None, :] * sbc, mask=mk[:, None] & mn[None, :], other=0.0)
        acc += _dot(a, b, F32, LOWP)  # 16-bit inputs: _dot casts (a no-op on 16-bit scratch)
    return acc


# The bits of an S4 product's FLAGS (constexpr): operand a1, b1, a2, b2 transposed (a stride swap of its
# row-major tile), term 1, 2 negated, an addend c, the causal mask (column token <= row token)
TA1, TB1, TA2, TB2, NEG1, NEG2, HAS_C, MASK = (tl.constexpr(1 << i) for i in range(8))
S4_SLOTS = 4  # products per launch at most (_gemm_group_kernel's slots)


@triton.jit
def _term(a_ptr, b_ptr, blk, rm, rn, mm, mn, M: tl.constexpr, N: tl.constexpr, KD: tl.constexpr,
          TA: tl.constexpr, TB: tl.constexpr, BKD: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr):
    """a b of chunk blk, a [M, KD] and b [KD, N] row-major per chunk or (TA, TB) the transposes of row-major
    [KD, M], [N, KD] tiles: :func:`_gemm_part` with the strides as constexprs (a unit stride known to the compiler,
    so that the loads are vectorised)."""
    return _gemm_part(a_ptr + blk * (M * KD), 1 if TA else KD, M if TA else 1,
                      b_ptr + blk * (KD * N), 1 if TB else N, KD if TB else 1, rm, rn, mm, mn, KD, BKD, F32, LOWP)


@triton.jit
def _product_tile(o_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, c_ptr, blk, tile, M: tl.constexpr, N: tl.constexpr,
                  K1: tl.constexpr, K2: tl.constexpr, FLAGS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK1: tl.constexpr, BK2: tl.constexpr, RPC: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr):
    """Output tile ``tile`` ([BM, BN], row-major over the product's tiles) of chunk blk of one product:
    o = +-a1 b1 (+- a2 b2 if K2 > 0) (+ c), masked to column token <= row token (RPC rank rows per column token,
    one per row token); o and c dense [blocks, M, N]. FLAGS: the bits TA1 ... MASK."""
    rm = (tile // tl.cdiv(N, BN)) * BM + tl.arange(0, BM)
    rn = (tile % tl.cdiv(N, BN)) * BN + tl.arange(0, BN)
    mm = rm < M
    mn = rn < N
    acc = _term(a1_ptr, b1_ptr, blk, rm, rn, mm, mn, M, N, K1, (TA1 & FLAGS) != 0, (TB1 & FLAGS) != 0, BK1, F32, LOWP)
    if NEG1 & FLAGS:
        acc = -acc
    if K2 > 0:
        acc2 = _term(a2_ptr, b2_ptr, blk, rm, rn, mm, mn, M, N, K2, (TA2 & FLAGS) != 0, (TB2 & FLAGS) != 0, BK2, F32,
                     LOWP)
        if NEG2 & FLAGS:
            acc -= acc2
        else:
            acc += acc2
    off = blk * (M * N) + rm[:, None] * N + rn[None, :]
    m2 = mm[:, None] & mn[None, :]
    if HAS_C & FLAGS:
        acc += tl.load(c_ptr + off, mask=m2, other=0.0)
    if MASK & FLAGS:
        acc = tl.where((rn // RPC)[None, :] <= rm[:, None], acc, 0.0)
    tl.store(o_ptr + off, acc.to(o_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _gemm_group_kernel(o0, a10, b10, a20, b20, c0, o1, a11, b11, a21, b21, c1,
                       o2, a12, b12, a22, b22, c2, o3, a13, b13, a23, b23, c3,
                       M0: tl.constexpr, N0: tl.constexpr, K10: tl.constexpr, K20: tl.constexpr, FLAGS0: tl.constexpr,
                       BM0: tl.constexpr, BN0: tl.constexpr, BKA0: tl.constexpr, BKB0: tl.constexpr,
                       M1: tl.constexpr, N1: tl.constexpr, K11: tl.constexpr, K21: tl.constexpr, FLAGS1: tl.constexpr,
                       BM1: tl.constexpr, BN1: tl.constexpr, BKA1: tl.constexpr, BKB1: tl.constexpr,
                       M2: tl.constexpr, N2: tl.constexpr, K12: tl.constexpr, K22: tl.constexpr, FLAGS2: tl.constexpr,
                       BM2: tl.constexpr, BN2: tl.constexpr, BKA2: tl.constexpr, BKB2: tl.constexpr,
                       M3: tl.constexpr, N3: tl.constexpr, K13: tl.constexpr, K23: tl.constexpr, FLAGS3: tl.constexpr,
                       BM3: tl.constexpr, BN3: tl.constexpr, BKA3: tl.constexpr, BKB3: tl.constexpr,
                       SLOTS: tl.constexpr, RPC: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr):
    """S4, grid (blocks, tiles of every product): up to four independent products in one launch (SLOTS), product
    s owning the tiles after those of the products before it (:func:`_product_tile` with its sizes M_s, N_s, K1_s,
    K2_s, FLAGS_s and tiles BM_s, BN_s, BKA_s, BKB_s). One launch instead of one per product: the VJP's 18 products
    run in 6 launches (:data:`S4_LAUNCHES`)."""
    blk = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    E0: tl.constexpr = tl.cdiv(M0, BM0) * tl.cdiv(N0, BN0)  # the end of product 0's tiles, ...
    E1: tl.constexpr = E0 + tl.cdiv(M1, BM1) * tl.cdiv(N1, BN1)
    E2: tl.constexpr = E1 + tl.cdiv(M2, BM2) * tl.cdiv(N2, BN2)
    if tile < E0:
        _product_tile(o0, a10, b10, a20, b20, c0, blk, tile, M0, N0, K10, K20, FLAGS0, BM0, BN0, BKA0, BKB0, RPC, F32,
                      LOWP)
    if SLOTS > 1:
        if (tile >= E0) & (tile < E1):
            _product_tile(o1, a11, b11, a21, b21, c1, blk, tile - E0, M1, N1, K11, K21, FLAGS1, BM1, BN1, BKA1, BKB1,
                          RPC, F32, LOWP)
    if SLOTS > 2:
        if (tile >= E1) & (tile < E2):
            _product_tile(o2, a12, b12, a22, b22, c2, blk, tile - E1, M2, N2, K12, K22, FLAGS2, BM2, BN2, BKA2, BKB2,
                          RPC, F32, LOWP)
    if SLOTS > 3:
        if tile >= E2:
            _product_tile(o3, a13, b13, a23, b23, c3, blk, tile - E2, M3, N3, K13, K23, FLAGS3, BM3, BN3, BKA3, BKB3,
                          RPC, F32, LOWP)


# ----------------------------------------------------------------------------- S5: Gram VJP, decays, dg
@triton.jit
def _gram_vjp_diag_loop(dx, dy, d_base, x_ptr, xg_ptr, y_ptr, g_ptr, blk, b, txb, tyb, Xb, Yb, K, ck, mk,
                        C: tl.constexpr, RX: tl.constexpr, RY: tl.constexpr, STRICT,
                        BKS: tl.constexpr):
    """The diagonal block's share of :func:`_gram_vjp` token by token (the fallback where the factors
    could overflow): token tj as the column (dx) and as the row (dy), exact pairwise decays masked
    before exp."""
    NRX: tl.constexpr = SUB * RX
    NRY: tl.constexpr = SUB * RY
    RXT: tl.constexpr = C * RX
    RYT: tl.constexpr = C * RY
    rxb = b * NRX + tl.arange(0, NRX)
    ryb = b * NRY + tl.arange(0, NRY)
    for j in range(SUB):
        tj = b * SUB + j
        Yj = _load_g_row(g_ptr, blk, tj, C, K, ck, mk, BKS, False)
        Xj = _load_g_row(xg_ptr, blk, tj, C, K, ck, mk, BKS, False)
        live_x = later(txb, tj, STRICT)
        live_y = earlier(tyb, tj, STRICT)
        ex = tl.exp(tl.where(live_x[:, None], Xb - Yj[None, :], float("-inf")))
        ey = tl.exp(tl.where(live_y[:, None], Xj[None, :] - Yb, float("-inf")))
        for l in tl.static_range(RY):
            dcol = tl.load(d_base + rxb * RYT + b * NRY + j * RY + l)
            yl = tl.load(y_ptr + (blk * RYT + b * NRY + j * RY + l) * K + ck, mask=mk, other=0.0)
            dx += dcol[:, None] * ex * yl[None, :]
        for l in tl.static_range(RX):
            drow = tl.load(d_base + (b * NRX + j * RX + l) * RYT + ryb)
            xl = tl.load(x_ptr + (blk * RXT + b * NRX + j * RX + l) * K + ck, mask=mk, other=0.0)
            dy += drow[:, None] * ey * xl[None, :]
    return dx, dy


@triton.jit
def _gram_vjp_diag_levels(dx, dy, d_ptr, x_ptr, xg_ptr, y_ptr, g_ptr, blk, b, K, ck, mk, C: tl.constexpr,
                          RX: tl.constexpr, RY: tl.constexpr, STRICT, BKS: tl.constexpr, F32: tl.constexpr,
                          DLOWP: tl.constexpr, LIMIT: tl.constexpr):
    """The diagonal block's share of :func:`_gram_vjp` by levels (:func:`_gram_diag_levels`): per level
    its cotangent D [16 RX, 16 RY] masked to the level's pairs, then dx += (D (y e^{R-Y})) e^{X-R},
    dy += (D^T (x e^{X-R})) e^{R-Y} (cross levels: factors <= 1; the group level: within [e^-LIMIT,
    e^LIMIT]), every tile loaded afresh per level. Returns (dx, dy, path 2..5)."""
    rxb = b * SUB * RX + tl.arange(0, SUB * RX)
    ryb = b * SUB * RY + tl.arange(0, SUB * RY)
    txb = rxb // RX
    tyb = ryb // RY
    g_base = g_ptr + blk * C * K
    d_base = d_ptr + blk * (C * RX) * (C * RY)
    s_g = levels.group_shift(_load_g(g_ptr, blk, tyb, C, K, ck, mk, BKS, False), tyb, g_base, K, ck, mk, LIMIT)
    for lvl in range(0, levels.level_count(s_g, STRICT)):
        ex = levels.level_row_exp(_load_g(xg_ptr, blk, txb, C, K, ck, mk, BKS, False), txb, lvl, s_g, g_base, K,
                                  ck, mk, STRICT)
        ey = levels.level_col_exp(_load_g(g_ptr, blk, tyb, C, K, ck, mk, BKS, False), tyb, lvl, s_g, g_base, K,
                                  ck, mk)
        dl = tl.load(d_base + rxb[:, None] * (C * RY) + ryb[None, :],
                     mask=levels.level_live(txb, tyb, lvl, s_g, STRICT), other=0.0)
        dx += _dot(dl, _load_tile(y_ptr, blk, ryb, C * RY, K, ck, mk) * ey, F32, DLOWP) * ex
        dy += _dot(tl.trans(dl), _load_tile(x_ptr, blk, rxb, C * RX, K, ck, mk) * ex, F32, DLOWP) * ey
    return dx, dy, 5 - s_g


@triton.jit
def _gram_vjp(d_ptr, x_ptr, xg_ptr, y_ptr, g_ptr, blk, b, K, ck, mk, C: tl.constexpr, RX: tl.constexpr,
              RY: tl.constexpr, STRICT, BKS: tl.constexpr, SCALAR: tl.constexpr, F32: tl.constexpr,
              LOWP: tl.constexpr, DLOWP: tl.constexpr, DIAG_LIMIT: tl.constexpr):
    """Token block b's share of the VJP of one Gram matrix (:func:`_gram_rows`) for its cotangent D
    [blocks, C*RX, C*RY] (entries outside the mask are ignored): (dx [16 RX, BKS] on x's rows of block b,
    dy [16 RY, BKS] on y's rows of block b, the gradients of x and y before the decay's chain rule;
    1 if the diagonal block took a product, 0 if the token loop, -1 if it is left to S5b). The diagonal
    block as in :func:`_gram_rows`: with D masked first, dx = (D (y e^{R-Y})) e^{X-R},
    dy = (D^T (x e^{X-R})) e^{R-Y} where the bound is below DIAG_LIMIT, else nothing here (S5b adds its
    share by levels, :func:`_gram_vjp_levels_kernel`); DIAG_LIMIT = 0: token by token; a decay per head:
    D times the exact decay matrix, then plain products."""
    NRX: tl.constexpr = SUB * RX
    NRY: tl.constexpr = SUB * RY
    RXT: tl.constexpr = C * RX
    RYT: tl.constexpr = C * RY
    cx = tl.arange(0, NRX)
    cy = tl.arange(0, NRY)
    rxb = b * NRX + cx
    ryb = b * NRY + cy
    txb = rxb // RX
    tyb = ryb // RY
    Xb = _load_g(xg_ptr, blk, txb, C, K, ck, mk, BKS, SCALAR)
    Yb = _load_g(g_ptr, blk, tyb, C, K, ck, mk, BKS, SCALAR)
    d_base = d_ptr + blk * RXT * RYT
    dx = tl.zeros([NRX, BKS], dtype=tl.float32)
    dy = tl.zeros([NRY, BKS], dtype=tl.float32)
    for m in range(0, b):  # earlier column blocks, reference at block m's last token
        rym = m * NRY + cy
        ref = _load_g_row(g_ptr, blk, m * SUB + SUB - 1, C, K, ck, mk, BKS, SCALAR)
        ye = _load_tile(y_ptr, blk, rym, RYT, K, ck, mk)
        ye = ye * tl.exp(ref[None, :] - _load_g(g_ptr, blk, rym // RY, C, K, ck, mk, BKS, SCALAR))
        dbm = tl.load(d_base + rxb[:, None] * RYT + rym[None, :])
        dx += _dot(dbm, ye, F32, LOWP) * tl.exp(Xb - ref[None, :])
    ref_b = _load_g_row(g_ptr, blk, b * SUB + SUB - 1, C, K, ck, mk, BKS, SCALAR)
    for n in range(b + 1, C // SUB):  # later row blocks, reference at block b's last token
        rxn = n * NRX + cx
        xe = _load_tile(x_ptr, blk, rxn, RXT, K, ck, mk)
        xe = xe * tl.exp(_load_g(xg_ptr, blk, rxn // RX, C, K, ck, mk, BKS, SCALAR) - ref_b[None, :])
        dnb = tl.load(d_base + rxn[:, None] * RYT + ryb[None, :])
        dy += _dot(tl.trans(dnb), xe, F32, LOWP)
    dy = dy * tl.exp(ref_b[None, :] - Yb)
    live = _token_mask(txb, tyb, STRICT)
    if SCALAR:
        Xs = tl.load(xg_ptr + blk * C + txb)
        Ys = tl.load(g_ptr + blk * C + tyb)
        dbb = tl.load(d_base + rxb[:, None] * RYT + ryb[None, :])
        dbb = tl.where(live, dbb * tl.exp(tl.where(live, Xs[:, None] - Ys[None, :], float("-inf"))), 0.0)
        dx += _dot(dbb, _load_tile(y_ptr, blk, ryb, RYT, K, ck, mk), F32, LOWP)
        dy += _dot(tl.trans(dbb), _load_tile(x_ptr, blk, rxb, RXT, K, ck, mk), F32, LOWP)
        product = 1
    elif DIAG_LIMIT == 0:  # the token loop only (the reference the tests compare with)
        dx, dy = _gram_vjp_diag_loop(dx, dy, d_base, x_ptr, xg_ptr, y_ptr, g_ptr, blk, b, txb, tyb, Xb, Yb, K,
                                     ck, mk, C, RX, RY, STRICT, BKS)
        product = 0
    else:
        ref, lim = _diag_reference(Xb, Yb)
        if lim < DIAG_LIMIT:
            dbb = tl.where(live, tl.load(d_base + rxb[:, None] * RYT + ryb[None, :]), 0.0)
            ex = tl.exp(Xb - ref[None, :])
            ey = tl.exp(ref[None, :] - Yb)
            dx += _dot(dbb, _load_tile(y_ptr, blk, ryb, RYT, K, ck, mk) * ey, F32, DLOWP) * ex
            dy += _dot(tl.trans(dbb), _load_tile(x_ptr, blk, rxb, RXT, K, ck, mk) * ex, F32, DLOWP) * ey
        product = (lim < DIAG_LIMIT).to(tl.int32) * 2 - 1
    return dx, dy, product


@triton.jit
def _gram_vjp_kernel(d_ptr, x_ptr, xg_ptr, y_ptr, g_ptr, dx_ptr, dy_ptr, defer_ptr, path_ptr, K, NT, NKT,
                     C: tl.constexpr, RX: tl.constexpr, RY: tl.constexpr, STRICT: tl.constexpr, BKS: tl.constexpr,
                     SCALAR: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr, DLOWP: tl.constexpr,
                     DIAG_LIMIT: tl.constexpr, RECORD: tl.constexpr, BIDIR_QK: tl.constexpr,
                     ACC_X: tl.constexpr, ACC_Y: tl.constexpr):
    """S5a, grid (NT, B*H, C/16 * K/BKS), one launch per Gram matrix: token block b's dx, dy of
    :func:`_gram_vjp` stored in dx [blocks, C*RX, K], dy [blocks, C*RY, K] (fp32), or added to what an
    earlier launch stored there (ACC_X, ACC_Y: the stacks' gradient buffers are shared by the Grams that
    read the same stack, :data:`GRAM_VJPS`; each program owns its tile, so no atomics); vector decay with
    DIAG_LIMIT > 0: 1 in ``defer [blocks, C/16, K/BKS]`` (int8) where the diagonal share is left to S5b,
    else 0; RECORD: the diagonal block's path into path_ptr [blocks, C/16, K/BKS] (int32). BIDIR_QK: M_QK
    of both directions, strictly lower for the reversed scan's programs (batch-heads [B H, 2 B H): S2's
    rule)."""
    blk = tl.program_id(1).to(tl.int64) * NT + tl.program_id(0)
    b = tl.program_id(2) // NKT
    ck = (tl.program_id(2) % NKT) * BKS + tl.arange(0, BKS)
    mk = ck < K
    if BIDIR_QK:
        dx, dy, product = _gram_vjp(d_ptr, x_ptr, xg_ptr, y_ptr, g_ptr, blk, b, K, ck, mk, C, RX, RY,
                                    tl.program_id(1) >= tl.num_programs(1) // 2, BKS, SCALAR, F32, LOWP, DLOWP,
                                    DIAG_LIMIT)
    else:
        dx, dy, product = _gram_vjp(d_ptr, x_ptr, xg_ptr, y_ptr, g_ptr, blk, b, K, ck, mk, C, RX, RY, STRICT, BKS,
                                    SCALAR, F32, LOWP, DLOWP, DIAG_LIMIT)
    item = blk * (C // SUB) * NKT + tl.program_id(2)
    _record_path(path_ptr, item, product, RECORD)
    if not SCALAR and DIAG_LIMIT > 0:
        tl.store(defer_ptr + item, (product < 0).to(tl.int8))
    rx = b * SUB * RX + tl.arange(0, SUB * RX)
    ry = b * SUB * RY + tl.arange(0, SUB * RY)
    dx_at = dx_ptr + (blk * C * RX + rx)[:, None] * K + ck[None, :]
    dy_at = dy_ptr + (blk * C * RY + ry)[:, None] * K + ck[None, :]
    if ACC_X:
        dx += tl.load(dx_at, mask=mk[None, :], other=0.0)
    if ACC_Y:
        dy += tl.load(dy_at, mask=mk[None, :], other=0.0)
    tl.store(dx_at, dx, mask=mk[None, :])
    tl.store(dy_at, dy, mask=mk[None, :])


@triton.jit
def _hdla_cotangents(dmo_ptr, dmqa_ptr, dlab_ptr, dup_ptr, blk, rows, cols, qk_live, live, strict, C: tl.constexpr):
    """The base Grams' cotangents on the token block (rows, cols) [16, 16] from the four Grams' (M_QK's dmo
    [C, C], M_QA's dmqa [C, 2C], L_AB's dlab [2C, 2C], L_KB's dup [2C, C]; kernels/README.md §8, the VJP of
    the mixing), by row stack and column: (q rows against the columns k (K and A's rank 1, e^-G), against A's
    rank 0 (beta_i k e^-G'), B's rank-0 rows against the same two, B's rank-1 rows against the same two), each
    masked (qk_live for M_QK, live for M_QA, strict for the L's; all True off the diagonal). Without the
    beta_i of A's rank 0 (the rows' products take it, the columns' gradient is A's own) and without B's
    rank-1 rows beta_t k e^G - c_t k e^G' (:func:`_hdla_col_grads` takes them apart)."""
    r2 = blk * 2 * C + 2 * rows
    qk = tl.where(qk_live, tl.load(dmo_ptr + (blk * C + rows)[:, None] * C + cols[None, :]), 0.0)
    qa0 = tl.where(live, tl.load(dmqa_ptr + (blk * C + rows)[:, None] * (2 * C) + 2 * cols[None, :]), 0.0)
    qa1 = tl.where(live, tl.load(dmqa_ptr + (blk * C + rows)[:, None] * (2 * C) + 2 * cols[None, :] + 1), 0.0)
    ab00 = tl.load(dlab_ptr + r2[:, None] * (2 * C) + 2 * cols[None, :])
    ab01 = tl.load(dlab_ptr + r2[:, None] * (2 * C) + 2 * cols[None, :] + 1)
    ab10 = tl.load(dlab_ptr + (r2 + 1)[:, None] * (2 * C) + 2 * cols[None, :])
    ab11 = tl.load(dlab_ptr + (r2 + 1)[:, None] * (2 * C) + 2 * cols[None, :] + 1)
    kb0 = tl.load(dup_ptr + r2[:, None] * C + cols[None, :])
    kb1 = tl.load(dup_ptr + (r2 + 1)[:, None] * C + cols[None, :])
    return (qk + qa1, qa0, tl.where(strict, ab01 + kb0, 0.0), tl.where(strict, ab00, 0.0),
            tl.where(strict, ab11 + kb1, 0.0), tl.where(strict, ab10, 0.0))


@triton.jit
def _hdla_row_grads(gq, g0, g1, dq_g, dq_p, d0_g, d0_p, d1_g, d1_p, cg, cp, beta_i, ex_q, ex_b, F32: tl.constexpr,
                    DM: tl.constexpr, DL: tl.constexpr):
    """Rows' share of one column block: gq += (dq_g cg + dq_p b_i cp) e^{G-R}, the B rows' g0, g1 += (d_g cg +
    d_p b_i cp) e^{G'-R}; cg, cp [16, BKS] the column block's k e^{R-G}, k e^{R-G'}, beta_i [16] its
    beta. DM: operands of the products with M_QK's and
    M_QA's cotangents, DL: with the L's (VJP_DIAG_PRECISIONS' per-Gram rule on the diagonal block)."""
    bi = beta_i[None, :]
    gq += (_dot(dq_g, cg, F32, DM) + _dot(dq_p * bi, cp, F32, DM)) * ex_q
    g0 += (_dot(d0_g, cg, F32, DL) + _dot(d0_p * bi, cp, F32, DL)) * ex_b
    g1 += (_dot(d1_g, cg, F32, DL) + _dot(d1_p * bi, cp, F32, DL)) * ex_b
    return gq, g0, g1


@triton.jit
def _hdla_col_grads(gk, ga, dq_g, dq_p, d0_g, d0_p, d1_g, d1_p, xq, kp, kg, beta_t, c_t, F32: tl.constexpr,
                    DM: tl.constexpr, DL: tl.constexpr):
    """Columns' share of one row block (before the columns' e^{R-G}): the K and A rank-1 columns (both k e^-G; all
    of it into gk) and the A rank-0 column (beta u e^-G = beta k e^-G'; ga) from the row stacks xq = q e^{G-R},
    kp = k e^{G'-R}, kg = k e^{G-R} [16, BKS]: B's rank-0 rows are kp, its rank-1 rows beta_t kg - c_t kp."""
    bt = beta_t[:, None]
    ct = c_t[:, None]
    gk += _dot(tl.trans(dq_g), xq, F32, DM) + _dot(tl.trans(d0_g - ct * d1_g), kp, F32, DL) \
        + _dot(tl.trans(bt * d1_g), kg, F32, DL)
    ga += _dot(tl.trans(dq_p), xq, F32, DM) + _dot(tl.trans(d0_p - ct * d1_p), kp, F32, DL) \
        + _dot(tl.trans(bt * d1_p), kg, F32, DL)
    return gk, ga


@triton.jit
def _hdla_gram_vjp_kernel(dmo_ptr, dmqa_ptr, dlab_ptr, dup_ptr, xq_ptr, kf_ptr, gs_ptr, gps_ptr, s_ptr, bt_ptr,
                          gq_ptr, gk_ptr, ga_ptr, gb_ptr, defer_ptr, path_ptr, K, NT, NKT, ITEMS,
                          C: tl.constexpr, BKS: tl.constexpr, F32: tl.constexpr, LOWP: tl.constexpr,
                          DM: tl.constexpr, DL: tl.constexpr, DIAG_LIMIT: tl.constexpr, RECORD: tl.constexpr,
                          DIRS: tl.constexpr):
    """S5a for HDLA, grid (NT, B*H, C/16 * K/BKS): the four Gram VJPs of :func:`_gram_vjp_kernel` in one launch
    through HDLA's six base Grams (kernels/README.md §8): token block b's gradients of the rank stacks' rows
    (gq [C, K]; gb [2C, K]) and columns (gk [C, K] takes the K and the A rank-1 columns, both k; ga [2C, K] the
    rank-0 column, its rank-1 rows 0), the buffers S5b adds to and S5 reads, from 12 products per block pair
    instead of 18. Off the diagonal: rows through G at the column block's last token, columns through G at block
    b's last; the diagonal block through the midpoint of its G and G' (one reference, :func:`_diag_reference`)
    where that bound is below DIAG_LIMIT (> 0), else left to S5b for all four Grams (their flags in ``defer [4,
    blocks, C/16, K/BKS]``; ITEMS = blocks * C/16 * K/BKS); operands DM for M_QK's and M_QA's cotangents and DL
    for the L's on the diagonal block. DIRS = 2: the reversed scan's M_QK strictly lower (S2's rule)."""
    blk = tl.program_id(1).to(tl.int64) * NT + tl.program_id(0)
    b = tl.program_id(2) // NKT
    ck = (tl.program_id(2) % NKT) * BKS + tl.arange(0, BKS)
    mk = ck < K
    qk_strict = (tl.program_id(1) >= tl.num_programs(1) // 2) & (DIRS == 2)
    tb = b * SUB + tl.arange(0, SUB)
    beta_b = tl.load(bt_ptr + blk * C + tb)
    c_b = beta_b * beta_b * tl.load(s_ptr + blk * C + tb)
    Gb = _load_g(gs_ptr, blk, tb, C, K, ck, mk, BKS, False)
    Gpb = _load_g(gps_ptr, blk, tb, C, K, ck, mk, BKS, False)
    kb = _load_tile(kf_ptr, blk, tb, C, K, ck, mk)
    gq = tl.zeros([SUB, BKS], dtype=tl.float32)
    g0 = tl.zeros([SUB, BKS], dtype=tl.float32)
    g1 = tl.zeros([SUB, BKS], dtype=tl.float32)
    gk = tl.zeros([SUB, BKS], dtype=tl.float32)
    ga = tl.zeros([SUB, BKS], dtype=tl.float32)
    every = tb[:, None] >= 0
    for m in range(0, b):  # earlier column blocks: block b's rows
        tm = m * SUB + tl.arange(0, SUB)
        ref = _load_g_row(gs_ptr, blk, m * SUB + SUB - 1, C, K, ck, mk, BKS, False)
        km = _load_tile(kf_ptr, blk, tm, C, K, ck, mk)
        cg = km * tl.exp(ref[None, :] - _load_g(gs_ptr, blk, tm, C, K, ck, mk, BKS, False))
        cp = km * tl.exp(ref[None, :] - _load_g(gps_ptr, blk, tm, C, K, ck, mk, BKS, False))
        dq_g, dq_p, d0_g, d0_p, d1_g, d1_p = _hdla_cotangents(dmo_ptr, dmqa_ptr, dlab_ptr, dup_ptr, blk, tb, tm, every,
                                                              every, every, C)
        gq, g0, g1 = _hdla_row_grads(gq, g0, g1, dq_g, dq_p, d0_g, d0_p, d1_g, d1_p, cg, cp,
                                     tl.load(bt_ptr + blk * C + tm), tl.exp(Gb - ref[None, :]),
                                     tl.exp(Gpb - ref[None, :]), F32, LOWP, LOWP)
    ref_b = _load_g_row(gs_ptr, blk, b * SUB + SUB - 1, C, K, ck, mk, BKS, False)
    for n in range(b + 1, C // SUB):  # later row blocks: block b's columns, reference at its last token
        tn = n * SUB + tl.arange(0, SUB)
        beta_n = tl.load(bt_ptr + blk * C + tn)
        c_n = beta_n * beta_n * tl.load(s_ptr + blk * C + tn)
        Gn = _load_g(gs_ptr, blk, tn, C, K, ck, mk, BKS, False)
        kn = _load_tile(kf_ptr, blk, tn, C, K, ck, mk)
        xq = _load_tile(xq_ptr, blk, tn, C, K, ck, mk) * tl.exp(Gn - ref_b[None, :])
        kp = kn * tl.exp(_load_g(gps_ptr, blk, tn, C, K, ck, mk, BKS, False) - ref_b[None, :])
        kg = kn * tl.exp(Gn - ref_b[None, :])
        dq_g, dq_p, d0_g, d0_p, d1_g, d1_p = _hdla_cotangents(dmo_ptr, dmqa_ptr, dlab_ptr, dup_ptr, blk, tn, tb, every,
                                                              every, every, C)
        gk, ga = _hdla_col_grads(gk, ga, dq_g, dq_p, d0_g, d0_p, d1_g, d1_p, xq, kp, kg, beta_n, c_n, F32, LOWP,
                                 LOWP)
    gk = gk * tl.exp(ref_b[None, :] - Gb)
    ga = ga * tl.exp(ref_b[None, :] - Gb)
    ref, lim = _diag_reference(Gpb, Gb)  # the diagonal block: rows and columns both block b
    fits = lim < DIAG_LIMIT
    if fits:
        ex_q = tl.exp(Gb - ref[None, :])
        ex_b = tl.exp(Gpb - ref[None, :])
        cg = kb * tl.exp(ref[None, :] - Gb)
        cp = kb * tl.exp(ref[None, :] - Gpb)
        dq_g, dq_p, d0_g, d0_p, d1_g, d1_p = _hdla_cotangents(
            dmo_ptr, dmqa_ptr, dlab_ptr, dup_ptr, blk, tb, tb, _token_mask(tb, tb, qk_strict),
            _token_mask(tb, tb, False), _token_mask(tb, tb, True), C)
        gq, g0, g1 = _hdla_row_grads(gq, g0, g1, dq_g, dq_p, d0_g, d0_p, d1_g, d1_p, cg, cp, beta_b, ex_q, ex_b, F32,
                                     DM, DL)
        xq = _load_tile(xq_ptr, blk, tb, C, K, ck, mk) * ex_q
        dk_d = tl.zeros([SUB, BKS], dtype=tl.float32)
        da_d = tl.zeros([SUB, BKS], dtype=tl.float32)
        dk_d, da_d = _hdla_col_grads(dk_d, da_d, dq_g, dq_p, d0_g, d0_p, d1_g, d1_p, xq, kb * ex_b, kb * ex_q,
                                     beta_b, c_b, F32, DM, DL)
        gk += dk_d * tl.exp(ref[None, :] - Gb)
        ga += da_d * tl.exp(ref[None, :] - Gb)
    item = blk * (C // SUB) * NKT + tl.program_id(2)
    for gid in tl.static_range(4):
        _record_path(path_ptr, gid * ITEMS + item, fits.to(tl.int32) * 2 - 1, RECORD)
        tl.store(defer_ptr + gid * ITEMS + item, (~fits).to(tl.int8))
    rows = (blk * C + tb)[:, None] * K + ck[None, :]
    rows2 = (blk * 2 * C + 2 * tb)[:, None] * K + ck[None, :]
    tl.store(gq_ptr + rows, gq, mask=mk[None, :])
    tl.store(gk_ptr + rows, gk, mask=mk[None, :])
    tl.store(gb_ptr + rows2, g0, mask=mk[None, :])
    tl.store(gb_ptr + rows2 + K, g1, mask=mk[None, :])
    tl.store(ga_ptr + rows2, ga, mask=mk[None, :])
    tl.store(ga_ptr + rows2 + K, tl.zeros([SUB, BKS], dtype=tl.float32), mask=mk[None, :])


@triton.jit
def _gram_vjp_fix(d_ptr, x_ptr, xg_ptr, y_ptr, g_ptr, dx_ptr, dy_ptr, defer_ptr, path_ptr, blk, b, K, NKT,
                  C: tl.constexpr, RX: tl.constexpr, RY: tl.constexpr, STRICT, BKS: tl.constexpr,
                  F32: tl.constexpr, DLOWP: tl.constexpr, DIAG_LIMIT: tl.constexpr, RECORD: tl.constexpr):
    """Token block b of one Gram VJP: each K tile whose diagonal block S5a left (``defer``, that Gram's
    [blocks, C/16, K/BKS] int8) gets its share by levels (:func:`_gram_vjp_diag_levels`) added to S5a's
    dx, dy; RECORD: its path (2..5)."""
    rx = b * SUB * RX + tl.arange(0, SUB * RX)
    ry = b * SUB * RY + tl.arange(0, SUB * RY)
    for kt in range(0, NKT):
        item = (blk * (C // SUB) + b) * NKT + kt
        if tl.load(defer_ptr + item) != 0:
            ck = kt * BKS + tl.arange(0, BKS)
            mk = ck < K
            dx_at = dx_ptr + (blk * C * RX + rx)[:, None] * K + ck[None, :]
            dy_at = dy_ptr + (blk * C * RY + ry)[:, None] * K + ck[None, :]
            dx, dy, path = _gram_vjp_diag_levels(tl.load(dx_at, mask=mk[None, :], other=0.0),
                                                 tl.load(dy_at, mask=mk[None, :], other=0.0), d_ptr, x_ptr, xg_ptr,
                                                 y_ptr, g_ptr, blk, b, K, ck, mk, C, RX, RY, STRICT, BKS, F32, DLOWP,
                                                 DIAG_LIMIT)
            tl.store(dx_at, dx, mask=mk[None, :])
            tl.store(dy_at, dy, mask=mk[None, :])
            _record_path(path_ptr, item, path, RECORD)


@triton.jit
def _gram_vjp_levels_kernel(dmo_ptr, dmqa_ptr, dlab_ptr, dup_ptr, xq_ptr, kf_ptr, af_ptr, bf_ptr, gs_ptr, gps_ptr,
                            gq_ptr, gk_ptr, ga_ptr, gb_ptr, defer_ptr, path_ptr, K, NT, NKT, n_items,
                            C: tl.constexpr, BKS: tl.constexpr, NKTP: tl.constexpr, RKP: tl.constexpr,
                            RAB: tl.constexpr, RAP: tl.constexpr, F32: tl.constexpr,
                            DLOWP: tl.constexpr, DIAG_LIMIT: tl.constexpr, RECORD: tl.constexpr,
                            DIRS: tl.constexpr):
    """S5b (vector decay), grid (NT, B*H, C/16), after the four S5a launches: token block b's diagonal
    shares that S5a left (``defer [4, blocks, C/16, K/BKS]``, n_items per Gram), for M_QK, M_QA, L_AB,
    L_KB as S5a's launches take them (:func:`_gram_vjp_fix`), added to the stacks' gradient buffers gq, gk,
    ga, gb (:data:`GRAM_VJPS`; a barrier between two Grams that share one). A program reads all its flags
    (4 Grams x NKT tiles, NKTP >= NKT) in one load and, with nothing left, exits: with mild gates every program
    does, and one dependent flag load per Gram and tile made the launch ~87 us at the LM shape's batch slice
    on an H200. Its own launch keeps S5a's registers as they were without the levels.
    DIRS = 2: S5a's BIDIR_QK rule, the reversed scan's M_QK (batch-heads [B H, 2 B H)) strictly lower. HDLA's lean
    stacks: the A, B rows of a block here are those S2b wrote (:func:`_gram_levels_kernel`): S5a leaves a block here
    only where some channel's bound fails, and S2 then left the same block to S2b (the same per-channel bound over
    K tiles that split S5a's: :func:`chunk_vjp` leaves the stacks to S1 where they do not)."""
    blk = tl.program_id(1).to(tl.int64) * NT + tl.program_id(0)
    b = tl.program_id(2)
    rec = n_items if RECORD else 0
    gram = tl.arange(0, 4)
    tile = tl.arange(0, NKTP)
    live = (gram[:, None] < (4 if RAB > 0 else 1)) & (tile[None, :] < NKT)
    flags = tl.load(defer_ptr + gram[:, None] * n_items + (blk * (C // SUB) + b) * NKT + tile[None, :], mask=live,
                    other=0)
    if tl.max(tl.max(flags.to(tl.int32), axis=1), axis=0) != 0:
        _gram_vjp_levels_block(dmo_ptr, dmqa_ptr, dlab_ptr, dup_ptr, xq_ptr, kf_ptr, af_ptr, bf_ptr, gs_ptr, gps_ptr,
                               gq_ptr, gk_ptr, ga_ptr, gb_ptr, defer_ptr, path_ptr, blk, b, rec, K, NKT, n_items, C,
                               BKS, RKP, RAB, RAP, F32, DLOWP, DIAG_LIMIT, RECORD, DIRS)


@triton.jit
def _gram_vjp_levels_block(dmo_ptr, dmqa_ptr, dlab_ptr, dup_ptr, xq_ptr, kf_ptr, af_ptr, bf_ptr, gs_ptr, gps_ptr,
                           gq_ptr, gk_ptr, ga_ptr, gb_ptr, defer_ptr, path_ptr, blk, b, rec, K, NKT, n_items,
                           C: tl.constexpr, BKS: tl.constexpr, RKP: tl.constexpr, RAB: tl.constexpr,
                           RAP: tl.constexpr, F32: tl.constexpr, DLOWP: tl.constexpr, DIAG_LIMIT: tl.constexpr,
                           RECORD: tl.constexpr, DIRS: tl.constexpr):
    """S5b's work for token block b of chunk blk where some flag is set (:func:`_gram_vjp_levels_kernel`)."""
    if DIRS == 2:  # (as in _gram_kernel: a constexpr STRICT is passed as such)
        _gram_vjp_fix(dmo_ptr, xq_ptr, gs_ptr, kf_ptr, gs_ptr, gq_ptr, gk_ptr, defer_ptr, path_ptr, blk, b, K,
                      NKT, C, 1, RKP, tl.program_id(1) >= tl.num_programs(1) // 2, BKS, F32, DLOWP, DIAG_LIMIT,
                      RECORD)
    else:
        _gram_vjp_fix(dmo_ptr, xq_ptr, gs_ptr, kf_ptr, gs_ptr, gq_ptr, gk_ptr, defer_ptr, path_ptr, blk, b, K,
                      NKT, C, 1, RKP, False, BKS, F32, DLOWP, DIAG_LIMIT, RECORD)
    if RAB > 0:
        tl.debug_barrier()  # M_QA adds to gq, which M_QK's share was just stored into
        _gram_vjp_fix(dmqa_ptr, xq_ptr, gs_ptr, af_ptr, gs_ptr, gq_ptr, ga_ptr, defer_ptr + n_items,
                      path_ptr + rec, blk, b, K, NKT, C, 1, RAP, False, BKS, F32, DLOWP, DIAG_LIMIT, RECORD)
        tl.debug_barrier()  # ga
        _gram_vjp_fix(dlab_ptr, bf_ptr, gps_ptr, af_ptr, gs_ptr, gb_ptr, ga_ptr, defer_ptr + 2 * n_items,
                      path_ptr + 2 * rec, blk, b, K, NKT, C, RAP, RAP, True, BKS, F32, DLOWP, DIAG_LIMIT, RECORD)
        tl.debug_barrier()  # gb, gk
        _gram_vjp_fix(dup_ptr, bf_ptr, gps_ptr, kf_ptr, gs_ptr, gb_ptr, gk_ptr, defer_ptr + 3 * n_items,
                      path_ptr + 3 * rec, blk, b, K, NKT, C, RAP, RKP, True, BKS, F32, DLOWP, DIAG_LIMIT, RECORD)


@triton.jit
def _token_sum(x, RP: tl.constexpr, BKS: tl.constexpr):
    """Rank rows [16 RP, BKS] -> per token [16, BKS]: the sum over each token's RP rows."""
    if RP == 1:
        return x
    else:
        return tl.sum(tl.reshape(x, (SUB, RP, BKS)), 1)


@triton.jit
def _rank_pair(x, BKS: tl.constexpr):
    """HDLA's two rank rows per token [32, BKS] -> (rank 0 rows, rank 1 rows), each [16, BKS]."""
    return tl.split(tl.permute(tl.reshape(x, (SUB, 2, BKS)), (0, 2, 1)))


@triton.jit
def _store_stack_grad(ptr, x, c, b, RP: tl.constexpr, R: tl.constexpr, C: tl.constexpr, T, H, i_b, i_h,
                      REVERSE, DIRS: tl.constexpr, K, ck, mk):
    """Rank rows [16 RP, BKS] of token block b into a [B, T, H, R, K] gradient (padding dropped)."""
    rows = b * SUB * RP + tl.arange(0, SUB * RP)
    tok, valid, rank = _row_tokens(c, rows, RP, C, T, H, i_b, i_h, REVERSE, DIRS)
    m = (valid & (rank < R))[:, None] & mk[None, :]
    tl.store(ptr + (tok * R + rank)[:, None] * K + ck[None, :], x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _vjp_kernel(
    k_ptr, g_ptr, beta_ptr, h_ptr, ds_ptr,
    gs_ptr, gps_ptr, s_ptr, xq_ptr, kf_ptr, kt_ptr, af_ptr, bf_ptr, at_ptr, bh_ptr,
    dqe_ptr, det_ptr, dat_ptr, dwp_ptr, gq_ptr, gk_ptr, ga_ptr, gb_ptr,
    dq_ptr, dk_ptr, da_ptr, db_ptr, dg_ptr, red_ptr,
    T, H, K, V, NT, NKT, scale, sgd, sbed, sdqd, sdkd, sdad, sdbd, sdgd,
    C: tl.constexpr, BKS: tl.constexpr, BVS: tl.constexpr, RKV: tl.constexpr, RKP: tl.constexpr,
    RAB: tl.constexpr, RAP: tl.constexpr, HDLA: tl.constexpr, SCALAR: tl.constexpr, REVERSE: tl.constexpr,
    F32: tl.constexpr, LOWP: tl.constexpr, LOG_ZERO: tl.constexpr, DIRS: tl.constexpr,
):
    """S5, grid (NT, B*H, K/BKS). Per 16-token block, last to first: dq, dk, da, db (HDLA: dk with the
    chain rule through A, B except the full-K sums), dg = the chunk-local reverse cumsum of the
    dG + dG' cotangents minus dG' (kernels/README.md §8), carried from block to block; the e^{G_last}
    cotangent (gamma, Kt, At) reaches every step. HDLA and per-head decays store their per-tile partial
    sums in red [blocks, NKT, 2, C] for S6. DIRS = 2: both directions (directions.py), the inputs and the
    gradients (per-direction partials) of direction d at their pointer + d * their direction stride."""
    c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_k = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    if DIRS == 2:
        d, i_b, REVERSE = split_direction(i_bh, H, tl.num_programs(1))
        g_ptr += d * sgd
        beta_ptr += d * sbed
        dq_ptr += d * sdqd
        dk_ptr += d * sdkd
        da_ptr += d * sdad
        db_ptr += d * sdbd
        dg_ptr += d * sdgd
    blk = i_bh.to(tl.int64) * NT + c
    ck = i_k * BKS + tl.arange(0, BKS)
    mk = ck < K
    RK: tl.constexpr = C * RKP
    RA: tl.constexpr = C * RAP
    NB: tl.constexpr = C // SUB
    GL = _load_g_row(gs_ptr, blk, C - 1, C, K, ck, mk, BKS, SCALAR)
    dgam = tl.zeros([BKS], dtype=tl.float32)
    for v0 in range(0, V, BVS):
        cv = v0 + tl.arange(0, BVS)
        m2 = mk[:, None] & (cv[None, :] < V)
        off = blk * K * V + ck[:, None] * V + cv[None, :]
        dgam += tl.sum(tl.load(h_ptr + off, mask=m2, other=0.0).to(tl.float32)
                       * tl.load(ds_ptr + off, mask=m2, other=0.0).to(tl.float32), 1)
    carry = tl.exp(GL) * dgam  # dG_last
    for b in range(NB):
        rk = b * SUB * RKP + tl.arange(0, SUB * RKP)
        kt_b = _load_tile(kt_ptr, blk, rk, RK, K, ck, mk)
        carry += tl.sum(kt_b * _load_tile(det_ptr, blk, rk, RK, K, ck, mk), 0)
        if RAB > 0:
            ra = b * SUB * RAP + tl.arange(0, SUB * RAP)
            dat = _load_tile(dat_ptr, blk, ra, RA, K, ck, mk)
            if HDLA:  # At = [beta u, k] e^{G_last - G} = [beta e^g Kt, Kt]: S1 stores no fp32 At for HDLA
                tok, valid, _ = _row_tokens(c, rk, 1, C, T, H, i_b, i_h, REVERSE, DIRS)
                m_tk = valid[:, None] & mk[None, :]
                lam = tl.exp(tl.maximum(tl.load(g_ptr + tok[:, None] * K + ck[None, :], mask=m_tk,
                                                other=0.0).to(tl.float32), LOG_ZERO))
                beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
                dat0, dat1 = _rank_pair(dat, BKS)
                carry += tl.sum(kt_b * (beta[:, None] * lam * dat0 + dat1), 0)
            else:
                carry += tl.sum(_load_tile(at_ptr, blk, ra, RA, K, ck, mk) * dat, 0)
    for i in range(NB):
        b = NB - 1 - i
        tb = b * SUB + tl.arange(0, SUB)
        tok, valid, _ = _row_tokens(c, tb, 1, C, T, H, i_b, i_h, REVERSE, DIRS)
        m_tk = valid[:, None] & mk[None, :]
        # the Gram VJPs (S5a's and S5b's sums per stack), then the direct terms
        rk = b * SUB * RKP + tl.arange(0, SUB * RKP)
        dxq = _load_tile(gq_ptr, blk, tb, C, K, ck, mk)
        dyk = _load_tile(gk_ptr, blk, rk, RK, K, ck, mk)
        if RAB > 0:
            ra = b * SUB * RAP + tl.arange(0, SUB * RAP)
            dya = _load_tile(ga_ptr, blk, ra, RA, K, ck, mk)
            dxb = _load_tile(gb_ptr, blk, ra, RA, K, ck, mk)
        G = _load_g(gs_ptr, blk, tb, C, K, ck, mk, BKS, SCALAR)
        xq = _load_tile(xq_ptr, blk, tb, C, K, ck, mk)
        dq = _load_tile(dqe_ptr, blk, tb, C, K, ck, mk) * tl.exp(G)  # Qh = scale q e^G
        dG = xq * (dq + dxq)
        kf = _load_tile(kf_ptr, blk, rk, RK, K, ck, mk)
        det = _load_tile(det_ptr, blk, rk, RK, K, ck, mk)
        dkf = det * tl.exp(GL[None, :] - _load_g(gs_ptr, blk, rk // RKP, C, K, ck, mk, BKS, SCALAR)) + dyk
        dG += _token_sum(-(_load_tile(kt_ptr, blk, rk, RK, K, ck, mk) * det) - kf * dyk, RKP, BKS)
        dGp = tl.zeros([SUB, BKS], dtype=tl.float32)
        if HDLA:  # A = [beta u, k], B = [k, beta u - beta^2 s k] rebuilt here instead of read back from S1's stacks
            g_raw = tl.load(g_ptr + tok[:, None] * K + ck[None, :], mask=m_tk, other=0.0).to(tl.float32)
            lam = tl.exp(tl.maximum(g_raw, LOG_ZERO))
            u = lam * kf
            beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
            s = tl.load(s_ptr + blk * C + tb)
            a0 = beta[:, None] * u
            b1 = a0 - (beta * beta * s)[:, None] * kf
            e_last = tl.exp(GL[None, :] - G)
            e_excl = tl.exp(_load_g(gps_ptr, blk, tb, C, K, ck, mk, BKS, SCALAR))
            dat0, dat1 = _rank_pair(_load_tile(dat_ptr, blk, ra, RA, K, ck, mk), BKS)
            dya0, dya1 = _rank_pair(dya, BKS)
            dwp0, dwp1 = _rank_pair(_load_tile(dwp_ptr, blk, ra, RA, K, ck, mk), BKS)
            dxb0, dxb1 = _rank_pair(dxb, BKS)
            da0 = dat0 * e_last + dya0
            da1 = dat1 * e_last + dya1
            db0 = dwp0 * e_excl + dxb0
            db1 = dwp1 * e_excl + dxb1
            dG -= e_last * (a0 * dat0 + kf * dat1) + a0 * dya0 + kf * dya1
            dGp = e_excl * (kf * dwp0 + b1 * dwp1) + kf * dxb0 + b1 * dxb1
        elif RAB > 0:
            ta = ra // RAP
            dat = _load_tile(dat_ptr, blk, ra, RA, K, ck, mk)
            daf = dat * tl.exp(GL[None, :] - _load_g(gs_ptr, blk, ta, C, K, ck, mk, BKS, SCALAR)) + dya
            dGa = -(_load_tile(at_ptr, blk, ra, RA, K, ck, mk) * dat) - _load_tile(af_ptr, blk, ra, RA, K, ck, mk) * dya
            dG += _token_sum(dGa, RAP, BKS)
            dwp = _load_tile(dwp_ptr, blk, ra, RA, K, ck, mk)
            dbf = dwp * tl.exp(_load_g(gps_ptr, blk, ta, C, K, ck, mk, BKS, SCALAR)) + dxb
            dGpb = _load_tile(bh_ptr, blk, ra, RA, K, ck, mk) * dwp + _load_tile(bf_ptr, blk, ra, RA, K, ck, mk) * dxb
            dGp = _token_sum(dGpb, RAP, BKS)
        dq = scale * (dq + dxq)
        tot = dG + dGp
        dg = tl.cumsum(tot, 0, reverse=True) + carry[None, :] - dGp
        carry += tl.sum(tot, 0)
        tl.store(dq_ptr + tok[:, None] * K + ck[None, :], dq.to(dq_ptr.dtype.element_ty), mask=m_tk)
        if HDLA:
            kk = kf
            red = red_ptr + (blk * NKT + i_k) * 2 * C
            tl.store(red + tb, tl.sum(db1 * kk, 1))
            tl.store(red + C + tb, tl.sum(u * (da0 + db1), 1))
            dk_out = dkf + da1 + db0 + beta[:, None] * lam * (da0 + db1) - (beta * beta * s)[:, None] * db1
            tl.store(dk_ptr + tok[:, None] * K + ck[None, :], dk_out.to(dk_ptr.dtype.element_ty), mask=m_tk)
            dg = dg + beta[:, None] * u * (da0 + db1)
            tl.store(dg_ptr + tok[:, None] * K + ck[None, :],
                     tl.where(g_raw < LOG_ZERO, 0.0, dg).to(dg_ptr.dtype.element_ty), mask=m_tk)
        else:
            _store_stack_grad(dk_ptr, dkf, c, b, RKP, RKV, C, T, H, i_b, i_h, REVERSE, DIRS, K, ck, mk)
            if RAB > 0:
                _store_stack_grad(da_ptr, daf, c, b, RAP, RAB, C, T, H, i_b, i_h, REVERSE, DIRS, K, ck, mk)
                _store_stack_grad(db_ptr, dbf, c, b, RAP, RAB, C, T, H, i_b, i_h, REVERSE, DIRS, K, ck, mk)
            if SCALAR:
                tl.store(red_ptr + (blk * NKT + i_k) * 2 * C + tb, tl.sum(tl.where(mk[None, :], dg, 0.0), 1))
            else:
                g_raw = tl.load(g_ptr + tok[:, None] * K + ck[None, :], mask=m_tk, other=0.0).to(tl.float32)
                tl.store(dg_ptr + tok[:, None] * K + ck[None, :],
                         tl.where(g_raw < LOG_ZERO, 0.0, dg).to(dg_ptr.dtype.element_ty), mask=m_tk)


# ----------------------------------------------------------------------------- S6, S7
@triton.jit
def _reduce_kernel(k_ptr, g_ptr, beta_ptr, s_ptr, red_ptr, dk_ptr, dg_ptr, dbeta_ptr, dvs_ptr, dv_ptr, T, H, K, NT,
                   NKT, D, skd, sgd, sbed, sdkd, sdgd, sdbed, sdvd,
                   C: tl.constexpr, BKS: tl.constexpr, HDLA: tl.constexpr, REVERSE: tl.constexpr,
                   LOG_ZERO: tl.constexpr, DIRS: tl.constexpr, RP: tl.constexpr, R: tl.constexpr, BD: tl.constexpr):
    """S6 and S7, grid (NT, B*H, K/BKS for HDLA else 1): the sums over K tiles of S5's partials. HDLA: s = k.u
    gives ds = -beta^2 sum_k db1 k, so dk += 2 ds u and dg += ds u k (read back in their dtype), and
    dbeta = sum_k u (da0 + db1) - 2 beta s sum_k db1 k; a per-head decay: dg [C] (0 where clamped). The
    programs of the first K tile also unstack dV (:func:`_unstack_chunk`): one launch for both stages."""
    c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    if DIRS == 2:  # both directions: as S5
        d, i_b, REVERSE = split_direction(i_bh, H, tl.num_programs(1))
        k_ptr += d * skd
        g_ptr += d * sgd
        beta_ptr += d * sbed
        dk_ptr += d * sdkd
        dg_ptr += d * sdgd
        dbeta_ptr += d * sdbed
        dv_ptr += d * sdvd
    blk = i_bh.to(tl.int64) * NT + c
    ct = tl.arange(0, C)
    tok, valid, _ = _row_tokens(c, ct, 1, C, T, H, i_b, i_h, REVERSE, DIRS)
    p1 = tl.zeros([C], dtype=tl.float32)
    p2 = tl.zeros([C], dtype=tl.float32)
    for i_k in range(NKT):
        red = red_ptr + (blk * NKT + i_k) * 2 * C
        p1 += tl.load(red + ct)
        p2 += tl.load(red + C + ct)
    if HDLA:
        ck = tl.program_id(2) * BKS + tl.arange(0, BKS)
        m_tk = valid[:, None] & (ck[None, :] < K)
        off = tok[:, None] * K + ck[None, :]
        kk = tl.load(k_ptr + off, mask=m_tk, other=0.0).to(tl.float32)
        g_raw = tl.load(g_ptr + off, mask=m_tk, other=0.0).to(tl.float32)
        u = tl.exp(tl.maximum(g_raw, LOG_ZERO)) * kk
        beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        ds_s = -beta * beta * p1
        dk = tl.load(dk_ptr + off, mask=m_tk, other=0.0).to(tl.float32) + 2.0 * ds_s[:, None] * u
        tl.store(dk_ptr + off, dk.to(dk_ptr.dtype.element_ty), mask=m_tk)
        dg = tl.load(dg_ptr + off, mask=m_tk, other=0.0).to(tl.float32)
        dg = tl.where(g_raw < LOG_ZERO, 0.0, dg + ds_s[:, None] * u * kk)
        tl.store(dg_ptr + off, dg.to(dg_ptr.dtype.element_ty), mask=m_tk)
        if tl.program_id(2) == 0:
            s = tl.load(s_ptr + blk * C + ct)
            tl.store(dbeta_ptr + tok, (p2 - 2.0 * beta * s * p1).to(dbeta_ptr.dtype.element_ty), mask=valid)
    else:
        g_raw = tl.load(g_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        tl.store(dg_ptr + tok, tl.where(g_raw < LOG_ZERO, 0.0, p1).to(dg_ptr.dtype.element_ty), mask=valid)
    if tl.program_id(2) == 0:
        _unstack_chunk(dvs_ptr, dv_ptr, blk, c, i_b, i_h, T, H, D, C, RP, R, BD, REVERSE, DIRS)


@triton.jit
def _unstack_kernel(x_ptr, o_ptr, T, H, D, NT, sod, C: tl.constexpr, RP: tl.constexpr, R: tl.constexpr,
                    BD: tl.constexpr, REVERSE: tl.constexpr, DIRS: tl.constexpr):
    """S7 alone (no S6: vector decay without HDLA's builder), grid (NT, B*H): :func:`_unstack_chunk`.
    DIRS = 2: both directions, direction d's partial at ``o_ptr + d * sod``."""
    c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    if DIRS == 2:
        d, i_b, REVERSE = split_direction(i_bh, H, tl.num_programs(1))
        o_ptr += d * sod
    _unstack_chunk(x_ptr, o_ptr, i_bh.to(tl.int64) * NT + c, c, i_b, i_bh % H, T, H, D, C, RP, R, BD, REVERSE, DIRS)


@triton.jit
def _unstack_chunk(x_ptr, o_ptr, blk, c, i_b, i_h, T, H, D, C: tl.constexpr, RP: tl.constexpr, R: tl.constexpr,
                   BD: tl.constexpr, REVERSE, DIRS: tl.constexpr):
    """S7 for chunk c of one (batch, head): its [C*RP, D] block of a [blocks, C*RP, D] stack into the
    [B, T, H, R, D] tensor at ``o_ptr`` (padding rows and identity steps dropped)."""
    rows = tl.arange(0, C * RP)
    tok, valid, rank = _row_tokens(c, rows, RP, C, T, H, i_b, i_h, REVERSE, DIRS)
    for d0 in range(0, D, BD):
        cd = d0 + tl.arange(0, BD)
        md = cd < D
        x = tl.load(x_ptr + (blk * C * RP + rows)[:, None] * D + cd[None, :], mask=md[None, :], other=0.0)
        m = (valid & (rank < R))[:, None] & md[None, :]
        tl.store(o_ptr + (tok * R + rank)[:, None] * D + cd[None, :], x.to(o_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------- host
def _pow2(n: int) -> int:
    return 1 if n <= 1 else next_power_of_2(n)


def _tile(n: int, cap: int = 64) -> int:
    return max(16, min(cap, next_power_of_2(n)))


def _launch_products(products, blocks, rpc, empty, prec, num_warps, num_stages):
    """S4: up to :data:`S4_SLOTS` independent products ``(out, m, n, terms, cin, mask)`` in one launch of
    :func:`_gemm_group_kernel`, each ``out = sum of alpha a b over its terms (+ cin)`` per chunk; a term is
    ``(a, b, k, alpha)`` with ``a``, ``b`` per-chunk row-major tiles or their transposes as :func:`_v` gives them,
    alpha +-1."""
    pointers, sizes = [], {}
    for slot, (out, m, n, terms, cin, mask) in enumerate(products):
        flags = (HAS_C.value if cin is not None else 0) | (MASK.value if mask else 0)
        (a1, b1, k1, _), (a2, b2, k2, _) = terms[0], terms[-1]
        for (a, b, k, alpha), (ta, tb, neg) in zip(terms, ((TA1, TB1, NEG1), (TA2, TB2, NEG2))):
            if alpha not in (1, -1):
                raise ValueError(f"S4's terms take the signs +-1, got {alpha}")
            flags |= ((ta.value if _transposed(a, m, k) else 0) | (tb.value if _transposed(b, k, n) else 0)
                      | (neg.value if alpha == -1 else 0))
        pointers += [out, a1[0], b1[0], a2[0], b2[0], out if cin is None else cin]
        sizes.update({f"M{slot}": m, f"N{slot}": n, f"K1{slot}": k1, f"K2{slot}": k2 if len(terms) > 1 else 0,
                      f"FLAGS{slot}": flags, f"BM{slot}": _tile(m), f"BN{slot}": _tile(n), f"BKA{slot}": _tile(k1),
                      f"BKB{slot}": _tile(k2)})
    for slot in range(len(products), S4_SLOTS):  # unused slots: compiled out (SLOTS)
        pointers += [empty] * 6
        sizes.update({f"{name}{slot}": 16 for name in ("M", "N", "K1", "BM", "BN", "BKA", "BKB")})
        sizes.update({f"K2{slot}": 0, f"FLAGS{slot}": 0})
    tiles = sum(cdiv(m, _tile(m)) * cdiv(n, _tile(n)) for _, m, n, *_ in products)
    _gemm_group_kernel[(blocks, tiles)](*pointers, **sizes, SLOTS=len(products), RPC=rpc, **prec, num_warps=num_warps,
                                        num_stages=num_stages)


def _transposed(operand, rows, cols) -> bool:
    """Whether an S4 operand (:func:`_v`'s tuple) of a [rows, cols] product side is a transposed tile; raises
    unless its strides are those of a dense row-major [rows, cols] tile per chunk or of its transpose."""
    _, chunk, row, col = operand
    if chunk != rows * cols or (row, col) not in ((cols, 1), (1, rows)):
        raise ValueError(f"S4 operand strides {(chunk, row, col)} are not those of a dense [{rows}, {cols}] tile")
    return (row, col) == (1, rows) and (row, col) != (cols, 1)


def _v(t, rows, cols, trans=False):
    """A per-chunk row-major [rows, cols] tile of t as an S4 operand (tensor, chunk, row, column
    strides), or its transpose [cols, rows]."""
    return (t, rows * cols, 1, cols) if trans else (t, rows * cols, cols, 1)


def b2_config(dk: int, dv: int, chunk: int, r_kv: int, r_ab: int, lowp_scratch: bool = False) -> dict:
    """B2's column tiles and warps, the one place to tune them: BKS of S2 (K columns per step of the Gram
    products), BKG of HDLA's S2 (:func:`_hdla_gram_kernel`, and of S2b after it: at 64 its six products spill
    168 bytes on sm_90a, at 32 none), BK1 of S1 (the stacks), BKV of S5a / S5 (K columns per program; 64, not
    32: on the H100 S5a's Gram VJPs took 31% less time at hdla_tiny's 1024 px batch and at the LM shape, S5
    10-20% less, the seed mixers' rank-1 and rank-0 B2 2-4% less: benchmarks/launch_configs.py; HDLA's S5 then
    spilled 16 bytes on sm_90a), BVS (V columns per step);
    diag_limit, the bound on the diagonal token blocks' factors (one product per block below it, else by
    levels; S2, S5a, S2b, S5b); diag_gram, diag_vjp: the operands of those products in S2 / S2b
    (:data:`GRAM_DIAG_PRECISION`) and S5a (:data:`VJP_DIAG_PRECISIONS`, one per Gram, or one name for all and
    S5b), names of :data:`DIAG_PRECISIONS`; ``$HDLA_VISION_DIAG_PRECISION_S2``, ``_S5A`` (one name or four) and
    ``$HDLA_VISION_DIAG_PRECISION`` (every stage) override them (the benchmarks);
    hdla_gram: HDLA's S2 and S5a through six base Grams of q and k (:func:`_hdla_gram_kernel`,
    :func:`_hdla_gram_vjp_kernel`; ``$HDLA_VISION_HDLA_GRAM=0``, the benchmarks' "before": the four Grams and
    their VJPs over the rank stacks as for any rank);
    hdla_lean: HDLA's S1 writes no stack that no later stage reads (``$HDLA_VISION_HDLA_LEAN=0``, the benchmarks'
    "before": all of them): with the single-Gram S2 / S5a no A, B stacks (S2b writes the rows of the blocks it and
    S5b take, :func:`_hdla_ab_rows`), with 16-bit scratch Bh in 16 bits and At only in S4's 16-bit copy (S5
    rebuilds At from k, beta and g);
    warps_gemm, warps_stacks: S4's and S1's warps; s4_group, S4's products per launch (:data:`S4_LAUNCHES`; 1:
    one launch per product, as before 2026-11-28);
    stages_gemm, S4's pipeline depth: 2 with 16-bit scratch (``lowp_scratch``; at 3 one of its products,
    dM_QA's, spilled a register on sm_90a), else 3; ``$HDLA_VISION_B2_GEMM_STAGES`` overrides it (the
    benchmarks). Its K loops take 1 to 4 steps of 64, so a third stage rarely has a load to hold; the
    stage count moves loads, never the products' order (the gradients are the same bits)."""
    rows = chunk * max(_pow2(r_ab), _pow2(r_kv), 1)
    stages = os.environ.get("HDLA_VISION_B2_GEMM_STAGES") or (2 if lowp_scratch else 3)
    if str(stages) not in ("1", "2", "3", "4"):
        raise ValueError(f"HDLA_VISION_B2_GEMM_STAGES must be 1 to 4, got {stages!r}")
    return dict(BKS=_tile(dk, 64), BKG=_tile(dk, 32), BK1=_tile(dk, 32), BKV=_tile(dk, 64), BVS=_tile(dv, 64),
                warps_vjp=4 if rows <= 64 else 8, stages_vjp=1, stages_gemm=int(stages), warps_gemm=4, warps_stacks=4,
                s4_group=S4_SLOTS,
                warps_block=8 if 16 * max(_pow2(r_ab), _pow2(r_kv)) >= 64 else 4, diag_limit=DIAG_LIMIT,
                diag_gram=(os.environ.get("HDLA_VISION_DIAG_PRECISION_S2") or os.environ.get("HDLA_VISION_DIAG_PRECISION")
                           or GRAM_DIAG_PRECISION),
                hdla_gram=os.environ.get("HDLA_VISION_HDLA_GRAM", "1") != "0",
                hdla_lean=os.environ.get("HDLA_VISION_HDLA_LEAN", "1") != "0",
                diag_vjp=(_per_gram(os.environ.get("HDLA_VISION_DIAG_PRECISION_S5A"))
                          or os.environ.get("HDLA_VISION_DIAG_PRECISION") or VJP_DIAG_PRECISIONS))


def _per_gram(names):
    """``$HDLA_VISION_DIAG_PRECISION_S5A`` (benchmarks): one name, or four comma-separated names (M_QK, M_QA,
    L_AB, L_KB: :data:`GRAM_VJPS`' order) for S5a's launches; None if unset."""
    if not names:
        return None
    names = tuple(names.split(","))
    if len(names) not in (1, 4):
        raise ValueError(f"HDLA_VISION_DIAG_PRECISION_S5A takes one name or four, got {names!r}")
    return names if len(names) == 4 else names[0]


def diag_lowp(lowp: int, name: str = None) -> int:
    """The _dot LOWP code of the factored diagonal products for inputs of LOWP code ``lowp`` (0 = fp32:
    unused, F32 takes ieee): ``name`` (one of :data:`DIAG_PRECISIONS`) if given, else :data:`DIAG_PRECISION`
    or ``$HDLA_VISION_DIAG_PRECISION``; never fp16 (its range, e^11, cannot hold factors up to
    e^DIAG_LIMIT): bf16 becomes tf32 for fp16 inputs."""
    name = name or os.environ.get("HDLA_VISION_DIAG_PRECISION") or DIAG_PRECISION
    if name not in DIAG_PRECISIONS:
        raise ValueError(f"HDLA_VISION_DIAG_PRECISION must be one of {sorted(DIAG_PRECISIONS)}, got {name!r}")
    code = DIAG_PRECISIONS[name]
    return 0 if code == 1 and lowp == 2 else code


def scratch_dtypes(q_dtype: torch.dtype, v_dtype: torch.dtype, r_ab: int, hdla: bool = False,
                   lean: bool = False) -> dict:
    """{scratch name: dtype} for B2's scratch tensors not kept in fp32 (the table above): for 16-bit q
    and :data:`SCRATCH` (or ``$HDLA_VISION_B2_SCRATCH``) "lowp", :data:`OPERAND_ONLY` (and M_QK at
    r_ab = 0, where it is M_o; HDLA's Bh with ``lean``, b2_config's hdla_lean: its S5 does not read Bh) and
    :data:`OPERAND_COPIES` in q's dtype, the dtype _dot casts S4's operands to, and dV's stack in v's dtype;
    "lowp_stacks" also :data:`INPUT_COPIES` (k, a, b have q's dtype; HDLA's A, B are built, not copied); empty for
    fp32 q or "fp32" (no copies then)."""
    mode = os.environ.get("HDLA_VISION_B2_SCRATCH") or SCRATCH
    if mode not in SCRATCH_MODES:
        raise ValueError(f"HDLA_VISION_B2_SCRATCH must be one of {list(SCRATCH_MODES)}, got {mode!r}")
    if mode == "fp32" or q_dtype not in (torch.bfloat16, torch.float16):
        return {}
    names = OPERAND_ONLY + OPERAND_COPIES + (() if r_ab else ("mqk",)) + (("bh",) if hdla and lean else ())
    if mode == "lowp_stacks":
        names += INPUT_COPIES[:1 if hdla or not r_ab else 3]
    return dict({name: q_dtype for name in names}, dvs=v_dtype)


def check_diag_limit(diag_limit) -> float:
    """``diag_limit`` as a float (None: :data:`DIAG_LIMIT`); a ValueError outside [0, DIAG_LIMIT], where
    the factored diagonal product could overflow."""
    if diag_limit is None:
        return DIAG_LIMIT
    if not 0.0 <= float(diag_limit) <= DIAG_LIMIT:
        raise ValueError(f"diag_limit must be in [0, {DIAG_LIMIT}] (0: every diagonal block token by token), "
                         f"got {diag_limit}")
    return float(diag_limit)


def scratch_shapes(c: int, dk: int, dv: int, r_kv: int, r_ab: int, hdla: bool, scalar: bool, dtypes: dict) -> dict:
    """{name: (shape, dtype)} of B2's scratch per block (one chunk of one batch, head and direction) for
    chunk size ``c``, head dims ``dk``, ``dv``, ranks ``r_kv``, ``r_ab`` and the dtypes of
    :func:`scratch_dtypes` (fp32 where it names none); a tensor this call does not use has shape (0,)."""
    rkp, rap = _pow2(r_kv), (_pow2(r_ab) if r_ab else 1)
    rk, ra = c * rkp, c * rap
    gshape = (c,) if scalar else (c, dk)
    shapes = dict(gs=gshape, gps=gshape, s=(c,) if hdla else (0,), bt=(c,) if hdla else (0,), xq=(c, dk),
                  kf=(rk, dk), kt=(rk, dk), vf=(rk, dv), dos=(c, dv), mqk=(c, rk), dqe=(c, dk), dmo=(c, rk),
                  det=(rk, dk), dvs=(rk, dv), gq=(c, dk), gk=(rk, dk))
    for name, shape in dict(af=(ra, dk), bf=(ra, dk), at=(ra, dk), bh=(ra, dk), mqa=(c, ra), lab=(ra, ra),
                            lkb=(ra, rk), tm=(ra, ra), w=(ra, dk), u=(ra, rk), mo=(c, rk), et=(rk, dk),
                            dn=(dk, dk), dat=(ra, dk), du=(ra, rk), dw=(ra, dk), dmqa=(c, ra), dwp=(ra, dk),
                            dup=(ra, rk), dlab=(ra, ra), ga=(ra, dk), gb=(ra, dk)).items():
        shapes[name] = shape if r_ab else (0,)
    for name, shape in dict(tm16=(ra, ra), at16=(ra, dk)).items():  # S4's copies: only where 16-bit
        shapes[name] = shape if r_ab and name in dtypes else (0,)
    if hdla and "at16" in dtypes and "bh" in dtypes:  # lean HDLA (scratch_dtypes): S4 reads At from its copy only
        shapes["at"] = (0,)
    return {name: (shape, dtypes.get(name, torch.float32)) for name, shape in shapes.items()}


def scratch_lifetimes(r_ab: int, copies: bool) -> dict:
    """{name: (first, last) launch index in :data:`STAGES`, S4's products of one launch at its first's index
    (:data:`S4_LAUNCHES`)}: :data:`SCRATCH_LIFETIMES` for rank ``r_ab``
    (0: M_QK is M_o, read by dV's product) and whether S4 reads T from its 16-bit copy (``copies``: then T
    itself is read only inside S3)."""
    spans = dict(SCRATCH_LIFETIMES)
    if not r_ab:
        spans["mqk"] = ("S2", "dvs")
    if copies:
        spans["tm"] = ("S3", "S3")
    index = {name: i for i, name in enumerate(STAGES)}
    for launch in S4_LAUNCHES if r_ab else S4_LAUNCHES_RANK0:  # one launch, one index: its products run at once
        index.update((name, index[launch[0]]) for name in launch)
    return {name: (index[first], index[last]) for name, (first, last) in spans.items()}


def plan_scratch(sizes: dict, lifetimes: dict) -> tuple:
    """Offsets that let scratch tensors share memory: ``sizes`` {name: bytes per block}, ``lifetimes``
    {name: (first, last) stage}. Returns ({name: byte offset per block}, bytes per block): first fit,
    largest first, each tensor at the lowest :data:`POOL_ALIGN`-aligned offset that overlaps no tensor
    live at any of its stages (two tensors overlap in time unless one's last stage precedes the other's
    first). Tensors of size 0 get offset 0."""
    align = lambda n: -(-n // POOL_ALIGN) * POOL_ALIGN  # noqa: E731
    offsets, placed = {}, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        size = align(sizes[name])
        if size == 0:
            offsets[name] = 0
            continue
        first, last = lifetimes[name]
        busy = sorted((o, o + n) for o, n, f, l in placed if not (l < first or last < f))
        offset = 0
        for start, end in busy:
            if offset + size <= start:
                break
            offset = max(offset, end)
        offsets[name] = offset
        placed.append((offset, size, first, last))
    return offsets, max((o + n for o, n, _, _ in placed), default=0)


def _scratch_bytes(nbytes: int, device) -> torch.Tensor:
    """Uninitialised memory for B2's scratch (the tests fill it with NaN to catch reads before writes)."""
    return torch.empty(nbytes, device=device, dtype=torch.uint8)


def scratch_layout(shapes: dict, r_ab: int, pool=None) -> tuple:
    """How :func:`allocate_scratch` lays out ``shapes`` (:func:`scratch_shapes`): ({name: bytes per block},
    {name: byte offset per block} or None when each tensor is allocated apart, bytes per block). Pooled
    (``pool`` True, or None and :data:`SCRATCH_POOL`) by :func:`plan_scratch` over the lifetimes of rank
    ``r_ab``, with T dying in S3 where S4 reads its 16-bit copy. The plan is made once per layout
    (:func:`_planned_layout`; planning took ~0.3 ms of host time, twice per backward call): treat the
    returned dicts as read-only."""
    nbytes = tuple((name, math.prod(shape) * dtype.itemsize) for name, (shape, dtype) in shapes.items())
    return _planned_layout(nbytes, r_ab, bool(SCRATCH_POOL if pool is None else pool))


@functools.lru_cache(maxsize=256)
def _planned_layout(nbytes: tuple, r_ab: int, pool: bool) -> tuple:
    """:func:`scratch_layout` for ``nbytes`` ((name, bytes per block), ...)."""
    sizes = dict(nbytes)
    if not pool:
        return sizes, None, sum(sizes.values())
    offsets, per_block = plan_scratch(sizes, scratch_lifetimes(r_ab, sizes["tm16"] > 0))
    return sizes, offsets, per_block


def allocate_scratch(shapes: dict, blocks: int, device, r_ab: int, pool=None) -> dict:
    """B2's scratch tensors ``{name: [blocks, *shape]}`` as :func:`scratch_layout` lays them out: views of
    one pool (one strided view of the pool's bytes in each dtype per tensor), or one allocation each. Each
    tensor is contiguous; a pool tensor's bytes are its own from its writer to its last reader."""
    nbytes, offsets, per_block = scratch_layout(shapes, r_ab, pool)
    if offsets is None:
        return {name: _scratch_bytes(nbytes[name] * blocks, device).view(dtype).view(blocks, *shape)
                for name, (shape, dtype) in shapes.items()}
    memory = _scratch_bytes(per_block * blocks, device)
    typed, z = {}, {}
    for name, (shape, dtype) in shapes.items():
        if dtype not in typed:  # per_block is a multiple of POOL_ALIGN, so every dtype divides the pool
            typed[dtype] = memory.view(dtype)
        z[name] = typed[dtype].as_strided((blocks, *shape), _block_strides(shape),
                                          offsets[name] * blocks // dtype.itemsize)
    return z


@functools.lru_cache(maxsize=1024)
def _block_strides(shape: tuple) -> tuple:
    """Strides of a contiguous ``[blocks, *shape]`` tensor (independent of blocks)."""
    return (math.prod(shape), *(math.prod(shape[i + 1:]) for i in range(len(shape))))


def scratch_bytes_per_block(c: int, dk: int, dv: int, r_kv: int, r_ab: int, hdla: bool, scalar: bool,
                            q_dtype: torch.dtype, v_dtype: torch.dtype, pool=None) -> int:
    """Bytes of B2's scratch per block (:func:`scratch_shapes`, laid out as :func:`allocate_scratch` lays it
    out), the reduction buffer of dg / dbeta included."""
    lean = hdla and b2_config(dk, dv, c, r_kv, r_ab)["hdla_lean"]
    shapes = scratch_shapes(c, dk, dv, r_kv, r_ab, hdla, scalar, scratch_dtypes(q_dtype, v_dtype, r_ab, hdla, lean))
    total = scratch_layout(shapes, r_ab, pool)[2]
    reduction = cdiv(dk, b2_config(dk, dv, c, r_kv, r_ab)["BKV"]) * 2 * c * 4 if hdla or scalar else 0
    return total + reduction


def chunk_vjp(do, q, k, v, a, b, g, beta, h, ds, scale, reverse, chunk, stages=None, diag_limit=None,
              diag_paths=None, direction_strides=None, state_pass=None):
    """B2: the chunk-local VJP given h (the states entering each chunk) and ds (B1's dS_c), both
    ``[B, H, NT, K, V]``. Shapes as ``bwd.generalized_backward`` (contiguous; HDLA: a = b = None, beta
    [B, T, H]). Returns (dq, dk, dv, da, db, dbeta, dg): HDLA has da = db = None, the others dbeta = None;
    at r_ab = 0 da = db = None. ``state_pass``, if given, is B1: B2's stages that need no dS (S1-S3 and
    the products W, U, Mo, E) also form B1's inputs, N = At^T W ``[B, H, NT, K, K]`` (None at r_ab = 0),
    Qeff = Qh - M_QA W ``[B, H, NT*C, K]`` (16-bit for 16-bit q) and gamma ``[B, H, NT, K]`` fp32 (the
    quantities of ``fwd.chunk_prepare``), and ``state_pass(dict(N=, Qeff=, gamma=, chunk=))`` fills ds
    before the stages that read it. ``stages`` (a list), if given, receives a closure that relaunches B2
    (without B1).
    ``diag_limit`` (None: b2_config's; 0: every diagonal block token by token) bounds every factor of the
    diagonal blocks' products, one per block or by levels (S2b, S5b). ``diag_paths`` (tests), a dict,
    receives the path each diagonal block took (1 one product, 2..5 by levels: 1 + the cross levels, 0 the
    token loop, -1 a Gram this rank has not): ``gram`` [blocks, 4, C/16, K/BKS] for S2's M_QK, M_QA,
    L_AB, L_KB and ``gram_vjp`` [4, blocks, C/16, K/BKV] for S5a's (int32).

    ``direction_strides`` (``fwd.chunk_prepare``): both directions in one launch (h, ds with ``2B``
    batches, one ``do``); every gradient is then ``[2, *input shape]``, the two directions' partials
    (the reversed scan without its own write, kernels/README.md §9)."""
    hdla = beta is not None
    dirs = 1 if direction_strides is None else 2
    batch, seq_len, heads, dk = q.shape
    bh_all = dirs * batch * heads
    dv = v.shape[-1]
    c = chunk
    nt = cdiv(seq_len, c)
    blocks = bh_all * nt
    r_kv = 1 if hdla else k.shape[3]
    r_ab = 2 if hdla else a.shape[3]
    rkp, rap = _pow2(r_kv), (_pow2(r_ab) if r_ab else 1)
    rk, ra = c * rkp, c * rap
    scalar = g.dim() == 3
    f32 = q.dtype == torch.float32
    lowp = 0 if f32 else (1 if q.dtype == torch.bfloat16 else 2)
    cfg = b2_config(dk, dv, c, r_kv, r_ab, lowp_scratch=bool(scratch_dtypes(q.dtype, v.dtype, r_ab)))
    lean = hdla and cfg["hdla_lean"]
    dtypes = scratch_dtypes(q.dtype, v.dtype, r_ab, hdla, lean)
    limit = check_diag_limit(cfg["diag_limit"] if diag_limit is None else diag_limit)
    dev = q.device
    sc = lambda *shape, dtype=torch.float32: torch.empty(blocks, *shape, device=dev, dtype=dtype)  # noqa: E731
    z = allocate_scratch(scratch_shapes(c, dk, dv, r_kv, r_ab, hdla, scalar, dtypes), blocks, dev, r_ab)
    def grad_of(x):  # one direction: x's gradient; both: the two directions' partials [2, *x.shape]
        return torch.empty_like(x) if dirs == 1 else x.new_empty(2, *x.shape)

    dq, dk_, dv_, dg = grad_of(q), grad_of(k), grad_of(v), grad_of(g)
    da = grad_of(a) if r_ab and not hdla else None
    db = grad_of(b) if r_ab and not hdla else None
    dbeta = grad_of(beta) if hdla else None
    offsets = (direction_strides or {}).get
    step = (lambda x: 0) if dirs == 1 else (lambda x: 0 if x is None else x.numel())  # noqa: E731  partials' stride
    rev = bool(reverse) and dirs == 1
    nkt = cdiv(dk, cfg["BKV"])
    red = sc(nkt, 2, c) if hdla or scalar else sc(0)
    empty = z["s"]
    ranks = dict(RKV=r_kv, RKP=rkp, RAB=r_ab, RAP=rap)
    prec = dict(F32=f32, LOWP=lowp)
    per_gram = isinstance(cfg["diag_vjp"], tuple)  # else one name for S5a's four launches and S5b
    vjp_names = cfg["diag_vjp"] if per_gram else (cfg["diag_vjp"],) * 4
    diag = dict(DLOWP=diag_lowp(lowp, None if per_gram else cfg["diag_vjp"]), DIAG_LIMIT=limit,
                RECORD=diag_paths is not None)
    gram_diag = dict(diag, DLOWP=diag_lowp(lowp, cfg["diag_gram"]))  # S2, S2b
    nb = c // 16
    levels_pass = not scalar and limit > 0  # S2b, S5b: the diagonal blocks S2, S5a leave (diag_levels.py)
    single_gram = hdla and levels_pass and cfg["hdla_gram"]  # S2 as HDLA's six base Grams (_hdla_gram_kernel)
    bks = cfg["BKG"] if single_gram else cfg["BKS"]  # S2's and S2b's K columns per step
    # S1 leaves HDLA's A, B stacks out: only S2b and S5b read them after the single-Gram S2 and S5a, and only the
    # blocks they take; S2b writes those rows (_hdla_ab_rows), and S5b takes no block that S2b did not where S2's K
    # tiles split S5a's (the same per-channel bound); else (a launch_configs override) S1 writes them
    lean_ab = single_gram and lean and cfg["BKV"] % bks == 0
    defer = dict(gram=torch.empty((blocks, 4, nb) if levels_pass else (0,), device=dev, dtype=torch.int8),
                 gram_vjp=torch.empty((4, blocks, nb, nkt) if levels_pass else (0,), device=dev, dtype=torch.int8))
    paths = dict(gram=empty, gram_vjp=[empty] * 4)
    if diag_paths is not None:
        unset = dict(device=dev, dtype=torch.int32)
        paths = dict(gram=torch.full((blocks, 4, nb, cdiv(dk, bks)), -1, **unset),
                     gram_vjp=torch.full((4, blocks, nb, nkt), -1, **unset))
        diag_paths.update(paths)
    from ..utils import LOG_ZERO_FP32

    rebuild_ab = dict(HDLA_AB=lean_ab, REVERSE=rev and lean_ab, LOG_ZERO=LOG_ZERO_FP32)
    hdla_ab_inputs = (z["bt"], z["s"], g if lean_ab else empty, seq_len, heads)

    products = []  # S4's products since the last launch: independent of each other

    def gemm(out, m, n, terms, cin=None, mask=False):
        products.append((out, m, n, terms, cin, mask))

    def run_products():  # launches the products gathered, cfg["s4_group"] at a time
        for first in range(0, len(products), cfg["s4_group"]):
            _launch_products(products[first:first + cfg["s4_group"]], blocks, rkp, empty, prec,
                             num_warps=cfg["warps_gemm"], num_stages=cfg["stages_gemm"])
        products.clear()

    tm = z["tm16"] if z["tm16"].numel() else z["tm"]  # S4 reads T and At from their 16-bit copies if any
    at = z["at16"] if z["at16"].numel() else z["at"]
    state_inputs = _state_inputs(q, dk, nt, c, r_ab, dirs) if state_pass is not None else None
    qh, gamma = (state_inputs["Qh"], state_inputs["gamma"]) if state_inputs else (empty, empty)

    def launch(with_state_pass):
        grid = (nt, bh_all)
        _stacks_kernel[grid](
            q, k, v, a if r_ab and not hdla else empty, b if r_ab and not hdla else empty,
            beta if hdla else empty, g, do, z["gs"], z["gps"], z["s"], z["bt"], z["xq"], z["kf"], z["kt"], z["af"],
            z["bf"], z["at"], z["at16"], z["bh"], z["vf"], z["dos"], qh, gamma, seq_len, heads, dk, dv, nt,
            float(scale), *(offsets(n, 0) for n in ("q", "k", "v", "a", "b", "hdla_beta", "g")), C=c,
            BKS=cfg["BK1"], BVS=cfg["BVS"], **ranks, HDLA=hdla, SCALAR=scalar, REVERSE=rev,
            LOG_ZERO=LOG_ZERO_FP32, AT16=z["at16"].numel() > 0, DIRS=dirs, STATE_INPUTS=state_inputs is not None,
            HDLA_AB=not lean_ab, HDLA_AT32=z["at"].numel() > 0, num_warps=cfg["warps_stacks"])
        grams_in = (z["xq"], z["kf"], z["af"], z["bf"], z["gs"], z["gps"], z["mqk"], z["mqa"], z["lab"], z["lkb"])
        if single_gram:
            _hdla_gram_kernel[(nt, bh_all, nb)](
                z["xq"], z["kf"], z["gs"], z["gps"], z["s"], z["bt"], *grams_in[6:], defer["gram"], paths["gram"], dk,
                nt, C=c, BKS=bks, **prec, **gram_diag, DIRS=dirs, num_warps=cfg["warps_block"])
        else:
            _gram_kernel[(nt, bh_all, nb)](
                *grams_in, defer["gram"], paths["gram"], heads, dk, nt, C=c, BKS=bks, RKP=rkp, RAB=r_ab,
                RAP=rap, SCALAR=scalar, **prec, **gram_diag, DIRS=dirs, num_warps=cfg["warps_block"])
        if levels_pass:
            _gram_levels_kernel[(nt, bh_all, nb)](
                *grams_in, defer["gram"], paths["gram"], *hdla_ab_inputs, dk, nt, offsets("g", 0), C=c, BKS=bks,
                RKP=rkp, RAB=r_ab, RAP=rap, F32=f32, **gram_diag, DIRS=dirs, **rebuild_ab, num_warps=cfg["warps_block"])
        hv = lambda t, trans=False: _v(t, dk, dv, trans)  # noqa: E731  h, ds: [K, V] per chunk
        if r_ab:
            _inverse_kernel[grid](z["lab"], z["tm"], z["tm16"], nt, C=c, RAP=rap, F32=f32, T16=z["tm16"].numel() > 0,
                                  num_warps=cfg["warps_block"])
            gemm(z["w"], ra, dk, [(_v(tm, ra, ra), _v(z["bh"], ra, dk), ra, 1)])
            gemm(z["u"], ra, rk, [(_v(tm, ra, ra), _v(z["lkb"], ra, rk), ra, 1)])
            run_products()
            gemm(z["mo"], c, rk, [(_v(z["mqa"], c, ra), _v(z["u"], ra, rk), ra, -1)], cin=z["mqk"])
            gemm(z["et"], rk, dk, [(_v(z["u"], ra, rk, True), _v(at, ra, dk), ra, -1)], cin=z["kt"])
            mo, et = z["mo"], z["et"]
        else:
            mo, et = z["mqk"], z["kt"]
        if state_inputs is not None and r_ab:
            gemm(state_inputs["Qeff"], c, dk, [(_v(z["mqa"], c, ra), _v(z["w"], ra, dk), ra, -1)], cin=qh)
            gemm(state_inputs["N"], dk, dk, [(_v(at, ra, dk, True), _v(z["w"], ra, dk), ra, 1)])
        run_products()
        if with_state_pass:
            state_pass(dict(N=state_inputs["N"], Qeff=state_inputs["Qeff"], gamma=gamma, chunk=c))
        gemm(z["dqe"], c, dk, [(_v(z["dos"], c, dv), hv(h, True), dv, 1)])
        gemm(z["dmo"], c, rk, [(_v(z["dos"], c, dv), _v(z["vf"], rk, dv, True), dv, 1)], mask=True)
        gemm(z["det"], rk, dk, [(_v(z["vf"], rk, dv), hv(ds, True), dv, 1)])
        dvs = (z["dvs"], rk, dv, [(_v(mo, c, rk, True), _v(z["dos"], c, dv), c, 1), (_v(et, rk, dk), hv(ds), dk, 1)])
        if r_ab:
            gemm(z["dn"], dk, dk, [(hv(ds), hv(h, True), dv, -1)])
        else:
            gemm(*dvs)
        run_products()
        if r_ab:  # S4_LAUNCHES: dAt, dU, dW, dM_QA; dW', dU', dV; dL_AB
            gemm(z["dat"], ra, dk, [(_v(z["u"], ra, rk), _v(z["det"], rk, dk), rk, -1),
                                    (_v(z["w"], ra, dk), _v(z["dn"], dk, dk, True), dk, 1)])
            gemm(z["du"], ra, rk, [(_v(at, ra, dk), _v(z["det"], rk, dk, True), dk, -1),
                                   (_v(z["mqa"], c, ra, True), _v(z["dmo"], c, rk), c, -1)])
            gemm(z["dw"], ra, dk, [(_v(at, ra, dk), _v(z["dn"], dk, dk), dk, 1),
                                   (_v(z["mqa"], c, ra, True), _v(z["dqe"], c, dk), c, -1)])
            gemm(z["dmqa"], c, ra, [(_v(z["dqe"], c, dk), _v(z["w"], ra, dk, True), dk, -1),
                                    (_v(z["dmo"], c, rk), _v(z["u"], ra, rk, True), rk, -1)])
            run_products()
            gemm(z["dwp"], ra, dk, [(_v(tm, ra, ra, True), _v(z["dw"], ra, dk), ra, 1)])
            gemm(z["dup"], ra, rk, [(_v(tm, ra, ra, True), _v(z["du"], ra, rk), ra, 1)])
            gemm(*dvs)
            run_products()
            gemm(z["dlab"], ra, ra, [(_v(z["dwp"], ra, dk), _v(z["w"], ra, dk, True), dk, -1),
                                     (_v(z["dup"], ra, rk), _v(z["u"], ra, rk, True), rk, -1)])
            run_products()
        ranks_of = dict(q=1, k=rkp, a=rap, b=rap)
        if single_gram:  # S5a as one launch through HDLA's base Grams, into the same buffers and flags
            _hdla_gram_vjp_kernel[(nt, bh_all, nb * nkt)](
                z["dmo"], z["dmqa"], z["dlab"], z["dup"], z["xq"], z["kf"], z["gs"], z["gps"], z["s"], z["bt"],
                z["gq"], z["gk"], z["ga"], z["gb"], defer["gram_vjp"],
                paths["gram_vjp"] if diag_paths is not None else empty, dk, nt, nkt, blocks * nb * nkt, C=c,
                BKS=cfg["BKV"], **prec, DM=diag_lowp(lowp, vjp_names[0]), DL=diag_lowp(lowp, vjp_names[2]),
                DIAG_LIMIT=limit, RECORD=diag_paths is not None, DIRS=dirs, num_warps=cfg["warps_block"])
        for gid, (d, x, xg, y, gx, gy, strict, acc_x, acc_y) in enumerate(GRAM_VJPS[:0 if single_gram else
                                                                                   4 if r_ab else 1]):
            _gram_vjp_kernel[(nt, bh_all, nb * nkt)](
                z[d], z[STACK_OF[x]], z[xg], z[STACK_OF[y]], z["gs"], z[gx], z[gy],
                defer["gram_vjp"][gid] if levels_pass else empty, paths["gram_vjp"][gid], dk, nt, nkt, C=c,
                RX=ranks_of[x], RY=ranks_of[y], STRICT=strict, BKS=cfg["BKV"], SCALAR=scalar, **prec,
                **dict(diag, DLOWP=diag_lowp(lowp, vjp_names[gid])),
                BIDIR_QK=dirs == 2 and gid == 0, ACC_X=acc_x, ACC_Y=acc_y, num_warps=cfg["warps_block"])
        gv = [z[n] if z[n].numel() else empty for n in ("gq", "gk", "ga", "gb")]
        if levels_pass:
            _gram_vjp_levels_kernel[(nt, bh_all, nb)](
                z["dmo"], z["dmqa"], z["dlab"], z["dup"], z["xq"], z["kf"], z["af"], z["bf"], z["gs"], z["gps"], *gv,
                defer["gram_vjp"], paths["gram_vjp"] if diag_paths is not None else empty, dk, nt, nkt,
                blocks * nb * nkt, C=c, BKS=cfg["BKV"], NKTP=_pow2(nkt), RKP=rkp, RAB=r_ab, RAP=rap, F32=f32, **diag,
                DIRS=dirs, num_warps=cfg["warps_block"])
        _vjp_kernel[(nt, bh_all, nkt)](
            k, g, beta if hdla else empty, h, ds, z["gs"], z["gps"], z["s"], z["xq"], z["kf"], z["kt"],
            z["af"], z["bf"], z["at"], z["bh"], z["dqe"], z["det"], z["dat"], z["dwp"], *gv, dq, dk_,
            da if da is not None else empty, db if db is not None else empty, dg, red,
            seq_len, heads, dk, dv, nt, nkt, float(scale), offsets("g", 0), offsets("hdla_beta", 0),
            step(q), step(k), step(a), step(b), step(g), C=c, BKS=cfg["BKV"], BVS=cfg["BVS"], **ranks,
            HDLA=hdla, SCALAR=scalar, REVERSE=rev, **prec, LOG_ZERO=LOG_ZERO_FP32, DIRS=dirs,
            num_warps=cfg["warps_vjp"], num_stages=cfg["stages_vjp"])
        if hdla or scalar:  # S6 with S7
            _reduce_kernel[(nt, bh_all, nkt if hdla else 1)](
                k, g, beta if hdla else empty, z["s"], red, dk_, dg, dbeta if hdla else empty, z["dvs"], dv_, seq_len,
                heads, dk, nt, nkt, dv, offsets("k", 0), offsets("g", 0), offsets("hdla_beta", 0), step(k), step(g),
                step(beta), step(v), C=c, BKS=cfg["BKV"], HDLA=hdla, REVERSE=rev, LOG_ZERO=LOG_ZERO_FP32, DIRS=dirs,
                RP=rkp, R=r_kv, BD=cfg["BVS"], num_warps=4)
        else:
            _unstack_kernel[grid](z["dvs"], dv_, seq_len, heads, dv, nt, step(v), C=c, RP=rkp, R=r_kv, BD=cfg["BVS"],
                                  REVERSE=rev, DIRS=dirs, num_warps=4)

    launch(state_pass is not None)
    if stages is not None:
        stages.append(lambda: launch(False))
    return dq, dk_, dv_, da, db, dbeta, dg


def _state_inputs(q, dk, nt, c, r_ab, dirs) -> dict:
    """B1's inputs as B2 forms them (:func:`chunk_vjp`'s ``state_pass``): Qh fp32 (Qeff itself at
    r_ab = 0), Qeff and N in q's dtype if 16-bit (as the forward's F1 stores them), gamma fp32; with
    ``dirs = 2`` both directions' (``2B`` batches, as h and ds)."""
    batch, heads = dirs * q.shape[0], q.shape[2]
    store = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    dev = q.device
    qh = torch.empty(batch, heads, nt * c, dk, device=dev, dtype=torch.float32)
    return dict(Qh=qh, gamma=torch.empty(batch, heads, nt, dk, device=dev, dtype=torch.float32),
                Qeff=torch.empty(batch, heads, nt * c, dk, device=dev, dtype=store) if r_ab else qh,
                N=torch.empty(batch, heads, nt, dk, dk, device=dev, dtype=store) if r_ab else None)
