"""HDLA as a token recurrence (one Triton program per (b, h, V-block)): the decoding step, the backward
of it, and the chunk ops' path for short sequences, in inference and in training, one direction or both in
one launch (kernels/README.md §11).

Per head and token t (paper eq. 27), with H_t = I - beta_t k_t k_t^T:

    S_t = H_t Diag(lambda_t) H_t S_{t-1} + k_t v_t^T,      o_t = scale * S_t^T q_t,   lambda_t = exp(g_t)

Each column of S evolves on its own, so a program keeps a [K, BV] block of the state in fp32 registers
and walks the tokens, loading each token's inputs one step ahead (their latency, not the arithmetic,
bounds a step). Per token the forward costs three reductions over K on that block: no chunk
intermediates and one launch, so for the forward of a few hundred tokens it beats the chunk kernels
(kernels/README.md §11 has the H100 measurements); the chunk kernels' tensor-core products win on long
sequences and in training.

Backward, per token in reverse (X = S_{t-1}, Y = dS_t the state's cotangent after o_t's read):

    a = H X,  b = lambda (.) a,  S_t = H b + k v^T
    Y += scale q do^T;   dq = scale S_t do;   dv = Y^T k
    db = H Y;   dlambda = rowsum(db (.) a);   da = lambda (.) db;   dS_{t-1} = H da
    dk = Y v - beta (Y b^T k + b Y^T k) - beta (da X^T k + X da^T k)
    dbeta = -(k^T Y)(b^T k) - (k^T da)(X^T k)

It needs S_{t-1} at every token, and HDLA's step cannot be inverted (beta = 1 is a projection, lambda
may be 0): the kernel runs the recurrence forward storing the state every CK tokens (fp32, transient
scratch), then walks back a segment at a time, recomputing each token's S_{t-1} from the segment's
checkpoint in registers (CK / 2 steps on average). Gradients that sum over V (dq, dk, dg, dbeta) are
written per V-block (fp32) and summed, with the cast to the input's dtype, by one launch for all of them
(:func:`sum_parts_grouped`).
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..generalized.bwd import scratch_batch_slices
from ..generalized.two_level import device_sm_count
from ..utils import cdiv, check_hdla_inputs, next_power_of_2, per_batch_slice


def torch_fused_recurrent_hdla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    reverse: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """PyTorch token loop with the same contract as the Triton kernel.

    Args:
        q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
        initial_state: ``[B, H, K, V]`` or None (zeros).
        reverse: scan t = T-1 .. 0.
    Returns:
        ``o [B, T, H, V]`` in q's dtype and the new state ``[B, H, K, V]`` in fp32 (float64 for
        float64 inputs).
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 if scale is None else float(scale)
    batch, seq_len, heads, dk = q.shape
    out_dtype = v.dtype
    q, k, v, beta, g = (x.to(compute) for x in (q, k, v, beta, g))
    q = q * scale
    state = q.new_zeros(batch, heads, dk, v.shape[-1])
    if initial_state is not None:
        state = state + initial_state.to(compute)
    outputs = [None] * seq_len
    for t in (range(seq_len - 1, -1, -1) if reverse else range(seq_len)):
        kt, bt = k[:, t].unsqueeze(-1), beta[:, t, :, None, None]  # [B, H, K, 1], [B, H, 1, 1]
        state = state - bt * kt * (kt * state).sum(-2, keepdim=True)
        state = g[:, t].exp().unsqueeze(-1) * state
        state = state - bt * kt * (kt * state).sum(-2, keepdim=True)
        state = state + kt * v[:, t].unsqueeze(-2)
        outputs[t] = (q[:, t].unsqueeze(-1) * state).sum(-2)
    return torch.stack(outputs, dim=1).to(out_dtype), state



@triton.jit
def _house(x, k, beta):
    """(I - beta k k^T) x for x [BK, BV], k [BK]; also returns k^T x [BV]."""
    kx = tl.sum(k[:, None] * x, axis=0)
    return x - (beta * k)[:, None] * kx[None, :], kx


@triton.jit
def _step(x, k, lam, beta, v):
    """S_t from S_{t-1} = x: H Diag(lam) H x + k v^T."""
    a, _ = _house(x, k, beta)
    s, _ = _house(lam[:, None] * a, k, beta)
    return s + k[:, None] * v[None, :]


@triton.jit
def _token(p, T, reverse):
    """Time index of scan step p: p, or T-1-p where ``reverse`` (a constexpr or a runtime 0/1)."""
    return p + reverse * (T - 1 - 2 * p)


@triton.jit
def _direction(d, T, K, V):
    """Scan direction d of a launch whose grid axis 2 is the direction (DIRS = 2): (reverse, own, rows,
    states) with reverse = d, own = 1 - d (the reversed scan leaves its own write out) and the offsets of
    direction d's part of a tensor stacked by direction: rows * X elements into a [2, B, T, H, X] one,
    states into a [2, B, H, K, V] one (grid axis 1 is B * H)."""
    rows = d.to(tl.int64) * tl.num_programs(1) * T
    return d, (1 - d).to(tl.float32), rows, d.to(tl.int64) * tl.num_programs(1) * K * V


@triton.jit
def _load_token(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, row, ck, cv, mk, mv, K, V):
    """q, k, lambda [BK], v [BV], beta (scalar) of one token in fp32; ``row`` = (b * T + t) * H + h."""
    q = tl.load(q_ptr + row * K + ck, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * K + ck, mask=mk, other=0.0).to(tl.float32)
    lam = tl.exp(tl.load(g_ptr + row * K + ck, mask=mk, other=0.0).to(tl.float32))
    v = tl.load(v_ptr + row * V + cv, mask=mv, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + row).to(tl.float32)
    return q, k, lam, v, beta


@triton.jit
def _fused_recurrent_hdla_fwd_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, h0_ptr, o_ptr, ht_ptr,
    scale, T, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr, DIRS: tl.constexpr, REVERSE: tl.constexpr, HAS_H0: tl.constexpr,
):
    """o [DIRS, B, T, H, V] and the final state ht [DIRS, B, H, K, V] (fp32). DIRS = 1: one scan
    (REVERSE); DIRS = 2: grid axis 2 is the direction, beta, g, h0 and o are stacked by direction and
    direction 1 scans t = T-1 .. 0 and leaves its own write out of its output (o_t = scale q_t^T
    (S_t - k_t v_t^T): the bidirectional ops' correction, kernels/README.md §9)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    if DIRS == 2:
        rev, own, rows, states = _direction(tl.program_id(2), T, K, V)
        beta_ptr += rows
        g_ptr += rows * K
        o_ptr += rows * V
        h0_ptr += states
        ht_ptr += states
    else:
        rev = REVERSE
        own = 1.0
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    s_off = i_bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        s += tl.load(h0_ptr + s_off, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
    row = ((i_b * T + _token(0, T, rev)) * H + i_h).to(tl.int64)
    q, k, lam, v, beta = _load_token(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, row, ck, cv, mk, mv, K, V)
    for p in range(0, T):
        row_n = ((i_b * T + _token(tl.minimum(p + 1, T - 1), T, rev)) * H + i_h).to(tl.int64)
        q_n, k_n, lam_n, v_n, beta_n = _load_token(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, row_n, ck, cv, mk, mv, K, V)
        a, _ = _house(s, k, beta)
        s, _ = _house(lam[:, None] * a, k, beta)
        o = tl.sum(q[:, None] * s, axis=0) + own * tl.sum(q * k) * v  # S_t = s + k v^T
        tl.store(o_ptr + row * V + cv, (o * scale).to(o_ptr.dtype.element_ty), mask=mv)
        s += k[:, None] * v[None, :]
        row, q, k, lam, v, beta = row_n, q_n, k_n, lam_n, v_n, beta_n
    tl.store(ht_ptr + s_off, s, mask=mk[:, None] & mv[None, :])


@triton.jit
def _fused_recurrent_hdla_bwd_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, h0_ptr, do_ptr, dht_ptr, ckpt_ptr,
    dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, dh0_ptr,
    scale, T, H, K, V, NCK,
    BK: tl.constexpr, BV: tl.constexpr, CK: tl.constexpr, DIRS: tl.constexpr, REVERSE: tl.constexpr,
):
    """Every gradient of one (batch, head, V-block). dq, dk, dg [DIRS * NV, B, T, H, K] and dbeta
    [DIRS * NV, B, T, H] are this V-block's fp32 partial sums; dv [DIRS, B, T, H, V] (dv's dtype) and dh0
    [DIRS, B, H, K, V] (fp32) are whole. ckpt [DIRS, B * H, NV, NCK, BK, BV] fp32 scratch: the state
    entering scan steps 0, CK, 2 CK, ... DIRS = 2 as the forward kernel: grid axis 2 is the direction;
    beta, g, h0, dht and the outputs are stacked by direction, q, k, v and do shared; direction 1 scans
    t = T-1 .. 0 and its output left its own write out. h0 and dht are always read (zeros where the call
    has none): both state chains then start from a load in the checkpoints' register layout (4 columns of 8
    rows per thread), which Triton keeps through the loops, so the sums over V are cheap and no [BK, BV]
    tile changes layout per token (tl.zeros would start one chain in the default layout, 1 column of 32 rows
    per thread; with it the kernel ran 2550 instead of 2245 SASS instructions per token on sm_90a)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    n_v = tl.num_programs(0)
    i_b, i_h = i_bh // H, i_bh % H
    i_d = 0
    if DIRS == 2:
        i_d = tl.program_id(2)
        rev, own, rows, states = _direction(i_d, T, K, V)
        beta_ptr += rows
        g_ptr += rows * K
        dv_ptr += rows * V
        h0_ptr += states
        dht_ptr += states
        dh0_ptr += states
        ckpt_ptr += i_d.to(tl.int64) * tl.num_programs(1) * n_v * NCK * BK * BV
    else:
        rev = REVERSE
        own = 1.0
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    ms = mk[:, None] & mv[None, :]
    s_off = i_bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    c_base = (i_bh.to(tl.int64) * n_v + i_v) * NCK * BK * BV
    c_off = ck[:, None] * BV + tl.arange(0, BV)[None, :]
    part = (i_d * n_v + i_v).to(tl.int64) * tl.num_programs(1) * T  # this block's partials: B * T * H rows each

    # 1. the recurrence forward, storing the state entering every CK-th step
    s = tl.load(h0_ptr + s_off, mask=ms, other=0.0).to(tl.float32)
    row = ((i_b * T + _token(0, T, rev)) * H + i_h).to(tl.int64)
    _, k, lam, v, beta = _load_token(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, row, ck, cv, mk, mv, K, V)
    do = tl.load(do_ptr + row * V + cv, mask=mv, other=0.0).to(tl.float32)
    for p in range(0, T):
        row_n = ((i_b * T + _token(tl.minimum(p + 1, T - 1), T, rev)) * H + i_h).to(tl.int64)
        _, k_n, lam_n, v_n, beta_n = _load_token(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, row_n, ck, cv, mk, mv, K, V)
        do_n = tl.load(do_ptr + row_n * V + cv, mask=mv, other=0.0).to(tl.float32)
        if p % CK == 0:
            tl.store(ckpt_ptr + c_base + (p // CK) * BK * BV + c_off, s)
        s = _step(s, k, lam, beta, v)
        # dq = scale (S_t - (1 - own) k v^T) do needs no cotangent of the state: it is taken on the way forward
        dq = tl.sum(s * do[None, :], axis=1) - (1.0 - own) * k * tl.sum(v * do)
        tl.store(dq_ptr + (part + row) * K + ck, dq * scale, mask=mk)
        row, k, lam, v, beta, do = row_n, k_n, lam_n, v_n, beta_n, do_n

    # 2. back through the steps, a segment of CK steps at a time
    y = tl.load(dht_ptr + s_off, mask=ms, other=0.0).to(tl.float32)
    for jj in range(0, NCK):
        j = NCK - 1 - jj
        x0 = tl.load(ckpt_ptr + c_base + j * BK * BV + c_off)
        end = tl.minimum(j * CK + CK, T)
        for ii in range(0, end - j * CK):
            p = end - 1 - ii
            row = ((i_b * T + _token(p, T, rev)) * H + i_h).to(tl.int64)
            q, k, lam, v, beta = _load_token(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, row, ck, cv, mk, mv, K, V)
            do = tl.load(do_ptr + row * V + cv, mask=mv, other=0.0).to(tl.float32)
            x = x0
            for r in range(j * CK, p):  # S_{p-1} from the segment's checkpoint
                row_r = ((i_b * T + _token(r, T, rev)) * H + i_h).to(tl.int64)
                _, k_r, lam_r, v_r, beta_r = _load_token(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, row_r, ck, cv, mk,
                                                         mv, K, V)
                x = _step(x, k_r, lam_r, beta_r, v_r)
            y = _bwd_token(y, x, row, q, k, lam, v, beta, do, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr, part, scale, own,
                           ck, cv, mk, mv, K, V)
    tl.store(dh0_ptr + s_off, y, mask=ms)


@triton.jit
def _bwd_token(y, x, row, q, k, lam, v, beta, do, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr, part, scale, own, ck, cv, mk, mv,
               K, V):
    """One scan step back (the module docstring's formulas): x = S_{t-1}, y = dS_t before o_t's read;
    stores dv and this V-block's partials of dk, dg, dbeta; returns dS_{t-1}. own = 0: the output read
    S_t - k v^T, whose extra term -scale (q.k) v adds -scale q (v.do) to dk and -scale (q.k) do to dv."""
    a, kx = _house(x, k, beta)
    b = lam[:, None] * a
    kb = tl.sum(k[:, None] * b, axis=0)
    y += (q * scale)[:, None] * do[None, :]
    db, ky = _house(y, k, beta)
    dv = ky - (1.0 - own) * scale * tl.sum(q * k) * do
    tl.store(dv_ptr + row * V + cv, dv.to(dv_ptr.dtype.element_ty), mask=mv)
    dlam = tl.sum(db * a, axis=1)
    da = lam[:, None] * db
    y, kda = _house(da, k, beta)
    dk = (tl.sum(_dk_write(db, ky, kb, v, beta, b, k) - beta * (da * kx[None, :] + x * kda[None, :]), axis=1)
          - (1.0 - own) * scale * tl.sum(v * do) * q)
    dbeta = -tl.sum(ky * kb) - tl.sum(kda * kx)
    tl.store(dk_ptr + (part + row) * K + ck, dk, mask=mk)
    tl.store(dg_ptr + (part + row) * K + ck, dlam * lam, mask=mk)
    tl.store(dbeta_ptr + part + row, dbeta)
    return y


@triton.jit
def _dk_write(db, ky, kb, v, beta, b, k):
    """The [BK, BV] terms of dk through S_t = H b + k v^T: Y v - beta (Y kb + b ky), Y = dS_t; with
    db = H Y, Y = db + beta k ky."""
    y = db + (beta * k)[:, None] * ky[None, :]
    return y * (v - beta * kb)[None, :] - beta * b * ky[None, :]


# The launch configuration, from an H100 sweep at d = 64 in bf16 (benchmarks/results/recurrent_h100/variants,
# prefetch): one warp on 16 state columns was the fastest of 8-64 columns on 1-8 warps. A checkpoint every 2
# tokens (the backward's scratch: one fp32 state per 2 tokens, within the scratch budget's slices) was the
# fastest of 1, 2, 4, 8 and 16: the backward at (512, 196, 3, 64) 5.24 ms against 5.74 (1) and 5.62 (4) on the H200
# (benchmarks/results/op_floor_h200), 4 against 8 and 16 on the H100.
CHECKPOINT_EVERY = 2
# Warps of the backward resident per SM: it takes 255 registers a thread (ncu on the H100,
# benchmarks/results/recurrent_h100/profile/ncu_recurrence_m224.txt), so 65536 / (256 * 32) = 8.
BWD_RESIDENT_WARPS_PER_SM = 8


def _config(dk: int, dv: int) -> Tuple[int, int, int]:
    """(BK, BV, num_warps): the state block [BK, BV] of one program (about 1024 fp32 per warp)."""
    block_k = next_power_of_2(dk)
    block_v = min(16, next_power_of_2(dv))
    return block_k, block_v, max(1, block_k * block_v // 1024)


def _bwd_config(dk: int, dv: int) -> Tuple[int, int, int]:
    """(BK, BV, num_warps) of the backward: the forward's (one warp on 16 columns was also the fastest backward
    on the H100; ``python -m benchmarks.recurrent --bwd-configs`` times others)."""
    return _config(dk, dv)


def triton_fused_recurrent_hdla(q, k, v, beta, g, scale: Optional[float] = None,
                                initial_state: Optional[torch.Tensor] = None,
                                reverse: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton path; shapes as :func:`torch_fused_recurrent_hdla`: ``(o [B, T, H, V]`` in v's dtype,
    ``state [B, H, K, V]`` fp32)."""
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    q, k, v, beta, g = (x.contiguous() for x in (q, k, v, beta, g))
    o = torch.empty_like(v)
    state = q.new_empty(batch, heads, dk, dv, dtype=torch.float32)
    h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else state
    block_k, block_v, warps = _config(dk, dv)
    _fused_recurrent_hdla_fwd_kernel[(cdiv(dv, block_v), batch * heads, 1)](
        q, k, v, beta, g, h0, o, state, 1.0 if scale is None else float(scale), seq_len, heads, dk, dv,
        BK=block_k, BV=block_v, DIRS=1, REVERSE=int(reverse), HAS_H0=initial_state is not None, num_warps=warps)
    return o, state


def triton_fused_recurrent_hdla_bidirectional(q, k, v, beta, g, scale: float,
                                              initial_state: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both scans of ``chunk_hdla_bidirectional`` in one launch: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``
    shared, beta ``[2, B, T, H]``, g ``[2, B, T, H, K]``, initial_state ``[2, B, H, K, V]`` or None;
    returns ``(y [B, T, H, V]`` in q's dtype, ``states [2, B, H, K, V]`` fp32) with
    y = o_fwd + o_bwd - own write (the reversed scan's output leaves it out)."""
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    q, k, v, beta, g = (x.contiguous() for x in (q, k, v, beta, g))
    o = q.new_empty(2, batch, seq_len, heads, dv, dtype=torch.float32)
    states = q.new_empty(2, batch, heads, dk, dv, dtype=torch.float32)
    h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else states
    block_k, block_v, warps = _config(dk, dv)
    _fused_recurrent_hdla_fwd_kernel[(cdiv(dv, block_v), batch * heads, 2)](
        q, k, v, beta, g, h0, o, states, float(scale), seq_len, heads, dk, dv,
        BK=block_k, BV=block_v, DIRS=2, REVERSE=0, HAS_H0=initial_state is not None, num_warps=warps)
    return (o[0] + o[1]).to(q.dtype), states


def triton_fused_recurrent_hdla_backward(do, dht, q, k, v, beta, g, scale: Optional[float] = None,
                                         initial_state: Optional[torch.Tensor] = None, reverse: bool = False):
    """Every gradient of :func:`triton_fused_recurrent_hdla` for the cotangents ``do [B, T, H, V]`` and
    ``dht [B, H, K, V]`` (or None): ``(dq, dk, dv, dbeta, dg)`` in their inputs' dtypes and ``dh0``
    ``[B, H, K, V]`` fp32 (None without an initial state)."""
    return _backward(do, dht, q, k, v, beta, g, 1.0 if scale is None else float(scale), initial_state, reverse, 1)


def triton_fused_recurrent_hdla_bidirectional_backward(do, dht, q, k, v, beta, g, scale: float,
                                                       initial_state: Optional[torch.Tensor]):
    """Every gradient of :func:`triton_fused_recurrent_hdla_bidirectional` (both directions in one launch) for
    ``do [B, T, H, V]`` (y's cotangent) and ``dht [2, B, H, K, V]`` (or None): ``(dq, dk, dv)`` summed over the
    directions, ``(dbeta [2, B, T, H], dg [2, B, T, H, K])`` in their inputs' dtypes and ``dh0 [2, B, H, K, V]``
    fp32 (None without an initial state)."""
    return _backward(do, dht, q, k, v, beta, g, float(scale), initial_state, False, 2)


def _backward(do, dht, q, k, v, beta, g, scale: float, initial_state, reverse: bool, dirs: int):
    """The launches behind both backward functions; beta, g, initial_state and dht carry a leading direction
    axis where ``dirs`` = 2. The launch's transient memory (the fp32 checkpoints and V-block partials,
    :func:`transient_bytes_per_batch`) grows with the batch: a batch whose transient exceeds the backward's
    scratch budget (``generalized.bwd.scratch_budget_bytes``, the chunk backward's) runs in slices of the batch
    axis, one launch each, as many as cost no extra wave of programs (:func:`_backward_occupancy`). Every
    (batch, head) walks its own tokens, so the gradients are those of one launch."""
    batch, seq_len, heads, dk = q.shape
    slices = scratch_batch_slices(batch, transient_bytes_per_batch(seq_len, heads, dk, v.shape[-1], dirs),
                                  *_backward_occupancy(q.device, heads, dk, v.shape[-1], dirs))
    if len(slices) == 1:
        return _backward_launch(do, dht, q, k, v, beta, g, scale, initial_state, reverse, dirs)

    def part(x, rows, stacked):  # batch rows of an input; ``stacked``: a [2, B, ...] tensor where dirs = 2
        return None if x is None else (x[:, rows] if stacked and dirs == 2 else x[rows])

    parts = [_backward_launch(part(do, s, False), part(dht, s, True), part(q, s, False), part(k, s, False),
                              part(v, s, False), part(beta, s, True), part(g, s, True), scale,
                              part(initial_state, s, True), reverse, dirs) for s in slices]
    batch_dims = (0, 0, 0, 1, 1, 1) if dirs == 2 else (0,) * 6
    return tuple(None if xs[0] is None else torch.cat(xs, dim) for xs, dim in zip(zip(*parts), batch_dims))


def _backward_occupancy(device: torch.device, heads: int, dk: int, dv: int, dirs: int) -> Tuple[int, int]:
    """(programs per batch element, programs resident on the GPU at once) of the backward launch, for
    :func:`scratch_batch_slices` (every program walks all T tokens, so a launch lasts as many walks as it has
    waves); (0, 0) off CUDA (CPU under the interpreter: the budget alone decides)."""
    sms = device_sm_count(device)
    if sms is None:
        return 0, 0
    _, block_v, warps = _bwd_config(dk, dv)
    return cdiv(dv, block_v) * heads * dirs, sms * max(1, BWD_RESIDENT_WARPS_PER_SM // warps)


def transient_bytes_per_batch(seq_len: int, heads: int, dk: int, dv: int, dirs: int) -> int:
    """Bytes the backward launch allocates per batch element beyond its outputs: the fp32 checkpoints (a
    ``[BK, BV]`` block per V-block every ``CHECKPOINT_EVERY`` tokens), the fp32 V-block partials of dq, dk, dg
    and dbeta, both directions' fp32 dv (``dirs`` = 2) and the one zero state it reads in place of h0 and / or
    dht."""
    block_k, block_v, _ = _bwd_config(dk, dv)
    n_v = cdiv(dv, block_v)
    per_head = (n_v * cdiv(seq_len, CHECKPOINT_EVERY) * block_k * block_v + n_v * seq_len * (3 * dk + 1)
                + (seq_len * dv if dirs == 2 else 0) + dk * dv)
    return 4 * dirs * heads * per_head


def _backward_launch(do, dht, q, k, v, beta, g, scale: float, initial_state, reverse: bool, dirs: int):
    """One launch of the backward kernel over the whole batch of its inputs (:func:`_backward`)."""
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    q, k, v, beta, g, do = (x.contiguous() for x in (q, k, v, beta, g, do))
    block_k, block_v, warps = _bwd_config(dk, dv)
    n_v = cdiv(dv, block_v)
    n_ck = cdiv(seq_len, CHECKPOINT_EVERY)
    f32 = dict(device=q.device, dtype=torch.float32)
    lead = (dirs,) if dirs == 2 else ()
    ckpt = torch.empty(dirs * batch * heads * n_v * n_ck * block_k * block_v, **f32)
    dq_p = torch.empty(dirs * n_v, batch, seq_len, heads, dk, **f32)
    dk_p, dg_p = torch.empty_like(dq_p), torch.empty_like(dq_p)
    dbeta_p = torch.empty(dirs * n_v, batch, seq_len, heads, **f32)
    dv_ = v.new_empty(*lead, *v.shape, dtype=torch.float32 if dirs == 2 else v.dtype)  # two directions: summed
    dh0 = torch.empty(*lead, batch, heads, dk, dv, **f32)
    zeros = torch.zeros_like(dh0) if initial_state is None or dht is None else None  # the kernel reads both
    h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else zeros
    dht = dht.to(torch.float32).contiguous() if dht is not None else zeros
    _fused_recurrent_hdla_bwd_kernel[(n_v, batch * heads, dirs)](
        q, k, v, beta, g, h0, do, dht, ckpt, dq_p, dk_p, dv_, dbeta_p, dg_p, dh0,
        scale, seq_len, heads, dk, dv, n_ck,
        BK=block_k, BV=block_v, CK=CHECKPOINT_EVERY, DIRS=dirs, REVERSE=int(reverse), num_warps=warps)

    # the epilogue in one launch: the V-block partials summed (per direction for the gates, over both for the
    # inputs they share) and cast; dv of one direction is already in v's dtype
    jobs = [(dq_p, dq_p.shape[0], q.dtype), (dk_p, dk_p.shape[0], k.dtype), (dbeta_p, n_v, beta.dtype),
            (dg_p, n_v, g.dtype)] + ([(dv_, 2, v.dtype)] if dirs == 2 else [])
    dq, dk_, dbeta, dg, *dv_sum = sum_parts_grouped(jobs)
    return (dq[0], dk_[0], dv_sum[0][0] if dirs == 2 else dv_, dbeta.view(*lead, *dbeta_p.shape[1:]),
            dg.view(*lead, *dg_p.shape[1:]), dh0 if initial_state is not None else None)


@triton.jit
def _sum_rows(x_ptr, out_ptr, n, o, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """out[o, i] = sum over p < PARTS of x[o * PARTS + p, i] (fp32, parts in order) for this program's BLOCK
    columns i, in out's dtype."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    first = o.to(tl.int64) * PARTS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(PARTS):
        acc += tl.load(x_ptr + (first + p) * n + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + o.to(tl.int64) * n + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_parts_kernel(x0, y0, n0, x1, y1, n1, x2, y2, n2, x3, y3, n3, x4, y4, n4,
                      P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr,
                      O0: tl.constexpr, O1: tl.constexpr, O2: tl.constexpr, O3: tl.constexpr, O4: tl.constexpr,
                      JOBS: tl.constexpr, BLOCK: tl.constexpr):
    """Up to :data:`SUM_PARTS_SLOTS` jobs, job j summing ``Oj`` groups of ``Pj`` rows of ``xj`` into ``yj``
    (:func:`_sum_rows`, rows of ``nj`` elements); grid (cdiv(max nj, BLOCK), JOBS, max Oj)."""
    job = tl.program_id(1)
    o = tl.program_id(2)
    if job == 0 and o < O0:
        _sum_rows(x0, y0, n0, o, P0, BLOCK)
    if JOBS > 1:
        if job == 1 and o < O1:
            _sum_rows(x1, y1, n1, o, P1, BLOCK)
    if JOBS > 2:
        if job == 2 and o < O2:
            _sum_rows(x2, y2, n2, o, P2, BLOCK)
    if JOBS > 3:
        if job == 3 and o < O3:
            _sum_rows(x3, y3, n3, o, P3, BLOCK)
    if JOBS > 4:
        if job == 4 and o < O4:
            _sum_rows(x4, y4, n4, o, P4, BLOCK)


SUM_PARTS_BLOCK = 1024
SUM_PARTS_SLOTS = 5


def sum_parts_grouped(jobs) -> list:
    """Each job ``(x, parts, dtype)``: the backward's partials ``x [O * parts, ...]`` (contiguous fp32) summed
    in groups of ``parts`` consecutive rows, ``[O, ...]`` in ``dtype``; up to :data:`SUM_PARTS_SLOTS` jobs in
    one launch, where PyTorch takes two per job (a reduction over the parts' axis, then the cast's copy)."""
    if not 1 <= len(jobs) <= SUM_PARTS_SLOTS:
        raise ValueError(f"jobs: 1 to {SUM_PARTS_SLOTS} (x, parts, dtype) triples, got {len(jobs)}")
    outs = [torch.empty(x.shape[0] // parts, *x.shape[1:], device=x.device, dtype=dtype) for x, parts, dtype in jobs]
    sizes = [x[0].numel() for x, _, _ in jobs]
    if max(sizes) == 0:
        return outs
    pad = SUM_PARTS_SLOTS - len(jobs)
    args = [a for (x, _, _), out, n in zip(jobs, outs, sizes) for a in (x, out, n)] + [jobs[0][0], outs[0], 0] * pad
    parts = [p for _, p, _ in jobs] + [1] * pad
    counts = [out.shape[0] for out in outs] + [0] * pad
    _sum_parts_kernel[(cdiv(max(sizes), SUM_PARTS_BLOCK), len(jobs), max(counts))](
        *args, **{f"P{i}": p for i, p in enumerate(parts)}, **{f"O{i}": c for i, c in enumerate(counts)},
        JOBS=len(jobs), BLOCK=SUM_PARTS_BLOCK, num_warps=4)
    return outs


def sum_parts(x: torch.Tensor, parts: int, dtype: torch.dtype) -> torch.Tensor:
    """One job of :func:`sum_parts_grouped`: ``x [O * parts, ...]`` summed in groups of ``parts`` rows,
    ``[O, ...]`` in ``dtype``."""
    return sum_parts_grouped([(x, parts, dtype)])[0]


def fused_recurrent_hdla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Advance the HDLA state by T tokens: the decoding counterpart of ``chunk_hdla``.

    Args:
        q, k, g: ``[B, T, H, K]`` (k L2-normalised by the caller, ``g = log lambda <= 0``).
        v: ``[B, T, H, V]``; beta: ``[B, T, H]`` in [0, 2].
        scale: output scale, None means 1.
        initial_state: ``[B, H, K, V]`` (kept in fp32 by decoders, any float dtype) or None for zeros.

    Dtypes and the log-decay's domain as :func:`~hdla_vision.kernels.chunk_hdla`: k, v have q's
    dtype, beta and g q's dtype or float32; ``g = -inf`` resets the state's channel exactly
    (exp(-inf) = 0; the PyTorch loop's gradient there is 0); ``g > 0`` raises ValueError for CPU
    tensors and is unchecked on CUDA.

    Returns:
        ``(o [B, T, H, V] in v's dtype, new_state [B, H, K, V] fp32)``. Triton runs CUDA tensors
        (and CPU tensors under ``TRITON_INTERPRET=1``); float64 inputs and other CPU tensors use
        the PyTorch loop, which keeps float64 for float64 inputs. The cost is linear in T: for
        long prompts use ``chunk_hdla`` with ``output_final_state=True``. A custom op
        (``hdla_vision::fused_recurrent_hdla``, ``custom_ops.py``): one node under ``torch.compile``;
        its gradients come from the Triton backward (kernels/README.md §11) where the forward ran on
        Triton, else from autograd through the PyTorch loop.
    """
    check_hdla_inputs(q, k, v, beta, g, initial_state, scale)
    from ..custom_ops import fused_recurrent_hdla_op  # noqa: PLC0415 (custom_ops loads this module lazily)

    def op(q, k, v, beta, g, initial_state):
        return fused_recurrent_hdla_op(q, k, v, beta, g, 1.0 if scale is None else float(scale), initial_state)

    return per_batch_slice(op, dict(q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state), q.shape[2])
