"""HDLA chunk op: the generalized kernel with A and B built inside it from (k, beta, log lambda).

Forward and both backward scans read only k, beta and g for the transition; the backward
materialises A and B once (``hdla_decay_factors``) for the readout queries, and a fused
epilogue (``backward.py``) turns dq, dK, dA, dB into dk, dbeta and dg.
"""
import torch

from ..generalized.chunk import chunk_scan, generalized_backward, stored_reads_dtype
from .backward import hdla_backward_epilogue_kernel
from .naive import hdla_decay_factors
from ..utils import next_power_of_2


def triton_hdla_forward(q, k, v, beta, g, scale, initial_state, reverse):
    """Forward of the Triton path (inputs checked): ``o [B, T, H, V]`` (q's dtype), the final state
    ``[B, H, K, V]`` (fp32) and the reads ``x [B, T, H, 2, V]`` (bf16 for 16-bit inputs, else fp32:
    ``generalized.chunk.stored_reads_dtype``) that the backward needs."""
    fwd = chunk_scan(
        q.unsqueeze(3), k.unsqueeze(3), v.unsqueeze(3), g, hdla=(k, beta), scale=scale,
        initial_state=initial_state, reverse=reverse, store_x=True, store_final=True,
        x_dtype=stored_reads_dtype(q.dtype),
    )
    return fwd["o"][:, :, :, 0], fwd["final"], fwd["x"]


def adjoint_queries(k, beta, g):
    """The adjoint scan's queries ``[A | k] = [beta lambda k, k, k]`` ``[B, T, H, 3, K]`` fp32 (A as
    ``hdla_decay_factors`` builds it) in five launches, written in place rather than stacked and concatenated."""
    queries = torch.empty(*k.shape[:3], 3, k.shape[-1], device=k.device, dtype=torch.float32)
    torch.mul(g.float().exp().mul_(k), beta.unsqueeze(-1), out=queries[..., 0, :])
    queries[..., 1, :] = k
    queries[..., 2, :] = k
    return queries


def triton_hdla_backward(do, dht, q, k, v, beta, g, h0, x, ht, scale, reverse):
    """Backward of the Triton path: ``(dq, dk, dv, dbeta, dg, dh0)`` in the inputs' dtypes (dh0 None
    without an initial state); ``dht`` (or None) is the final state's cotangent."""
    queries = adjoint_queries(k, beta, g)
    b = hdla_decay_factors(k.float(), beta.float(), g.float())[1] if h0 is not None else None  # dh0 reads B
    dq, dk_write, dv, da, db, dh0 = generalized_backward(
        (q, k.unsqueeze(3), v.unsqueeze(3), queries[:, :, :, :2], b, g, h0, x, ht),
        do, dht, scale, reverse, hdla=(k, beta), need_dg=False, adj_queries=queries,
    )
    batch, seq_len, heads, dim = k.shape
    dk, dg = torch.empty_like(dq), torch.empty_like(dq)
    dbeta = torch.empty(batch, seq_len, heads, device=k.device, dtype=torch.float32)
    final_term = (ht * dht.float()).sum(-1) if dht is not None else dq
    hdla_backward_epilogue_kernel[(batch * heads,)](
        q.contiguous(), k.contiguous(), beta.contiguous(), g.contiguous(), dq.contiguous(),
        dk_write[:, :, :, 0].contiguous(), da.contiguous(), db.contiguous(), final_term,
        dk, dbeta, dg, seq_len, heads, dim,
        BT=16, BK=max(16, next_power_of_2(dim)), REVERSE=reverse, HAS_FINAL=dht is not None,
        num_warps=4 if dim <= 64 else 8,
    )
    return (dq.to(q.dtype), dk.to(k.dtype), dv[:, :, :, 0].to(v.dtype), dbeta.to(beta.dtype), dg.to(g.dtype),
            None if dh0 is None else dh0.to(h0.dtype))
