"""Backward of the chunk algorithm (issue 11; notation of kernels/README.md §8 and the float64
specification ``tests/chunk_bwd_reference.py``, which these kernels follow stage by stage).

Per batch b, head h and chunk c (scan order, C tokens; t = p or T-1-p when reverse):

    O_c = Qeff_c S_{c-1} + Mo_c Vbar_c,     S_c = gamma_c (.) S_{c-1} - N_c S_{c-1} + Cc_c

B1 (``_bwd_state_kernel``, grid V/BV x B*H, serial over chunks): the cotangent of the state leaving
each chunk, dS_{c-1} = gamma (.) dS_c - N_c^T dS_c + Qeff_c^T dO_c, stored per chunk, and dh0. With
few programs it runs as a two-level scan over groups of chunks (``b1_two_level``, two_level.py).
It runs between B2's stages: those that need no dS (stacks, Grams, T, W, U, Mo, E) also form N_c, Qeff_c
and gamma_c, so the backward does not run the forward's F1 a second time.

B2 (``bwd_chunk.chunk_vjp``, no atomics, no walk across chunks): the chunk VJP given S_{c-1} (the
forward's h) and dS_c, as small launches through per-chunk scratch: the stacks and cumsums, the Gram
matrices per 16-token row block (off-diagonal blocks one product through the reference G at the
column block's last token, both factors <= 1; the diagonal block exactly, token by token),
T = (I + L_AB)^-1, every plain product of the VJP as a strided batched matmul (W = T Bh, U = T L_KB,
Mo, E, dQeff, dMo, dE, dN, dV, dAt, dU, dW, dM_QA, T^T dW, T^T dU, dL_AB), then per K tile and
16-token block the Gram VJPs, the decays' chain rule, dq, dk, da, db and dg as the chunk-local reverse
cumsum of the dG / dG' cotangents; HDLA adds the chain rule through A = [beta u, k],
B = [k, beta u - beta^2 s k], u = exp(g) k, s = k.u (its full-K sums in a last small launch).

Flat rank rows are token-major, rank fastest (row t*RP + j; RP = rank padded to a power of 2,
padded rows are zero). g is clamped at LOG_ZERO_FP32 as loaded, dg = 0 below it.
"""

import os

import torch
import triton
import triton.language as tl

from . import fwd, two_level
from .bwd_chunk import check_diag_limit, chunk_vjp, scratch_bytes_per_block
from .directions import scan_time, split_direction
from ..utils import cdiv, next_power_of_2

SUB = 16  # token sub-block of the exact decays
# B2's scratch per launch; larger batches run in slices (scratch_batch_slices). On the H100 the fused
# bidirectional op's peak at the training batches of 224 / 512 / 1024 px fell from 4.8 / 5.5 / 5.5 GB to
# 1.8 / 2.1 / 2.2 GB for 5-6% more time at 2048 MiB; at 1024 MiB 1024 px took twice as long (B1's serial
# pass runs once per slice, then five slices): benchmarks/results/b2_scratch_slices_h100. Since the scratch
# is carved from a lifetime-planned pool (bwd_chunk.allocate_scratch, and per-stack Gram VJP buffers: 61% of the bytes for HDLA at d = 64)
# 1024 MiB gives the vision batches of 512-2048 px the slice counts 2048 MiB gave them before (3, 3, 2)
# with about 60% of the transient.
SCRATCH_BUDGET_MIB = 1024
SCRATCH_BUDGET_ENV = "HDLA_VISION_B2_SCRATCH_MIB"


@triton.jit
def _mm(a, b, LOWP: tl.constexpr):
    """a @ b, fp32 accumulate: operands in the input's 16-bit dtype, bf16 (LOWP 1) or fp16 (LOWP 2),
    or exact fp32 (LOWP 0). fp16 inputs keep fp16 operands: N, Qeff and dO arrive in fp16 and dS is
    stored in fp16, so the cast adds no range loss, and bf16 would drop 3 mantissa bits."""
    if LOWP == 1:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif LOWP == 2:
        out = tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def _token_offsets(c, C: tl.constexpr, T, H, i_b, i_h, REVERSE, DIRS: tl.constexpr):
    """Token slots of chunk c: (memory index ((b*T + t)*H + h) as int64 [C], valid [C]); the scan map of
    directions.py."""
    t, valid = scan_time(c * C + tl.arange(0, C), T, C, REVERSE, DIRS)
    t = tl.where(valid, t, 0)
    return ((i_b * T + t) * H + i_h).to(tl.int64), valid


@triton.jit
def _state_block_step(ds_i, ds_j, n_ptr, n_off, i0, j0, gam_ptr, g_off, qe_i, do, ck, mk_i, mk_j, K,
                      TWO: tl.constexpr, LOWP: tl.constexpr, USE_N: tl.constexpr):
    """One K block i of dS_{c-1} = gamma (.) dS_c - N^T dS_c + Qeff^T dO: ``ds_i`` (rows i0 ..) and,
    when the state is split in two K blocks (TWO), ``ds_j`` (rows j0 ..) of dS_c; N^T's block (i, i)
    and (i, j) are loaded from ``n_ptr + n_off`` (row-major [K, K]). Rank 0 (not USE_N) has no N."""
    rows_i = i0 + ck
    gam = tl.load(gam_ptr + g_off + rows_i, mask=mk_i, other=0.0)
    out = gam[:, None] * ds_i + _mm(tl.trans(qe_i), do, LOWP)
    if USE_N:
        n_ii = tl.load(n_ptr + n_off + rows_i[:, None] * K + rows_i[None, :], mask=mk_i[:, None] & mk_i[None, :],
                       other=0.0)
        out -= _mm(tl.trans(n_ii), ds_i, LOWP)
    if TWO and USE_N:
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
    REVERSE: tl.constexpr, HAS_DHT: tl.constexpr, LOWP: tl.constexpr, USE_N: tl.constexpr, DIRS: tl.constexpr,
):
    """B1: dS_{c-1} = gamma_c (.) dS_c - N_c^T dS_c + Qeff_c^T dO_c, from the last chunk to the first
    (rank 0, not USE_N: no N term).
    Stores ds[b, h, c] = dS_c (the cotangent of the state leaving chunk c, in ds's dtype: the input
    dtype) and dh0 (fp32); the carried dS stays fp32. The state's K rows are one block of BK rows, or
    two (TWO, K = 2 BK: K = 256) so that no [K, K] tile of N is ever held: four [BK, BK] blocks.
    DIRS = 2: both directions (directions.py) read the one dO, each through its own token map."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    if DIRS == 2:
        d, i_b, REVERSE = split_direction(i_bh, H, tl.num_programs(1))
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
        tok, valid = _token_offsets(c, C, T, H, i_b, i_h, REVERSE, DIRS)
        do = tl.load(do_ptr + tok[:, None] * V + cv[None, :], mask=valid[:, None] & mv, other=0.0)
        q_rows = (bh64 * NT * C + c * C + ct)[:, None] * K
        qe0 = tl.load(qeff_ptr + q_rows + ck[None, :], mask=mk0[None, :], other=0.0)
        new0 = _state_block_step(ds0, ds1, n_ptr, blk * K * K, 0, BK, gamma_ptr, blk * K, qe0, do, ck, mk0, mk1,
                                 K, TWO, LOWP, USE_N)
        if TWO:
            qe1 = tl.load(qeff_ptr + q_rows + (BK + ck)[None, :], mask=mk1[None, :], other=0.0)
            ds1 = _state_block_step(ds1, ds0, n_ptr, blk * K * K, BK, 0, gamma_ptr, blk * K, qe1, do, ck, mk1, mk0,
                                    K, TWO, LOWP, USE_N)
        ds0 = new0
    tl.store(dh0_ptr + bh64 * K * V + off0, ds0, mask=mk0[:, None] & mv)
    if TWO:
        tl.store(dh0_ptr + bh64 * K * V + off1, ds1, mask=mk1[:, None] & mv)


@triton.jit
def _bwd_rhs_kernel(qeff_ptr, do_ptr, rhs_ptr, T, H, K, V, NT,
                    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr, LOWP: tl.constexpr,
                    DIRS: tl.constexpr):
    """B1's inhomogeneous term for the two-level scan, per (chunk, V block, head), in parallel:
    rhs[b, h, c] = Qeff_c^T dO_c (fp32 [K, V]; the same product the one-level B1 forms in its loop).
    DIRS = 2: both directions, one dO (directions.py)."""
    c = tl.program_id(0)
    i_v = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    if DIRS == 2:
        d, i_b, REVERSE = split_direction(i_bh, H, tl.num_programs(2))
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mv = cv[None, :] < V
    blk = i_bh.to(tl.int64) * NT + c
    tok, valid = _token_offsets(c, C, T, H, i_b, i_h, REVERSE, DIRS)
    do = tl.load(do_ptr + tok[:, None] * V + cv[None, :], mask=valid[:, None] & mv, other=0.0)
    q_rows = (blk * C + tl.arange(0, C))[:, None] * K
    qe = tl.load(qeff_ptr + q_rows + ck[None, :], mask=(ck < K)[None, :], other=0.0)
    rhs = _mm(tl.trans(qe), do, LOWP)
    tl.store(rhs_ptr + blk * K * V + ck[:, None] * V + cv[None, :], rhs, mask=(ck < K)[:, None] & mv)


def b1_two_level(state_inputs, do, dht, ds, dh0, reverse, lowp, groups, bv, use_n=True, dirs=1):
    """B1 as a two-level scan (two_level.py) over ``groups`` groups of chunks, on ``state_inputs``
    (N, Qeff, gamma, chunk as :func:`generalized_backward` gets them): Qeff^T dO per chunk in
    parallel, then the chain dS <- gamma (.) dS - N^T dS + Qeff^T dO from the last chunk to the first
    (without the N term when not ``use_n``: rank 0). Writes ds ``[B, H, NT, K, V]`` and dh0
    ``[B, H, K, V]`` fp32 as the one-level B1 does. ``dirs = 2``: ds and dh0 hold both directions
    (``2B`` batches) and both read the one ``do [B, T, H, V]``."""
    batch, heads, n_chunks, dk, dv = ds.shape
    c = state_inputs["chunk"]
    rhs = torch.empty(batch, heads, n_chunks, dk, dv, device=ds.device, dtype=torch.float32)
    bk = max(16, next_power_of_2(dk))
    _bwd_rhs_kernel[(n_chunks, cdiv(dv, bv), batch * heads)](
        state_inputs["Qeff"].contiguous(), do, rhs, do.shape[1], heads, dk, dv, n_chunks,
        C=c, BK=bk, BV=bv, REVERSE=bool(reverse) and dirs == 1, LOWP=lowp, DIRS=dirs, num_warps=4)
    two_level.two_level_chain(state_inputs["N"].contiguous() if use_n else None, rhs,
                              state_inputs["gamma"].contiguous(),
                              dht.contiguous() if dht is not None else None, ds, dh0, groups, bv,
                              trans=True, reverse=True, lowp=lowp, num_warps=4 if bk <= 64 else 8)


def b1_config(dk: int, dv: int) -> dict:
    """B1's tiles per head dim: the state's K rows in one block (K <= 128) or two (K = 256), BV columns
    per program, warps. The one place to tune (or autotune) B1 on a device."""
    bk = max(16, next_power_of_2(dk))
    two = bk > 128
    bk = bk // 2 if two else bk
    # 16 columns at K = 128: B1 runs per batch slice (64 programs a slice at the LM shape), and 16 took it 807 -> 720
    # us there on an H200 (launch_configs b1_bv16, results/launch_configs_h200/occupancy.json); at K = 64 it lost
    # (the 1024 px batch 269 -> 355 us)
    bv = 16 if bk == 128 and not two else max(16, min(64 if bk <= 64 else 32, next_power_of_2(dv)))
    if two:  # K = 256: pipelining the four N blocks would need 316-458 KB of shared memory (AOT)
        return dict(BK=bk, BV=bv, TWO=two, num_warps=8, num_stages=1)
    return dict(BK=bk, BV=bv, TWO=two, num_warps=4 if bk * bv <= 64 * 64 else 8, num_stages=3)


def _pow2(n: int) -> int:
    return 1 if n <= 1 else next_power_of_2(n)


def forward_chunk(seq_len: int, n_chunks: int, planned: int) -> int:
    """The chunk size the forward ran with, from the number of chunks in its h: ``planned``
    (fwd.planned_chunk) when it gives that count, else the size in fwd.CHUNKS that does (the forward
    fell back to a smaller chunk). Two sizes of CHUNKS give the same count >= 2 for no T; at one chunk h
    holds only the initial state, the same for every size >= T."""
    if cdiv(seq_len, planned) == n_chunks:
        return planned
    for c in sorted(fwd.CHUNKS, reverse=True):
        if cdiv(seq_len, c) == n_chunks:
            return c
    return planned  # no size fits: the caller's check names the mismatch


def _zero_grad(x, dirs: int):
    """The gradient of an empty input (a, b at r_ab = 0): zeros of its shape, per direction when both run."""
    return torch.zeros_like(x) if dirs == 1 else x.new_zeros(2, *x.shape)


def _check(do, dht, q, k, v, a, b, g, initial_state, h, hdla_beta, dirs=1):
    """Shape checks (ValueError naming the argument) before any launch; ``dirs = 2``: dht, initial_state
    and h hold both directions (``2B`` batches)."""
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
        if x is not None and tuple(x.shape) != (dirs * batch, heads, dk, dv):
            raise ValueError(f"{name} must be [B, H, K, V] = {[dirs * batch, heads, dk, dv]}, got {list(x.shape)}")
    if h.dim() != 5 or tuple(h.shape[:2]) != (dirs * batch, heads) or tuple(h.shape[3:]) != (dk, dv):
        raise ValueError(f"h must be [B, H, NT, K, V] with B, H, K, V = {dirs * batch, heads, dk, dv}, "
                         f"got {list(h.shape)}")


def scratch_budget_bytes() -> int:
    """B2's scratch budget in bytes: :data:`SCRATCH_BUDGET_MIB` or ``$HDLA_VISION_B2_SCRATCH_MIB``
    (0: no limit, the whole batch in one launch)."""
    raw = os.environ.get(SCRATCH_BUDGET_ENV, "") or str(SCRATCH_BUDGET_MIB)
    if not raw.isdigit():
        raise ValueError(f"{SCRATCH_BUDGET_ENV} must be a whole number of MiB (0: no limit), got {raw!r}")
    return int(raw) << 20


def scratch_batch_slices(batch: int, bytes_per_batch: int, programs_per_element: int = 0,
                         resident_programs: int = 0) -> tuple:
    """Slices of the batch axis, as even as possible, whose B2 scratch (``bytes_per_batch`` per batch
    element) fits :func:`scratch_budget_bytes`, at least one element each. Each slice's backward is
    independent (B1's serial pass runs per batch and head), so the gradients are those of one launch
    while the transient scratch (tens of KB per token at chunk 64) stays bounded.

    A launch whose programs each walk the whole sequence (``programs_per_element`` per batch element,
    ``resident_programs`` of them at once on the GPU) takes as long as its number of waves, so a slice that
    leaves the GPU part-empty costs a wave: given both, the batch runs in the most slices, up to the budget's
    count, whose waves add up to one launch's (:func:`_waves`); the budget may then be exceeded."""
    budget = scratch_budget_bytes()
    # the count whose even slices (cdiv(batch, parts) elements each) fit, not cdiv(batch * bytes, budget): its
    # slices, rounded up, could exceed the budget, and each slice's own backward then sliced itself again
    # (16 elements of 180 MiB under 1 GiB: 6 + 6 + 4, then 3 + 3 twice, five launches of B2 instead of four)
    parts = 1 if budget == 0 else cdiv(batch, max(1, budget // max(1, bytes_per_batch)))
    return slices_keeping_waves(batch, parts, programs_per_element, resident_programs)


def slices_keeping_waves(batch: int, parts: int, programs_per_element: int = 0, resident_programs: int = 0) -> tuple:
    """Even slices of the batch, at most ``parts``: the most whose waves (:func:`_waves`) add up to one launch's
    where ``programs_per_element`` and ``resident_programs`` are given, else ``parts``."""
    if programs_per_element > 0 and resident_programs > 0:
        whole = _waves(batch, 1, programs_per_element, resident_programs)
        parts = next(p for p in range(parts, 0, -1)
                     if _waves(batch, p, programs_per_element, resident_programs) == whole)
    return _even_slices(batch, parts)


def _even_slices(batch: int, parts: int) -> tuple:
    per = cdiv(batch, parts)
    return tuple(slice(start, min(start + per, batch)) for start in range(0, batch, per))


def _waves(batch: int, parts: int, programs_per_element: int, resident_programs: int) -> int:
    """Waves of ``resident_programs`` the slices of :func:`_even_slices` take, one launch after another
    (all of ``per`` elements but the last)."""
    per = cdiv(batch, parts)
    count = cdiv(batch, per)
    last = batch - per * (count - 1)
    return ((count - 1) * cdiv(per * programs_per_element, resident_programs)
            + cdiv(last * programs_per_element, resident_programs))


def _batch_part(x, part: slice, batch: int, dirs: int):
    """Batch slice ``part`` of an input ``[B, ...]`` or, with ``dirs = 2``, of a direction-stacked state
    ``[2B, ...]`` (both directions' rows of the slice, forward first); None stays None."""
    if x is None:
        return None
    if dirs == 1:
        return x[part]
    return x.view(2, batch, *x.shape[1:])[:, part].flatten(0, 1)


def _join_parts(parts: list, dim: int, dirs_stacked: bool):
    """Per-slice results joined along the batch axis ``dim``; ``dirs_stacked``: ``[2b, ...]`` states of
    both directions, joined as ``[2, B, ...]`` and flattened back. None stays None."""
    if parts[0] is None:
        return None
    if dirs_stacked:
        return torch.cat([p.view(2, -1, *p.shape[1:]) for p in parts], dim=1).flatten(0, 1)
    return torch.cat(parts, dim=dim)


def _sliced_backward(parts, do, dht, q, k, v, a, b, g, scale, initial_state, h, reverse, hdla_beta, groups,
                     diag_limit, direction_strides):
    """:func:`generalized_backward` on each batch slice of ``parts`` (:func:`scratch_batch_slices`),
    the gradients joined; arguments and returns as that function's."""
    batch = q.shape[0]
    dirs = 1 if direction_strides is None else 2
    names = ("q", "k", "v", "hdla_beta", "g") if hdla_beta is not None else ("q", "k", "v", "a", "b", "g")
    results = []
    for part in parts:
        sliced = [_batch_part(x, part, batch, 1) for x in (do, q, k, v, a, b, g, hdla_beta)]
        states = [_batch_part(x, part, batch, dirs) for x in (dht, initial_state, h)]
        do_, q_, k_, v_, a_, b_, g_, beta_ = sliced
        results.append(generalized_backward(do_, states[0], q_, k_, v_, a_, b_, g_, scale, states[1], states[2],
                                            reverse, hdla_beta=beta_, groups=groups, diag_limit=diag_limit,
                                            direction_strides=direction_strides))
    stacked = [dirs == 2 and n in direction_strides for n in names]
    grads = [_join_parts(list(p), 1 if s else 0, False) for p, s in zip(list(zip(*results))[:-1], stacked)]
    return (*grads, _join_parts([r[-1] for r in results], 0, dirs == 2))


def generalized_backward(do, dht, q, k, v, a, b, g, scale, initial_state, h, reverse, hdla_beta=None,
                         stages=None, groups=None, diag_limit=None, diag_paths=None, direction_strides=None):
    """Gradients of the chunked generalized op by B1 and B2 (module docstring). A batch whose B2 scratch
    exceeds :func:`scratch_budget_bytes` runs in slices (:func:`scratch_batch_slices`; one launch when
    ``stages`` or ``diag_paths`` is given).

    Args (kernels/README.md §8): do ``[B, T, H, V]``; dht ``[B, H, K, V]`` or None; q ``[B, T, H, K]``;
        k ``[B, T, H, r_kv, K]``, v ``[B, T, H, r_kv, V]``, a, b ``[B, T, H, r_ab, K]`` (HDLA: k
        ``[B, T, H, K]``, v ``[B, T, H, V]``, a = b = None, ``hdla_beta [B, T, H]``); g ``[B, T, H, K]``
        or ``[B, T, H]``; h ``[B, H, NT, K, V]`` the states entering each chunk (the forward's);
        B1's inputs N, Qeff and gamma (``fwd.chunk_prepare``'s) come from B2's first stages
        (``bwd_chunk.chunk_vjp``'s ``state_pass``) with the chunk size the forward used
        (:func:`forward_chunk`): F1 does not run again.
        stages: a dict that, if given, receives ``b1`` and ``b2``: closures that relaunch each kernel
            with the same arguments (per-kernel timing, benchmarks/kernel_stages_bwd.py), and
            ``b1_groups``, the group count B1 ran with.
        groups: chunk groups of B1's two-level scan (two_level.py; None: its rule
            :func:`two_level.state_pass_groups` or ``$HDLA_VISION_STATE_GROUPS``; 1: one level).
        diag_limit, diag_paths: B2's bound for the factored diagonal Gram blocks (None: its default;
            0: all token by token) and, for tests, a dict that receives the path each block took
            (``bwd_chunk.chunk_vjp``).
        direction_strides: both directions in one launch (``fwd.chunk_prepare``; kernels/README.md §9):
            the inputs are the forward slices of those it names (the others shared), do ``[B, T, H, V]`` the
            cotangent of the bidirectional sum, read by both; dht, initial_state ``[2B, H, K, V]`` or
            None and h ``[2B, H, NT, K, V]`` hold both directions (forward, reversed).
    Returns:
        ``(dq, dk, dv, da, db, dg, dh0)`` (HDLA: ``(dq, dk, dv, dbeta, dg, dh0)``), each in its input's
        dtype (dg in g's shape; dh0 fp32, None without an initial state). Both directions: an input
        with a direction stride gets ``[2, *its shape]`` (each direction's gradient), a shared one the
        sum of the two directions' partials; dh0 is ``[2B, H, K, V]``.
    """
    hdla = hdla_beta is not None
    dirs = 1 if direction_strides is None else 2
    _check(do, dht, q, k, v, a, b, g, initial_state, h, hdla_beta, dirs)
    check_diag_limit(diag_limit)
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    r_ab = 2 if hdla else a.shape[3]
    r_kv = 1 if hdla else k.shape[3]
    c = forward_chunk(seq_len, h.shape[2], fwd.planned_chunk(r_ab, r_kv, dk, dv, g.dim() == 3, hdla, q.dtype))
    nt = cdiv(seq_len, c)
    if h.shape[2] != nt:
        raise ValueError(f"h has {h.shape[2]} chunks; the chunk size {c} gives {nt}")
    parts = scratch_batch_slices(batch, dirs * heads * nt * scratch_bytes_per_block(
        c, dk, dv, r_kv, r_ab, hdla, g.dim() == 3, q.dtype, v.dtype))
    if len(parts) > 1 and stages is None and diag_paths is None:
        return _sliced_backward(parts, do, dht, q, k, v, a, b, g, scale, initial_state, h, reverse, hdla_beta,
                                groups, diag_limit, direction_strides)
    lowp = {torch.bfloat16: 1, torch.float16: 2}.get(q.dtype, 0)
    dev = q.device
    if dirs == 1:
        q, k, v, g, do = (x.contiguous() for x in (q, k, v, g, do))
    else:  # the forward slices of direction-stacked inputs: contiguous already (a copy would lose the other)
        do = do.contiguous()
    ds = torch.empty(dirs * batch, heads, nt, dk, dv, device=dev, dtype=q.dtype if lowp else torch.float32)
    dh0 = torch.empty(dirs * batch, heads, dk, dv, device=dev, dtype=torch.float32)
    cfg1 = b1_config(dk, dv)
    programs = dirs * batch * heads * cdiv(dv, cfg1["BV"])
    groups = two_level.state_pass_groups(programs, nt, two_level.device_sm_count(dev), dk, groups)
    if stages is not None:
        stages["b1_groups"] = groups

    def b1(state_inputs):
        if groups > 1:
            b1_two_level(state_inputs, do, dht, ds, dh0, reverse, lowp, groups, cfg1["BV"], use_n=r_ab > 0,
                         dirs=dirs)
            return
        n_mat = state_inputs["N"].contiguous() if r_ab else state_inputs["gamma"]  # rank 0: no N (any pointer)
        _bwd_state_kernel[(cdiv(dv, cfg1["BV"]), dirs * batch * heads)](
            n_mat, state_inputs["Qeff"].contiguous(), state_inputs["gamma"].contiguous(), do,
            dht.contiguous() if dht is not None else ds, ds, dh0, seq_len, heads, dk, dv, nt,
            C=c, REVERSE=bool(reverse) and dirs == 1, HAS_DHT=dht is not None, LOWP=lowp, USE_N=r_ab > 0,
            DIRS=dirs, **cfg1)

    b1_inputs = []
    b2_runs = []
    if dirs == 1:
        a, b, hdla_beta = (None if x is None else x.contiguous() for x in (a, b, hdla_beta))
    dq, dk_, dv_, da, db, dbeta, dg = chunk_vjp(
        do, q, k, v, None if hdla else a, None if hdla else b, g, hdla_beta, h.contiguous(), ds, scale, reverse, c,
        stages=b2_runs, diag_limit=diag_limit, diag_paths=diag_paths, direction_strides=direction_strides,
        state_pass=lambda x: (b1_inputs.append(x), b1(x)))
    if stages is not None:
        stages.update(b1=lambda: b1(b1_inputs[0]), b2=b2_runs[0])
    dh0 = dh0 if initial_state is not None else None
    if not hdla and not r_ab:
        da, db = _zero_grad(a, dirs), _zero_grad(b, dirs)
    grads = (dq, dk_, dv_, dbeta, dg) if hdla else (dq, dk_, dv_, da, db, dg)
    if dirs == 2:
        names = ("q", "k", "v", "hdla_beta", "g") if hdla else ("q", "k", "v", "a", "b", "g")
        grads = tuple(x if n in direction_strides else x[0] + x[1] for n, x in zip(names, grads))
    return (*grads, dh0)
