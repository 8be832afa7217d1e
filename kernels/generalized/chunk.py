"""Triton chunk op for the generalized recurrence, forward and backward.

Backward. With Z_t = dL/dS_t the adjoint state,

    Z_t = P_{t+1}^T Z_{t+1} + scale q_t do_t^T,    P^T = D - B A^T,

which is the same recurrence run the other way with A and B swapped and the transition taken
from the previous scan step, so the kernel of the forward pass computes it too. Then

    dq_t = scale S_t do_t      dK_t = Z_t V_t      dV_t = Z_t^T K_t
    dA_t = -Z_t X_t            dB_t = -S_{t-1} Y_t  (X_t = S_{t-1}^T B_t, Y_t = Z_t^T A_t)

are readouts of the two scans, and the log-decay gradient follows from a gauge argument
(rescaling row k of every state from step s on leaves the loss unchanged):

    dg_s = sum_{t >= s} (q.dq - K.dK - A.dA)_t + sum_{t > s} (B.dB)_t + rowsum(S_T * dS_T),

a reverse cumulative sum over per-token terms; no per-token state is ever stored.

The kernels clamp g at ``LOG_ZERO_FP32`` (-110, where exp is 0 in fp32) as they load it, so g = -inf
(a full reset) is the exact limit; dg is then 0 wherever g is below the floor.
"""
from typing import Optional

import torch
from triton.runtime.errors import OutOfResources

from ..utils import LOG_ZERO_FP32, cdiv, next_power_of_2
from .scan import BT, LOG2_BT, THRESH, chunk_kread_kernel, chunk_local_kernel, chunk_scan_kernel


def _pow2(n: int) -> int:
    return 1 if n <= 1 else next_power_of_2(n)


def _rank(x: Optional[torch.Tensor]) -> int:
    return 0 if x is None else x.shape[3]


def _launch_config(dk: int, dv: int, programs: int):
    """(BK, BV, num_warps) for the sequential kernel: BV small enough to give ~2 programs per SM."""
    bk = max(16, next_power_of_2(dk))
    bv = max(16, min(64 if bk <= 128 else 32, next_power_of_2(dv)))
    while bv > 16 and programs * cdiv(dv, bv) < 256:
        bv //= 2
    return bk, bv, 4 if bk <= 64 else 8


def _kread_warps(bk: int, dv: int) -> int:
    """Warps of the K-readout kernel. Eight warps with a key block of 64 or less gave wrong
    gradients or illegal memory accesses on the H100 (K = 32 or 64 with V = 128 or 256, where
    the [BT*n, BT*r] x [BT*r, BK] products are narrow); four ran every case of
    ``tests/gpu_rank_sweep.py`` correctly."""
    return 4 if bk <= 64 or bk * dv <= 4096 else 8


_UNPIPELINED = set()  # serial-kernel configurations whose double-buffered loads overflow shared memory


def _launch_scan_kernel(grid, args, meta):
    """Launch the sequential kernel with ``meta["num_stages"]``; where the pipelined loads need more
    shared memory than the GPU has (high ranks, large head dims) fall back to one stage, once
    per configuration. Compilation fails before anything is launched, so nothing is half-done."""
    key = tuple(sorted(meta.items()))
    if key not in _UNPIPELINED and meta.get("num_stages", 1) > 1:
        try:
            chunk_scan_kernel[grid](*args, **meta)
            return
        except OutOfResources:
            _UNPIPELINED.add(key)
    chunk_scan_kernel[grid](*args, **dict(meta, num_stages=1))


def chunk_scan(
    q: Optional[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    hdla: Optional[tuple] = None,
    scale: float = 1.0,
    initial_state: Optional[torch.Tensor] = None,
    reverse: bool = False,
    shift: bool = False,
    swap_ab: bool = False,
    x_given: Optional[torch.Tensor] = None,
    store_x: bool = False,
    store_final: bool = False,
    w_post: Optional[torch.Tensor] = None,
    w_pre: Optional[torch.Tensor] = None,
    launch: Optional[dict] = None,
    x_dtype: torch.dtype = torch.float32,
):
    """Run the chunk-local and the sequential kernel once.

    Args:
        q: ``[B, T, H, NQ, K]`` query stack for V-readouts ``scale * S_t^T q`` (or None).
        k, v: ``[B, T, H, r_kv, K]`` and ``[B, T, H, r_kv, V]``: the writes.
        g: ``[B, T, H, K]`` log-decay of the transition.
        a, b: ``[B, T, H, r_ab, K]`` (or None for rank 0); ``hdla=(k, beta)`` builds them instead.
        shift: take step p's transition from scan step p-1 (identity at the first step).
        swap_ab: use ``D - B A^T`` (the transposed transition).
        x_given: ``[B, T, H, r_ab, V]``: the reads X, known from an earlier pass (skips the solve;
            then q must be None).
        w_post / w_pre: ``[B, T, H, n, V]`` V-vectors for K-readouts of S_t / S_{t-1}.
        launch: overrides of the serial kernel's ``BV``, ``num_warps``, ``num_stages`` (tuning).
        x_dtype: the dtype X is stored in (the kernel computes it, and uses it within the pass, in fp32).

    Returns:
        dict with ``o`` ``[B, T, H, NQ, V]``, ``x`` ``[B, T, H, r_ab, V]``, ``k_post`` and ``k_pre``
        ``[B, T, H, n, K]``, ``final`` ``[B, H, K, V]`` as requested (fp32 except ``o``).
    """
    if swap_ab and hdla is None:
        a, b = b, a
    batch, seq_len, heads, r_kv, dk = k.shape
    dv = v.shape[-1]
    r_ab = 2 if hdla is not None else _rank(a)
    nq, nwp, nwq = _rank(q), _rank(w_post), _rank(w_pre)
    assert x_given is None or nq == 0, "V-readouts need the solve; x_given skips it"
    n_chunks = cdiv(seq_len, BT)
    bk, bv, num_warps = _launch_config(dk, dv, batch * heads)
    launch = dict(dict(BV=bv, num_warps=num_warps, num_stages=2), **(launch or {}))
    n_v = cdiv(dv, launch["BV"])
    dev = k.device
    f32 = dict(device=dev, dtype=torch.float32)
    empty = torch.empty(0, **f32)
    kh, beta = hdla if hdla is not None else (empty, empty)
    rap, rkp, nqp = _pow2(r_ab), _pow2(r_kv), _pow2(nq)
    solve = r_ab > 0 and x_given is None
    wx = torch.empty(batch, seq_len, heads, r_ab, dk, **f32) if solve else empty
    ur = torch.empty(batch * heads, n_chunks, BT * rap, BT * rkp, **f32) if solve else empty
    qe = torch.empty(batch, seq_len, heads, nq, dk, **f32) if nq else empty
    mo = torch.empty(batch * heads, n_chunks, BT * nqp, BT * rkp, **f32) if nq else empty
    ktil = torch.empty(batch, seq_len, heads, r_kv, dk, **f32)
    atil = torch.empty(batch, seq_len, heads, r_ab, dk, **f32) if r_ab else empty
    gamma = torch.empty(batch * heads, n_chunks, dk, **f32)

    def ptr(t):
        return empty if t is None else t.contiguous()

    k, g = k.contiguous(), g.contiguous()
    transition = dict(RKV=r_kv, RKP=rkp, RAB=r_ab, RAP=rap, BT=BT, BK=bk, REVERSE=reverse)
    chunk_local_kernel[(n_chunks, batch * heads)](
        ptr(q), k, ptr(a), ptr(b), ptr(kh), ptr(beta), g, wx, ur, qe, mo, ktil, atil, gamma,
        seq_len, heads, dk, float(scale), THRESH, NQ=nq, NQP=nqp, HDLA=hdla is not None, SWAP_AB=swap_ab,
        SHIFT=int(shift), SOLVE=solve, LOG2_BT=LOG2_BT, num_warps=4 if bk * rap <= 128 else 8, **transition,
    )
    o = torch.empty(batch, seq_len, heads, nq, dv, device=dev, dtype=q.dtype) if nq else empty
    store_x = store_x or (r_ab > 0 and x_given is None and (nwp or nwq))  # the K-readouts need X
    x = torch.empty(batch, seq_len, heads, r_ab, dv, device=dev, dtype=x_dtype) if store_x else empty
    alloc = torch.zeros if n_v > 1 else torch.empty  # V-blocks add their parts atomically
    k_post = alloc(batch, seq_len, heads, nwp, dk, **f32) if nwp else empty
    k_pre = alloc(batch, seq_len, heads, nwq, dk, **f32) if nwq else empty
    final = torch.empty(batch, heads, dk, dv, **f32) if store_final else empty
    _launch_scan_kernel(
        (n_v, batch * heads),
        (v.contiguous(), ktil, atil, gamma, wx, ur, qe, mo, ptr(x_given), ptr(w_post), ptr(w_pre),
         o, x, k_post, k_pre, ptr(initial_state), final, seq_len, heads, dk, dv),
        dict(NQ=nq, NQP=nqp, NWP=nwp, NWPP=_pow2(nwp), NWQ=nwq, NWQP=_pow2(nwq), X_GIVEN=x_given is not None,
             STORE_X=store_x, USE_H0=initial_state is not None, STORE_HT=store_final, ATOMIC=n_v > 1,
             **launch, **transition),
    )
    out = {}
    if nq:
        out["o"] = o
    if store_x:
        out["x"] = x
    x_read = x_given if x_given is not None else x
    for name, w, acc, strict in (("k_post", w_post, k_post, False), ("k_pre", w_pre, k_pre, True)):
        if w is None:
            continue
        n_w = w.shape[3]
        chunk_kread_kernel[(n_chunks, batch * heads)](
            w.contiguous(), k, v.contiguous(), ptr(a), ptr(kh), ptr(beta), g, ptr(x_read), acc,
            seq_len, heads, dk, dv, THRESH, NW=n_w, NWP=_pow2(n_w), BV=max(16, next_power_of_2(dv)),
            HDLA=hdla is not None, SWAP_AB=swap_ab, SHIFT=int(shift), STRICT=strict,
            num_warps=_kread_warps(bk, dv), **transition,
        )
        out[name] = acc
    if store_final:
        out["final"] = final
    return out


def _scan_cumsum(x: torch.Tensor, reverse_scan: bool) -> torch.Tensor:
    """Sum over the scan steps at or after each one: ``[B, T, H, K]`` (scanned along the last
    dim, where PyTorch's scan is fast)."""
    x = x.movedim(1, -1)
    if reverse_scan:  # scan runs T-1 -> 0, "after" means smaller t
        return x.cumsum(-1).movedim(-1, 1)
    return x.flip(-1).cumsum(-1).flip(-1).movedim(-1, 1)


def generalized_backward(saved, do, dht, scale, reverse, hdla=None, need_dg=True, adj_queries=None):
    """Gradients of the generalized op; see the module docstring.

    ``saved`` holds q, k, v, a, b, g, h0, x (reads of the forward pass), ht (final state); b is read only
    with h0 or ``need_dg`` (else it may be None). ``adj_queries``: the adjoint scan's queries ``[A | K]``
    ``[B, T, H, r_ab + r_kv, K]`` fp32 where the caller has them (else they are concatenated here).
    Returns dq, dk, dv, da, db, dg, dh0 (fp32; da/db for the materialised A, B); without
    ``need_dg`` the caller forms dg itself and dg is left out of the tuple.
    """
    q, k, v, a, b, g, h0, x, ht = saved
    r_ab = a.shape[3]
    do = do.contiguous()
    if hdla is not None:
        transition = dict(hdla=hdla)
    else:
        transition = dict(a=a, b=b) if r_ab else {}
    if adj_queries is None:
        adj_queries = torch.cat([a, k], dim=3) if r_ab else k
    adj_w_post = torch.cat([v.to(torch.float32), x], dim=3) if r_ab else v
    adjoint = chunk_scan(
        adj_queries.to(torch.float32), q.unsqueeze(3), (do * scale).unsqueeze(3).to(torch.float32), g,
        **transition, initial_state=dht, reverse=not reverse, shift=True, swap_ab=True,
        store_final=True, w_post=adj_w_post,
    )
    y, dv = adjoint["o"][:, :, :, :r_ab], adjoint["o"][:, :, :, r_ab:]
    dk, da = adjoint["k_post"][:, :, :, : k.shape[3]], -adjoint["k_post"][:, :, :, k.shape[3]:]
    recompute = chunk_scan(
        None, k, v, g, **transition, initial_state=h0, reverse=reverse,
        x_given=x if r_ab else None, w_post=do.unsqueeze(3), w_pre=y if r_ab else None,
    )
    dq = scale * recompute["k_post"][:, :, :, 0]
    db = -recompute["k_pre"] if r_ab else torch.zeros_like(a, dtype=torch.float32)

    first = -1 if reverse else 0  # the first scanned token
    z_first = adjoint["final"]
    dh0 = None
    if h0 is not None:
        dh0 = g[:, first].float().exp().unsqueeze(-1) * z_first
        if r_ab:
            dh0 = dh0 - torch.einsum("bhrk,bhrv->bhkv", b[:, first].float(), y[:, first])

    if not need_dg:
        return dq, dk, dv, da, db, dh0
    own = q.float() * dq - (k.float() * dk).sum(3)
    later = torch.zeros_like(own)
    if r_ab:
        own = own - (a.float() * da).sum(3)
        later = (b.float() * db).sum(3)
    dg = _scan_cumsum(own + later, reverse) - later
    if dht is not None:
        dg = dg + (ht * dht.float()).sum(-1).unsqueeze(1)
    dg = torch.where(g < LOG_ZERO_FP32, 0.0, dg)  # the kernels clamp g there (g = -inf: a reset), so dL/dg = 0
    return dq, dk, dv, da, db, dg, dh0


def stored_reads_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the reads ``X = S^T B`` the forward keeps for the backward: bf16 for 16-bit inputs (half
    the memory of fp32, fp32's range: the reads grow with the state), fp32 otherwise. The backward's
    recompute pass takes them as given (``x_given``) and its dA readouts read them, so their rounding is
    of the order of the 16-bit inputs' own."""
    return torch.bfloat16 if dtype in (torch.bfloat16, torch.float16) else torch.float32


def triton_generalized_forward(q, k, v, a, b, g, scale, initial_state, reverse):
    """Forward of the Triton path (inputs checked, g per channel ``[B, T, H, K]``).

    Returns ``o [B, T, H, V]`` (q's dtype), the final state ``[B, H, K, V]`` (fp32) and the reads
    ``x [B, T, H, r_ab, V]`` (:func:`stored_reads_dtype`; None at r_ab = 0) that the backward needs."""
    r_ab = a.shape[3]
    fwd = chunk_scan(
        q.unsqueeze(3), k, v, g, a=a if r_ab else None, b=b if r_ab else None, scale=scale,
        initial_state=initial_state, reverse=reverse, store_x=r_ab > 0, store_final=True,
        x_dtype=stored_reads_dtype(q.dtype),
    )
    return fwd["o"][:, :, :, 0], fwd["final"], fwd.get("x")


def triton_generalized_backward(do, dht, q, k, v, a, b, g, initial_state, x, ht, scale, reverse):
    """Backward of the Triton path: ``(dq, dk, dv, da, db, dg, dh0)`` in the inputs' dtypes (dh0 None
    without an initial state). ``dht`` (or None) is the final state's cotangent, ``x`` and ``ht`` the
    forward's reads and final state."""
    grads = generalized_backward((q, k, v, a, b, g, initial_state, x, ht), do, dht, scale, reverse)
    refs = (q, k, v, a, b, g, initial_state)
    return tuple(None if t is None else t.to(ref.dtype) for t, ref in zip(grads, refs))
