"""Two-level scan of the chunk64 state passes (kernels/README.md §8 "Few programs";
design/KERNELS.md point 6).

F2 (forward) and B1 (backward) both walk an affine chain over the chunks, one program per (V block,
head), with a carried [K, BV] tile X:

    X <- gamma_c (.) X - op(N_c) X + R_c        (F2: op(N) = N, R = Cc, scan order;
                                                 B1: op(N) = N^T, R = Qeff^T dO, chunks last to first)

storing the X entering each step. When B*H*V/BV is a few programs per SM the GPU idles, and the
chain is NT dependent products long. The maps compose (design/KERNELS.md 6):

    (g2, N2, R2) o (g1, N1, R1) = (g2 g1,  diag(g2) N1 + N2 diag(g1) - N2 N1,  g2 (.) R1 - N2 R1 + R2)

so with the chunks cut into NG groups of GS consecutive steps the chain runs in three launches:
  1. ``group_compose_kernel`` (grid (V/BV + K/BV, NG, B*H), parallel): per group, R_g by running the
     group's steps from X = 0 (column blocks < V/BV), op(N)_g by the composition rule applied one step
     at a time, N <- gamma_c (.) N - op(N_c) N + op(N_c) diag(gamma_acc) (column blocks >= V/BV; the
     same step with op(N_c)'s columns scaled by the product of the group's earlier gammas as R), and
     gamma_g (the product of the group's gammas, exact in fp32, kept apart from N_g);
  2. ``group_walk_kernel`` (grid (V/BV, B*H), serial over NG groups): X_in(g+1) = gamma_g (.) X_in(g)
     - N_g X_in(g) + R_g from the initial X, and the final X;
  3. ``group_expand_kernel`` (grid (V/BV, NG, B*H), parallel): each group re-runs its steps from its
     entering X and stores the X entering each chunk.
The critical path is 2 GS + NG dependent products instead of NT. gamma (.) X stays an exact fp32
elementwise term everywhere; a 16-bit N_c multiplies X split as hi + lo in N_c's dtype (as F2), and
the composite N_g (fp32 in stage 1) is stored as hi + lo in N_c's dtype and multiplies X split likewise
(three 16-bit products: N_g and X to ~2^-16); fp32 inputs take exact fp32 products throughout. Every step is the one-level step, so the stored states agree with
the one-level pass to fp32 rounding.

:func:`state_pass_groups` picks NG (1 = the one-level kernels); ``$HDLA_VISION_STATE_GROUPS`` forces
it (tests run the interpreter with 2 and 3 groups). K > 128 always takes the one-level kernels (a
[K, K] fp32 tile of N_g per program would not fit the registers).
"""
import functools
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from ..utils import cdiv, next_power_of_2

GROUPS_ENV = "HDLA_VISION_STATE_GROUPS"
MAX_TWO_LEVEL_K = 128


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _op_n_tile(n_ptr, off, rows, cols, K, valid, TRANS: tl.constexpr):
    """Tile [len(rows), len(cols)] of op(N) = N or N^T, N row-major [K, K] at ``n_ptr + off``; zero
    where out of range or not ``valid`` (a step past the last chunk)."""
    mask = (rows < K)[:, None] & (cols < K)[None, :] & valid
    if TRANS:
        ptrs = n_ptr + off + cols[None, :] * K + rows[:, None]
    else:
        ptrs = n_ptr + off + rows[:, None] * K + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _n_times(n_mat, x, F32: tl.constexpr):
    """n_mat @ x, x fp32: exact fp32 (F32), else n_mat is 16-bit and x = hi + lo in its dtype (F2's split)."""
    if F32:
        out = tl.dot(n_mat, x, input_precision="ieee")
    else:
        x_hi = x.to(n_mat.dtype)
        x_lo = (x - x_hi.to(tl.float32)).to(n_mat.dtype)
        out = tl.dot(n_mat, x_hi) + tl.dot(n_mat, x_lo)
    return out


@triton.jit
def _split_times(n_hi, n_lo, x):
    """(n_hi + n_lo) @ x for a composite N stored as hi + lo in a 16-bit dtype and x fp32 split likewise:
    three 16-bit products (the lo x lo term is below fp32 rounding), N and x to ~2^-16."""
    x_hi = x.to(n_hi.dtype)
    x_lo = (x - x_hi.to(tl.float32)).to(n_hi.dtype)
    return tl.dot(n_hi, x_hi) + tl.dot(n_hi, x_lo) + tl.dot(n_lo, x_hi)


@triton.jit
def _chunk_of(step, NT, REV: tl.constexpr):
    """Chunk index of scan step ``step`` (chunks last to first when REV), clamped in range."""
    if REV:
        c = NT - 1 - step
    else:
        c = step
    return tl.minimum(tl.maximum(c, 0), NT - 1)


@triton.jit
def _chain_step(x, n_ptr, r_ptr, gamma_ptr, blk, rows, cols, K, V, valid,
                USE_N: tl.constexpr, TRANS: tl.constexpr, F32: tl.constexpr, BK: tl.constexpr):
    """One step X <- gamma (.) X - op(N) X + R of chunk ``blk`` (flat (b*H + h)*NT + c, int64) on the
    [BK, BV] tile of columns ``cols``; the identity when not ``valid``."""
    kmask = rows < K
    smask = kmask[:, None] & (cols < V)[None, :] & valid
    gam = tl.load(gamma_ptr + blk * K + rows, mask=kmask & valid, other=1.0)
    r = tl.load(r_ptr + blk * K * V + rows[:, None] * V + cols[None, :], mask=smask, other=0.0)
    nxt = gam[:, None] * x + r
    if USE_N:
        n_mat = _op_n_tile(n_ptr, blk * K * K, rows, tl.arange(0, BK), K, valid, TRANS)
        nxt -= _n_times(n_mat, x, F32)
    return nxt


# ----------------------------------------------------------------------------- kernels
@triton.jit
def group_compose_kernel(n_ptr, r_ptr, gamma_ptr, ng_ptr, rg_ptr, gg_ptr, NT, GS, NG, K, V, N_VB,
                         BK: tl.constexpr, BV: tl.constexpr, USE_N: tl.constexpr, TRANS: tl.constexpr,
                         REV: tl.constexpr, F32: tl.constexpr):
    """Stage 1 for one (column block, group, head): R_g[:, cols] (column blocks < N_VB; the first also
    stores gamma_g) or op(N)_g[:, cols] (column blocks >= N_VB; module docstring). Outputs: ng
    [B*H, NG, K, K] op(N)_g row-major in fp32 (F32), else [B*H, NG, 2, K, K] its hi and lo parts in
    N's 16-bit dtype; rg [B*H, NG, K, V] and gg [B*H, NG, K] fp32."""
    i_col = tl.program_id(0)
    grp = tl.program_id(1)
    bh = tl.program_id(2)
    rows = tl.arange(0, BK)
    kmask = rows < K
    x = tl.zeros([BK, BV], dtype=tl.float32)
    g_out = (bh * NG + grp).to(tl.int64)
    if i_col < N_VB:
        cols = i_col * BV + tl.arange(0, BV)
        g_rows = tl.full([BK], 1.0, tl.float32)  # gamma_g, the product of the group's gammas
        for j in range(GS):
            step = grp * GS + j
            valid = step < NT
            blk = (bh * NT + _chunk_of(step, NT, REV)).to(tl.int64)
            x = _chain_step(x, n_ptr, r_ptr, gamma_ptr, blk, rows, cols, K, V, valid, USE_N, TRANS, F32, BK)
            g_rows *= tl.load(gamma_ptr + blk * K + rows, mask=kmask & valid, other=1.0)
        tl.store(rg_ptr + g_out * K * V + rows[:, None] * V + cols[None, :], x,
                 mask=kmask[:, None] & (cols < V)[None, :])
        if i_col == 0:
            tl.store(gg_ptr + g_out * K + rows, g_rows, mask=kmask)
    else:
        cols = (i_col - N_VB) * BV + tl.arange(0, BV)
        cmask = cols < K
        g_cols = tl.full([BV], 1.0, tl.float32)  # product of the group's gammas so far, at cols
        for j in range(GS):
            step = grp * GS + j
            valid = step < NT
            blk = (bh * NT + _chunk_of(step, NT, REV)).to(tl.int64)
            gam = tl.load(gamma_ptr + blk * K + rows, mask=kmask & valid, other=1.0)
            n_full = _op_n_tile(n_ptr, blk * K * K, rows, tl.arange(0, BK), K, valid, TRANS)
            n_cols = _op_n_tile(n_ptr, blk * K * K, rows, cols, K, valid, TRANS)
            x = gam[:, None] * x - _n_times(n_full, x, F32) + n_cols.to(tl.float32) * g_cols[None, :]
            g_cols *= tl.load(gamma_ptr + blk * K + cols, mask=cmask & valid, other=1.0)
        n_off = rows[:, None] * K + cols[None, :]
        nmask = kmask[:, None] & cmask[None, :]
        if F32:
            tl.store(ng_ptr + g_out * K * K + n_off, x, mask=nmask)
        else:  # hi + lo in N's 16-bit dtype, so that the walk holds no fp32 [K, K] tile
            n_hi = x.to(ng_ptr.dtype.element_ty)
            tl.store(ng_ptr + 2 * g_out * K * K + n_off, n_hi, mask=nmask)
            tl.store(ng_ptr + (2 * g_out + 1) * K * K + n_off, (x - n_hi.to(tl.float32)).to(n_hi.dtype), mask=nmask)


@triton.jit
def group_walk_kernel(ng_ptr, rg_ptr, gg_ptr, x0_ptr, xin_ptr, final_ptr, NG, K, V,
                      BK: tl.constexpr, BV: tl.constexpr, USE_N: tl.constexpr, HAS_X0: tl.constexpr,
                      F32: tl.constexpr):
    """Stage 2 for one (V block, head), serial over groups: stores the X entering each group
    (xin [B*H, NG, K, V] fp32) and the X after the last (final [B*H, K, V] fp32)."""
    i_v = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BK)
    cols = i_v * BV + tl.arange(0, BV)
    kmask = rows < K
    smask = kmask[:, None] & (cols < V)[None, :]
    s_off = rows[:, None] * V + cols[None, :]
    if HAS_X0:
        x = tl.load(x0_ptr + bh.to(tl.int64) * K * V + s_off, mask=smask, other=0.0).to(tl.float32)
    else:
        x = tl.zeros([BK, BV], dtype=tl.float32)
    for grp in range(NG):
        g_out = (bh * NG + grp).to(tl.int64)
        tl.store(xin_ptr + g_out * K * V + s_off, x, mask=smask)
        gam = tl.load(gg_ptr + g_out * K + rows, mask=kmask, other=1.0)
        nxt = gam[:, None] * x + tl.load(rg_ptr + g_out * K * V + s_off, mask=smask, other=0.0)
        if USE_N:
            n_off = rows[:, None] * K + rows[None, :]
            nmask = kmask[:, None] & kmask[None, :]
            if F32:
                nxt -= tl.dot(tl.load(ng_ptr + g_out * K * K + n_off, mask=nmask, other=0.0), x,
                              input_precision="ieee")
            else:
                n_hi = tl.load(ng_ptr + 2 * g_out * K * K + n_off, mask=nmask, other=0.0)
                n_lo = tl.load(ng_ptr + (2 * g_out + 1) * K * K + n_off, mask=nmask, other=0.0)
                nxt -= _split_times(n_hi, n_lo, x)
        x = nxt
    tl.store(final_ptr + bh.to(tl.int64) * K * V + s_off, x, mask=smask)


@triton.jit
def group_expand_kernel(n_ptr, r_ptr, gamma_ptr, xin_ptr, out_ptr, NT, GS, NG, K, V,
                        BK: tl.constexpr, BV: tl.constexpr, USE_N: tl.constexpr, TRANS: tl.constexpr,
                        REV: tl.constexpr, F32: tl.constexpr):
    """Stage 3 for one (V block, group, head): from the group's entering X, stores the X entering each
    of its chunks (out [B*H, NT, K, V] in out's dtype, indexed by chunk)."""
    i_v = tl.program_id(0)
    grp = tl.program_id(1)
    bh = tl.program_id(2)
    rows = tl.arange(0, BK)
    cols = i_v * BV + tl.arange(0, BV)
    smask = (rows < K)[:, None] & (cols < V)[None, :]
    s_off = rows[:, None] * V + cols[None, :]
    x = tl.load(xin_ptr + (bh * NG + grp).to(tl.int64) * K * V + s_off, mask=smask, other=0.0)
    for j in range(GS):
        step = grp * GS + j
        valid = step < NT
        blk = (bh * NT + _chunk_of(step, NT, REV)).to(tl.int64)
        tl.store(out_ptr + blk * K * V + s_off, x.to(out_ptr.dtype.element_ty), mask=smask & valid)
        if j < GS - 1:  # the group's last step is the next group's entering X, already known
            x = _chain_step(x, n_ptr, r_ptr, gamma_ptr, blk, rows, cols, K, V, valid, USE_N, TRANS, F32, BK)


# ----------------------------------------------------------------------------- host side
@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sm_count(device: torch.device) -> Optional[int]:
    """Streaming multiprocessors of a CUDA device; None elsewhere (CPU under the interpreter)."""
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def forced_groups() -> Optional[int]:
    """``$HDLA_VISION_STATE_GROUPS`` as a positive int, or None when unset or empty (ValueError otherwise)."""
    raw = os.environ.get(GROUPS_ENV, "")
    if not raw:
        return None
    try:
        groups = int(raw)
    except ValueError:
        groups = 0
    if groups < 1:
        raise ValueError(f"{GROUPS_ENV}={raw!r} must be a positive integer (unset: the launcher's rule)")
    return groups


# Dependent chunk steps the two extra launches of the two-level scan cost (measured on an H100,
# tools/device_two_level.sh, 2026-11-24); below this saving the one-level pass is faster.
TWO_LEVEL_MIN_SAVED_STEPS = 96


def state_pass_groups(programs: int, n_chunks: int, n_sm: Optional[int], dk: int = 64,
                      groups: Optional[int] = None) -> int:
    """Groups of chunks for F2 / B1 (1 = the one-level kernels).

    ``groups`` (an argument, e.g. a benchmark's ``--groups``) or ``$HDLA_VISION_STATE_GROUPS`` force a
    number (capped at ``n_chunks``). Otherwise, with ``programs`` = B*H*V/BV one-level programs on
    ``n_sm`` SMs (None: not a GPU, 1 group): NG groups run NG times the programs and a critical path
    of ~2 NT/NG + NG dependent steps (least at NG = sqrt(2 NT)), so NG = min(4 n_sm / programs,
    sqrt(2 NT)) rounded down to a power of two, used only when it saves at least
    ``TWO_LEVEL_MIN_SAVED_STEPS`` steps: the two extra launches cost about that many (H100: one step
    ~1.1 us, the two-level overhead ~0.1 ms; B1 at (8, 4096, 3, 64), NT = 64, took 0.078 ms on one
    level and 0.13-0.15 ms on 8-16 groups). K > 128: 1.
    """
    if dk > MAX_TWO_LEVEL_K:
        return 1
    if groups is None:
        groups = forced_groups()
    if groups is not None:
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        return max(1, min(groups, n_chunks))
    if n_sm is None:
        return 1
    groups = min((4 * n_sm) // max(programs, 1), math.isqrt(2 * n_chunks))
    if groups < 2:
        return 1
    groups = 1 << (groups.bit_length() - 1)
    saved = n_chunks - (2 * cdiv(n_chunks, groups) + groups)
    return groups if saved >= TWO_LEVEL_MIN_SAVED_STEPS else 1


def two_level_chain(n_mat: Optional[torch.Tensor], rhs: torch.Tensor, gamma: torch.Tensor,
                    x0: Optional[torch.Tensor], out: torch.Tensor, final: torch.Tensor, groups: int, bv: int,
                    trans: bool, reverse: bool, lowp: int, num_warps: int = 4) -> None:
    """Run the chain X <- gamma_c (.) X - op(N_c) X + R_c over the chunks in ``groups`` groups.

    Args: n_mat ``[B, H, NT, K, K]`` (None: no N, rank 0), rhs R ``[B, H, NT, K, V]`` fp32, gamma
        ``[B, H, NT, K]`` fp32, x0 ``[B, H, K, V]`` or None (zeros), all contiguous; trans: op(N) = N^T;
        reverse: chunks last to first; lowp: 0 fp32, 1 bf16, 2 fp16 (the inputs' dtype; n_mat is then
        16-bit); bv: columns per program.
    Writes out ``[B, H, NT, K, V]`` (the X entering each chunk, in out's dtype) and final ``[B, H, K, V]``
    fp32 (the X after the last step)."""
    batch, heads, n_chunks, dk, dv = rhs.shape
    steps = cdiv(n_chunks, groups)
    n_groups = cdiv(n_chunks, steps)
    bh = batch * heads
    bk = max(16, next_power_of_2(dk))
    n_vb = cdiv(dv, bv)
    use_n = n_mat is not None
    n_kb = cdiv(dk, bv) if use_n else 0
    f32 = dict(device=rhs.device, dtype=torch.float32)
    ng = torch.empty(bh * n_groups * dk * dk * (2 if lowp else 1) if use_n else 1, device=rhs.device,
                     dtype=n_mat.dtype if use_n and lowp else torch.float32)
    rg = torch.empty(bh * n_groups * dk * dv, **f32)
    gg = torch.empty(bh * n_groups * dk, **f32)
    xin = torch.empty(bh * n_groups * dk * dv, **f32)
    n_in = n_mat if use_n else rhs
    tiles = dict(BK=bk, BV=bv, USE_N=use_n, num_warps=num_warps)
    chain = dict(TRANS=trans, REV=reverse, F32=lowp == 0, **tiles)
    group_compose_kernel[(n_vb + n_kb, n_groups, bh)](n_in, rhs, gamma, ng, rg, gg, n_chunks, steps, n_groups,
                                                      dk, dv, n_vb, **chain)
    group_walk_kernel[(n_vb, bh)](ng, rg, gg, x0 if x0 is not None else rg, xin, final, n_groups, dk, dv,
                                  HAS_X0=x0 is not None, F32=lowp == 0, **tiles)
    group_expand_kernel[(n_vb, n_groups, bh)](n_in, rhs, gamma, xin, out, n_chunks, steps, n_groups, dk, dv,
                                              **chain)
