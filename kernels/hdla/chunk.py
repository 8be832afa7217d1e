"""HDLA chunk op: the generalized kernel with A and B built inside it from (k, beta, log lambda).

Forward and both backward scans read only k, beta and g for the transition; the backward
materialises A and B once (``hdla_decay_factors``) for the readout queries and the chain rule
from dA, dB back to k, beta and g.
"""
import torch

from ..generalized.chunk import chunk_scan, generalized_backward
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
        with torch.enable_grad():
            kf, betaf, gf = (t.detach().float().requires_grad_() for t in (k, beta, g))
            a, b = hdla_decay_factors(kf, betaf, gf)
        dq, dk, dv, da, db, dg, dh0 = generalized_backward(
            (q, k.unsqueeze(3), v.unsqueeze(3), a.detach(), b.detach(), g, h0, x, ht),
            do, dht, ctx.scale, ctx.reverse, hdla=(k, beta),
        )
        dk_ab, dbeta, dg_ab = torch.autograd.grad((a, b), (kf, betaf, gf), (da, db))
        return (
            dq.to(q.dtype),
            (dk[:, :, :, 0] + dk_ab).to(k.dtype),
            dv[:, :, :, 0].to(v.dtype),
            dbeta.to(beta.dtype),
            (dg + dg_ab).to(g.dtype),
            None,
            None if dh0 is None else dh0.to(h0.dtype),
            None,
            None,
        )


def triton_chunk_hdla(q, k, v, beta, g, scale=None, initial_state=None, output_final_state=False, reverse=False):
    """Triton path of :func:`hdla_vision.kernels.chunk_hdla` (inputs already checked)."""
    scale = 1.0 if scale is None else float(scale)
    return ChunkHDLAFunction.apply(q, k, v, beta, g, scale, initial_state, output_final_state, reverse)
