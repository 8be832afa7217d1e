"""The delta rule's forward in three Triton kernels on 64-step chunks (kernels/README.md §12; the math of
:mod:`.torch_chunk`, whose names these follow).

    P  ``_prepare_kernel``  grid (N, B*H): G = cumsum(g) in the chunk; the Grams A (rows times beta, strictly lower)
                            and Aqk (lower) from four products through each 16-step row block's first G (both factors
                            <= 1) and, on the diagonal 16 x 16 blocks, exactly, one column at a time; T = (I + A)^-1
                            by block doubling; w = T (beta k e^G), u~ = T (omega v), kg, qg, gamma.
    S  ``_state_kernel``    grid (V / BV, B*H), serial over chunks: U = u~ - w S, S <- gamma S + kg^T U; stores the
                            state entering each chunk (h) and U.
    O  ``_output_kernel``   grid (N, V / BV, B*H): O = qg h + Aqk U.

Every intermediate is fp32, and every product exact fp32 (``ieee``) unless ``precision`` names the tensor cores' tf32
(:data:`PRECISIONS`; for the GPU's timing, ``benchmarks/delta_rule.py``): the layout and the numerics of the
KDA-shaped family (benchmarks/results/NOTES.md, 2026-11-29), checked under the interpreter; 16-bit operands and the
GPU's launch settings come with its timing. Head dims up to 128 (K in one tile).
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..utils import LOG_ZERO_FP32, cdiv, check_log_decay, needs_grad, next_power_of_2, use_triton
from .torch_chunk import torch_chunk_delta_rule

CHUNK = 64
SUB = 16
MAX_HEAD_DIM = 128
# tl.dot's input_precision for the fp32 operands: exact (the default, and what the interpreter tests check), or the
# tensor cores' tf32 (one or three products) for the GPU's timing
PRECISIONS = ("ieee", "tf32x3", "tf32")


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
def _prepare_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, om_ptr, gcum_ptr, aqk_ptr, w_ptr, u_ptr, kg_ptr, qg_ptr,
                    gam_ptr, T, H, K, V, NT, scale,
                    C: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LOG_ZERO: tl.constexpr,
                    PREC: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    blk = (bh * NT + c).to(tl.int64)  # this chunk's index in the [B*H, N, ...] outputs
    rows = tl.arange(0, C)
    cols = tl.arange(0, BK)
    kmask = (cols < K)[None, :]
    q = _rows_of(q_ptr, b, c, h, T, H, K, rows, cols, C)
    k = _rows_of(k_ptr, b, c, h, T, H, K, rows, cols, C)
    g = tl.maximum(_rows_of(g_ptr, b, c, h, T, H, K, rows, cols, C), LOG_ZERO)  # -inf (a reset) as exp's exact 0
    G = tl.cumsum(g, axis=0)
    gcum_rows = gcum_ptr + (blk * C * BK) + rows[:, None] * BK + cols[None, :]
    tl.store(gcum_rows, G)
    beta = _scalars_of(beta_ptr, b, c, h, T, H, rows, C)
    om = _scalars_of(om_ptr, b, c, h, T, H, rows, C)
    block = rows // SUB
    # off-diagonal 16-step blocks: through r = G at row block n's first step, e^{G_t - r} <= 1 and e^{r - G_i} <= 1
    a_mat = tl.zeros([C, C], dtype=tl.float32)
    aqk = tl.zeros([C, C], dtype=tl.float32)
    for n in tl.static_range(1, C // SUB):
        r = tl.sum(tl.where((rows == n * SUB)[:, None], G, 0.0), axis=0)[None, :]
        reader = (block == n)[:, None]
        x_decay = tl.exp(tl.minimum(G - r, 0.0))
        y = tl.where((rows < n * SUB)[:, None], k * tl.exp(tl.minimum(r - G, 0.0)), 0.0)
        a_mat += tl.dot(tl.where(reader, k * x_decay, 0.0), tl.trans(y), input_precision=PREC)
        aqk += tl.dot(tl.where(reader, q * x_decay, 0.0), tl.trans(y), input_precision=PREC)
    tl.debug_barrier()  # G's rows are read back below by other threads of this program
    # diagonal 16-step blocks, exactly: column j of every block at once, the pair decays e^{G_t - G_i} (t >= i)
    for j in range(SUB):
        col = block * SUB + j  # [C]: the column each row's block reads at this j
        live = rows >= col
        k_col = _rows_of(k_ptr, b, c, h, T, H, K, col, cols, C)  # rows gathered from memory
        g_col = tl.load(gcum_ptr + (blk * C * BK) + col[:, None] * BK + cols[None, :])
        pair = tl.exp(tl.where(live[:, None], G - g_col, float("-inf")))
        at_col = rows[None, :] == col[:, None]
        aqk += tl.where(at_col, tl.sum(q * k_col * pair, axis=1)[:, None], 0.0)
        a_mat += tl.where(at_col & (rows > col)[:, None], tl.sum(k * k_col * pair, axis=1)[:, None], 0.0)
    a_mat = a_mat * beta[:, None]
    # T = (I + A)^-1 by block doubling: D <- D - D L_s D, L_s the entries of A between the halves of each 2s block
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    t_mat = eye
    for level in tl.static_range(0, 6):  # s = 1, 2, 4, ..., 32
        s = 1 << level
        pair_block = (rows[:, None] // (2 * s)) == (rows[None, :] // (2 * s))
        cross = pair_block & ((rows[:, None] // s) % 2 == 1) & ((rows[None, :] // s) % 2 == 0)
        l_s = tl.where(cross, a_mat, 0.0)
        t_mat = t_mat - tl.dot(tl.dot(t_mat, l_s, input_precision=PREC), t_mat, input_precision=PREC)
    last = tl.sum(tl.where((rows == C - 1)[:, None], G, 0.0), axis=0)[None, :]  # G_C (identity steps past T)
    decayed = tl.exp(G)
    w = tl.dot(t_mat, k * decayed * beta[:, None], input_precision=PREC)
    out_rows = (blk * C + rows)[:, None]
    tl.store(w_ptr + out_rows * K + cols[None, :], w, mask=kmask)
    tl.store(kg_ptr + out_rows * K + cols[None, :], k * tl.exp(last - G), mask=kmask)
    tl.store(qg_ptr + out_rows * K + cols[None, :], scale * q * decayed, mask=kmask)
    tl.store(gam_ptr + blk * K + cols[None, :], tl.exp(last), mask=kmask)
    tl.store(aqk_ptr + out_rows * C + rows[None, :], scale * aqk)
    for v0 in range(0, V, BV):
        vcols = v0 + tl.arange(0, BV)
        vals = _rows_of(v_ptr, b, c, h, T, H, V, rows, vcols, C) * om[:, None]
        u = tl.dot(t_mat, vals, input_precision=PREC)
        tl.store(u_ptr + out_rows * V + vcols[None, :], u, mask=(vcols < V)[None, :])


@triton.jit
def _state_kernel(w_ptr, u_ptr, kg_ptr, gam_ptr, h0_ptr, h_ptr, new_ptr, final_ptr, K, V, NT,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, PREC: tl.constexpr):
    i_v = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    kmask = ck < K
    vmask = cv < V
    state_offs = ck[:, None] * V + cv[None, :]
    state_mask = kmask[:, None] & vmask[None, :]
    if HAS_H0:
        state = tl.load(h0_ptr + bh * K * V + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(NT):
        blk = bh * NT + n
        tl.store(h_ptr + blk * K * V + state_offs, state, mask=state_mask)
        chunk_rows = (blk * C + rows)[:, None]
        w = tl.load(w_ptr + chunk_rows * K + ck[None, :], mask=kmask[None, :], other=0.0)
        kg = tl.load(kg_ptr + chunk_rows * K + ck[None, :], mask=kmask[None, :], other=0.0)
        u = tl.load(u_ptr + chunk_rows * V + cv[None, :], mask=vmask[None, :], other=0.0)
        gam = tl.load(gam_ptr + blk * K + ck, mask=kmask, other=0.0)
        new = u - tl.dot(w, state, input_precision=PREC)
        tl.store(new_ptr + chunk_rows * V + cv[None, :], new, mask=vmask[None, :])
        state = gam[:, None] * state + tl.dot(tl.trans(kg), new, input_precision=PREC)
    tl.store(final_ptr + bh * K * V + state_offs, state, mask=state_mask)


@triton.jit
def _output_kernel(qg_ptr, aqk_ptr, h_ptr, new_ptr, o_ptr, T, H, K, V, NT,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    c = tl.program_id(0)
    i_v = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    blk = (bh * NT + c).to(tl.int64)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    vmask = cv < V
    chunk_rows = (blk * C + rows)[:, None]
    qg = tl.load(qg_ptr + chunk_rows * K + ck[None, :], mask=(ck < K)[None, :], other=0.0)
    state = tl.load(h_ptr + blk * K * V + ck[:, None] * V + cv[None, :], mask=(ck < K)[:, None] & vmask[None, :],
                    other=0.0)
    aqk = tl.load(aqk_ptr + chunk_rows * C + rows[None, :])
    new = tl.load(new_ptr + chunk_rows * V + cv[None, :], mask=vmask[None, :], other=0.0)
    o = tl.dot(qg, state, input_precision=PREC) + tl.dot(aqk, new, input_precision=PREC)
    t = c * C + rows
    offs = ((b * T + t) * H + h).to(tl.int64)[:, None] * V + cv[None, :]
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=(t < T)[:, None] & vmask[None, :])


def _check(q, k, v, beta, g, write, initial_state):
    """ValueError naming the argument, before any launch."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {list(q.shape)}")
    batch, seq_len, heads, dk = q.shape
    for name, x in (("k", k), ("g", g)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must be [B, T, H, K] = {list(q.shape)}, got {list(x.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {list(q.shape[:3])}, got {list(v.shape)}")
    for name, x in (("beta", beta), ("write", write)):
        if tuple(x.shape) != (batch, seq_len, heads):
            raise ValueError(f"{name} must be [B, T, H] = {[batch, seq_len, heads]}, got {list(x.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (batch, heads, dk, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V] = {[batch, heads, dk, v.shape[-1]]}, "
                         f"got {list(initial_state.shape)}")
    check_log_decay(g)
    tensors = (q, k, v, beta, g, write) + (() if initial_state is None else (initial_state,))
    if len({x.device for x in tensors}) != 1:
        raise ValueError("q, k, v, beta, g, write and initial_state must be on one device")


def chunk_delta_rule_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                         write: torch.Tensor, scale: Optional[float] = None,
                         initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                         precision: Optional[str] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The delta rule's forward (no autograd) on the Triton kernels: ``(o [B, T, H, V]`` in q's dtype, the final
    state ``[B, H, K, V]`` fp32 or None); arguments as :func:`.torch_chunk.torch_chunk_delta_rule`. ``precision``:
    every product's fp32 operands as :data:`PRECISIONS` names them (``tl.dot``'s ``input_precision``; None: tf32x3
    on CUDA, exact under the interpreter)."""
    precision = precision or ("tf32x3" if q.is_cuda else "ieee")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    _check(q, k, v, beta, g, write, initial_state)
    batch, seq_len, heads, dk = q.shape
    if dk > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels take K up to {MAX_HEAD_DIM} (one tile), got K = {dk}")
    dv = v.shape[-1]
    q, k, v, beta, g, write = (x.contiguous() for x in (q, k, v, beta, g, write))
    n_chunks = cdiv(seq_len, CHUNK)
    bh = batch * heads
    bk = max(16, next_power_of_2(dk))
    bv = max(16, min(64 if bk <= 64 else 32, next_power_of_2(dv)))  # S's pipelined loads within shared memory
    f32 = dict(device=q.device, dtype=torch.float32)
    gcum = torch.empty(bh, n_chunks * CHUNK, bk, **f32)
    aqk = torch.empty(bh, n_chunks, CHUNK, CHUNK, **f32)
    w, kg, qg = (torch.empty(bh, n_chunks, CHUNK, dk, **f32) for _ in range(3))
    u = torch.empty(bh, n_chunks, CHUNK, dv, **f32)
    gamma = torch.empty(bh, n_chunks, dk, **f32)
    _prepare_kernel[(n_chunks, bh)](q, k, v, beta, g, write, gcum, aqk, w, u, kg, qg, gamma, seq_len, heads, dk, dv,
                                    n_chunks, 1.0 if scale is None else float(scale), C=CHUNK, SUB=SUB, BK=bk, BV=bv,
                                    LOG_ZERO=LOG_ZERO_FP32, PREC=precision, num_warps=8, num_stages=1)
    h = torch.empty(bh, n_chunks, dk, dv, **f32)
    new = torch.empty(bh, n_chunks, CHUNK, dv, **f32)
    final = torch.empty(bh, dk, dv, **f32)
    h0 = initial_state.contiguous() if initial_state is not None else final
    _state_kernel[(cdiv(dv, bv), bh)](w, u, kg, gamma, h0, h, new, final, dk, dv, n_chunks, C=CHUNK, BK=bk, BV=bv,
                                      HAS_H0=initial_state is not None, PREC=precision,
                                      num_warps=4 if bk <= 64 else 8, num_stages=2)
    o = torch.empty(batch, seq_len, heads, dv, device=q.device, dtype=q.dtype)
    _output_kernel[(n_chunks, cdiv(dv, bv), bh)](qg, aqk, h, new, o, seq_len, heads, dk, dv, n_chunks, C=CHUNK, BK=bk,
                                                 BV=bv, PREC=precision, num_warps=4)
    return o, (final.view(batch, heads, dk, dv) if output_final_state else None)


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                     write: torch.Tensor, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                     output_final_state: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The delta rule ``S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + write_t k_t v_t^T``, ``o_t = scale
    S_t^T q_t`` (kernels/README.md §12), forward only: the Triton kernels where Triton runs (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``), else :func:`.torch_chunk.torch_chunk_delta_rule`. A call a gradient would flow through
    raises ValueError (the backward is not built yet).

    Args: q, k, g ``[B, T, H, K]`` (k unit rows, g <= 0), v ``[B, T, H, V]``, beta and write ``[B, T, H]``,
        initial_state ``[B, H, K, V]`` or None. Returns ``(o [B, T, H, V]`` in q's dtype, the final state
        ``[B, H, K, V]`` (fp32; float64 for float64 inputs on the CPU form) or None).
    """
    _check(q, k, v, beta, g, write, initial_state)
    if needs_grad(q, k, v, beta, g, write, initial_state):
        raise ValueError("chunk_delta_rule is forward only: call it under torch.no_grad() or on inputs that do not "
                         "require grad")
    if use_triton(q):
        return chunk_delta_rule_fwd(q, k, v, beta, g, write, scale, initial_state, output_final_state)
    return torch_chunk_delta_rule(q, k, v, beta, g, write, scale, initial_state, output_final_state)
