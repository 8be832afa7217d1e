"""HDLA chunk op: the generalized kernel with A and B built inside it from (k, beta, log lambda).

Forward and both backward scans read only k, beta and g for the transition; the backward
materialises A and B once (``hdla_decay_factors``) for the readout queries, and a fused
epilogue (``backward.py``) turns dq, dK, dA, dB into dk, dbeta and dg.
"""
import torch
import triton

from ..generalized.chunk import chunk_scan, generalized_backward
from .backward import hdla_backward_epilogue_kernel
from .naive import hdla_decay_factors


class ChunkHDLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, g, scale, initial_state, output_final_state, reverse):
        fwd = chunk_scan(
            q.unsqueeze(3), k.unsqueeze(3), v.unsqueeze(3), g, hdla=(k, beta), scale=scale,
            initial_state=initial_state, reverse=reverse, store_x=True, store_final=True,
        )
        ctx.save_for_backward(q, k, v, beta, g, initial_state, fwd["x"], fwd["final"])
        ctx.scale, ctx.reverse = scale, reverse
        final = fwd["final"].to(q.dtype) if output_final_state else None
        return fwd["o"][:, :, :, 0], final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, g, h0, x, ht = ctx.saved_tensors
        a, b = hdla_decay_factors(k.float(), beta.float(), g.float())
        dq, dk_write, dv, da, db, dh0 = generalized_backward(
            (q, k.unsqueeze(3), v.unsqueeze(3), a, b, g, h0, x, ht),
            do, dht, ctx.scale, ctx.reverse, hdla=(k, beta), need_dg=False,
        )
        batch, seq_len, heads, dim = k.shape
        dk, dg = torch.empty_like(dq), torch.empty_like(dq)
        dbeta = torch.empty(batch, seq_len, heads, device=k.device, dtype=torch.float32)
        final_term = (ht * dht.float()).sum(-1) if dht is not None else dq
        hdla_backward_epilogue_kernel[(batch * heads,)](
            q.contiguous(), k.contiguous(), beta.contiguous(), g.contiguous(), dq.contiguous(),
            dk_write[:, :, :, 0].contiguous(), da.contiguous(), db.contiguous(), final_term,
            dk, dbeta, dg, seq_len, heads, dim,
            BT=16, BK=max(16, triton.next_power_of_2(dim)), REVERSE=ctx.reverse, HAS_FINAL=dht is not None,
            num_warps=4 if dim <= 64 else 8,
        )
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv[:, :, :, 0].to(v.dtype),
            dbeta.to(beta.dtype),
            dg.to(g.dtype),
            None,
            None if dh0 is None else dh0.to(h0.dtype),
            None,
            None,
        )


def triton_chunk_hdla(q, k, v, beta, g, scale=None, initial_state=None, output_final_state=False, reverse=False):
    """Triton path of :func:`hdla_vision.kernels.chunk_hdla` (inputs already checked)."""
    scale = 1.0 if scale is None else float(scale)
    return ChunkHDLAFunction.apply(q, k, v, beta, g, scale, initial_state, output_final_state, reverse)
