"""Float64 PyTorch specification of the chunk backward (issue 11, kernels/README.md §8 notation).

The chunk map of the generalized recurrence (per batch, head and chunk c; scan order inside the
chunk, padded tokens are identity steps) and its hand-written VJP, which the Triton kernels of
``kernels/generalized/bwd.py`` implement stage by stage:

    O_c = Qeff_c S_{c-1} + Mo_c Vbar_c,   S_c = gamma (.) S_{c-1} - N_c S_{c-1} + Cc_c

Flattened rank rows are token-major, rank fastest: row ``t * r + j`` is column j of token t.
Every decay factor is exp of a difference X_t - Y_i with t >= i (never exp(-G)).
"""
from typing import Dict

import torch
import torch.nn.functional as F

from hdla_vision.kernels.hdla.naive import hdla_decay_factors


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[..., C, r, D] -> [..., C*r, D]`` (token-major, rank fastest)."""
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def _rows(x: torch.Tensor, r: int) -> torch.Tensor:
    """A per-token ``[..., C, D]`` repeated for each of the r rank rows: ``[..., C*r, D]``."""
    return x.repeat_interleave(r, dim=-2)


def _token_mask(c: int, rx: int, ry: int, strict: bool, device) -> torch.Tensor:
    """``[C*rx, C*ry]`` mask of flat rows (t, j), columns (i, l) with i < t (strict) or i <= t."""
    t = torch.arange(c, device=device).repeat_interleave(rx)
    i = torch.arange(c, device=device).repeat_interleave(ry)
    return (i[None, :] < t[:, None]) if strict else (i[None, :] <= t[:, None])


def gram(x, X, y, Y, mask):
    """``M[t, i] = sum_k x_tk y_ik exp(X_tk - Y_ik)`` where mask, else 0 (pairwise, exact)."""
    diff = (X.unsqueeze(-2) - Y.unsqueeze(-3)).masked_fill(~mask[..., None], float("-inf"))
    return torch.einsum("...tk,...ik,...tik->...ti", x, y, diff.exp())


def gram_vjp(D, x, X, y, Y, mask):
    """VJP of :func:`gram` for the cotangent D: ``(dx, dX, dy, dY)``."""
    diff = (X.unsqueeze(-2) - Y.unsqueeze(-3)).masked_fill(~mask[..., None], float("-inf"))
    e = diff.exp()
    D = D.masked_fill(~mask, 0.0)
    dx = torch.einsum("...ti,...ik,...tik->...tk", D, y, e)
    dy = torch.einsum("...ti,...tk,...tik->...ik", D, x, e)
    return dx, x * dx, dy, -(y * dy)


def chunk_tensors(q, k, v, a, b, g, reverse: bool, c: int):
    """Inputs in chunk layout, scan order, zero-padded: q, g ``[B, H, NT, C, K]``, k ``[.., C, r_kv, K]``,
    v ``[.., C, r_kv, V]``, a, b ``[.., C, r_ab, K]``. g ``[B, T, H]`` is broadcast over K."""
    if g.dim() == 3:
        g = g.unsqueeze(-1).expand_as(q)
    seq_len = q.shape[1]
    n = -(-seq_len // c)
    pad = n * c - seq_len

    def prep(x):
        x = x.flip(1) if reverse else x
        x = x.transpose(1, 2)
        x = F.pad(x, [0, 0] * (x.dim() - 3) + [0, pad])
        return x.reshape(x.shape[0], x.shape[1], n, c, *x.shape[3:])

    return [prep(x) for x in (q, k, v, a, b, g)]


def chunk_intermediates(q, k, v, a, b, g, scale) -> Dict[str, torch.Tensor]:
    """Every quantity of the chunk map (kernels/README.md §8), batched over leading dims."""
    c, r_kv, r_ab = q.shape[-2], k.shape[-2], a.shape[-2]
    dev = q.device
    G = g.cumsum(-2)
    Gp = G - g
    GL = G[..., -1:, :]
    z = dict(G=G, Gp=Gp, gamma=GL.squeeze(-2).exp())
    Kf, Vf, Af, Bf = _flat(k), _flat(v), _flat(a), _flat(b)
    Gk, Ga, Gpb = _rows(G, r_kv), _rows(G, r_ab), _rows(Gp, r_ab)
    z.update(Kf=Kf, Vf=Vf, Af=Af, Bf=Bf)
    z["Qh"] = scale * q * G.exp()
    z["Kt"] = Kf * (GL - Gk).exp()
    z["M_QK"] = gram(scale * q, G, Kf, Gk, _token_mask(c, 1, r_kv, False, dev))
    if r_ab:
        z["At"] = Af * (GL - Ga).exp()
        z["Bh"] = Bf * Gpb.exp()
        z["L_AB"] = gram(Bf, Gpb, Af, Ga, _token_mask(c, r_ab, r_ab, True, dev))
        z["L_KB"] = gram(Bf, Gpb, Kf, Gk, _token_mask(c, r_ab, r_kv, True, dev))
        z["M_QA"] = gram(scale * q, G, Af, Ga, _token_mask(c, 1, r_ab, False, dev))
        eye = torch.eye(c * r_ab, dtype=q.dtype, device=dev)
        z["T"] = torch.linalg.solve_triangular(eye + z["L_AB"], eye.expand_as(z["L_AB"]), upper=False,
                                               unitriangular=True)
        z["W"] = z["T"] @ z["Bh"]
        z["U"] = z["T"] @ z["L_KB"]
        z["Qeff"] = z["Qh"] - z["M_QA"] @ z["W"]
        z["Mo"] = z["M_QK"] - z["M_QA"] @ z["U"]
        z["N"] = z["At"].transpose(-1, -2) @ z["W"]
        z["E"] = z["Kt"].transpose(-1, -2) - z["At"].transpose(-1, -2) @ z["U"]
    else:
        z["Qeff"], z["Mo"] = z["Qh"], z["M_QK"]
        z["N"] = torch.zeros(*q.shape[:-2], q.shape[-1], q.shape[-1], dtype=q.dtype, device=dev)
        z["E"] = z["Kt"].transpose(-1, -2)
    z["Cc"] = z["E"] @ Vf
    return z


def state_pass(z, h0):
    """States entering each chunk ``[B, H, NT, K, V]`` and the final state."""
    state, states = h0, []
    for i in range(z["N"].shape[2]):
        states.append(state)
        state = z["gamma"][:, :, i, :, None] * state - z["N"][:, :, i] @ state + z["Cc"][:, :, i]
    return torch.stack(states, 2), state


def ds_pass(z, do, dht):
    """B1: ``dS_c`` (the cotangent of the state leaving chunk c) ``[B, H, NT, K, V]`` and dh0."""
    ds, dss = dht, []
    for i in range(z["N"].shape[2] - 1, -1, -1):
        dss.append(ds)
        ds = (z["gamma"][:, :, i, :, None] * ds - z["N"][:, :, i].transpose(-1, -2) @ ds
              + z["Qeff"][:, :, i].transpose(-1, -2) @ do[:, :, i])
    return torch.stack(dss[::-1], 2), ds


def chunk_vjp(z, q, k, a, b, s_in, do, ds_out, scale):
    """B2: the chunk VJP. Returns dq, dk, dv, da, db ``[.., C, (r,) D]`` and dG, dGp ``[.., C, K]``
    (the cotangents of the inclusive / exclusive log-decay cumsums; dg follows by a reverse cumsum)."""
    c, r_kv, r_ab = q.shape[-2], k.shape[-2], a.shape[-2]
    dev = q.device
    tr = lambda x: x.transpose(-1, -2)  # noqa: E731
    mask_qk = _token_mask(c, 1, r_kv, False, dev)
    dQeff = do @ tr(s_in)
    dMo = (do @ tr(z["Vf"])).masked_fill(~mask_qk, 0.0)
    dVf = tr(z["Mo"]) @ do + tr(z["E"]) @ ds_out
    dE = ds_out @ tr(z["Vf"])  # [K, r_kv C]
    dKt = tr(dE)
    dgamma = (ds_out * s_in).sum(-1)
    dQh = dQeff
    dM_QK = dMo
    G, Gp, GL = z["G"], z["Gp"], z["G"][..., -1, :]
    Gk = _rows(G, r_kv)
    dG = z["Qh"] * dQh
    dGL = z["gamma"] * dgamma + (z["Kt"] * dKt).sum(-2)
    dKf = dKt * (GL.unsqueeze(-2) - Gk).exp()
    dGk = -(z["Kt"] * dKt)
    dx, dX, dy, dY = gram_vjp(dM_QK, scale * q, G, z["Kf"], Gk, mask_qk)
    dq = scale * (dQh * G.exp() + dx)
    dG = dG + dX
    dKf, dGk = dKf + dy, dGk + dY
    dGp = torch.zeros_like(G)
    dAf = dBf = None
    if r_ab:
        Ga, Gpb = _rows(G, r_ab), _rows(Gp, r_ab)
        dN = -ds_out @ tr(s_in)
        dAt = -z["U"] @ tr(dE) + z["W"] @ tr(dN)
        dU = -z["At"] @ dE - tr(z["M_QA"]) @ dMo
        dW = z["At"] @ dN - tr(z["M_QA"]) @ dQeff
        dM_QA = -dQeff @ tr(z["W"]) - dMo @ tr(z["U"])
        dWp, dUp = tr(z["T"]) @ dW, tr(z["T"]) @ dU
        dBh, dL_KB = dWp, dUp
        dL_AB = -dWp @ tr(z["W"]) - dUp @ tr(z["U"])
        dAf = dAt * (GL.unsqueeze(-2) - Ga).exp()
        dGL = dGL + (z["At"] * dAt).sum(-2)
        dGa = -(z["At"] * dAt)
        dBf = dBh * Gpb.exp()
        dGpb = z["Bh"] * dBh
        dx, dX, dy, dY = gram_vjp(dM_QA, scale * q, G, z["Af"], Ga, _token_mask(c, 1, r_ab, False, dev))
        dq, dG, dAf, dGa = dq + scale * dx, dG + dX, dAf + dy, dGa + dY
        dx, dX, dy, dY = gram_vjp(dL_AB, z["Bf"], Gpb, z["Af"], Ga, _token_mask(c, r_ab, r_ab, True, dev))
        dBf, dGpb, dAf, dGa = dBf + dx, dGpb + dX, dAf + dy, dGa + dY
        dx, dX, dy, dY = gram_vjp(dL_KB, z["Bf"], Gpb, z["Kf"], Gk, _token_mask(c, r_ab, r_kv, True, dev))
        dBf, dGpb, dKf, dGk = dBf + dx, dGpb + dX, dKf + dy, dGk + dY
        dG = dG + dGa.reshape(*G.shape[:-1], r_ab, -1).sum(-2)
        dGp = dGp + dGpb.reshape(*G.shape[:-1], r_ab, -1).sum(-2)
    dG = dG + dGk.reshape(*G.shape[:-1], r_kv, -1).sum(-2)
    dG[..., -1, :] += dGL
    unflat = lambda x, r: x.reshape(*x.shape[:-2], c, r, x.shape[-1])  # noqa: E731
    out = dict(dq=dq, dk=unflat(dKf, r_kv), dv=unflat(dVf, r_kv), dG=dG, dGp=dGp)
    out["da"] = unflat(dAf, r_ab) if r_ab else torch.zeros_like(a)
    out["db"] = unflat(dBf, r_ab) if r_ab else torch.zeros_like(b)
    return out


def dg_from_cumsum_grads(dG, dGp):
    """``g -> G = cumsum(g), G' = G - g``: dg_s = sum_{t >= s} dG_t + sum_{t > s} dG'_t (chunk-local)."""
    rev = lambda x: x.flip(-2).cumsum(-2).flip(-2)  # noqa: E731
    return rev(dG + dGp) - dGp


def unchunk(x, seq_len, reverse):
    """``[B, H, NT, C, ...] -> [B, T, H, ...]`` (token order)."""
    x = x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])[:, :, :seq_len]
    x = x.transpose(1, 2)
    return x.flip(1) if reverse else x


def generalized_backward_reference(do, dht, q, k, v, a, b, g, scale, initial_state, reverse, c=16,
                                   floor=-750.0):
    """Full backward in float64 by the chunk algorithm: (dq, dk, dv, da, db, dg, dh0).
    g is clamped at ``floor`` (dg = 0 below it), as the kernels clamp at -110 in fp32."""
    batch, seq_len, heads, dk_ = q.shape
    dv_ = v.shape[-1]
    g_in = g
    g = g.clamp(min=floor)
    qc, kc, vc, ac, bc, gc = chunk_tensors(q, k, v, a, b, g, reverse, c)
    (doc,) = chunk_tensors(do, k, v, a, b, g, reverse, c)[:1]
    z = chunk_intermediates(qc, kc, vc, ac, bc, gc, scale)
    h0 = q.new_zeros(batch, heads, dk_, dv_) if initial_state is None else initial_state
    h, _ = state_pass(z, h0)
    dht = q.new_zeros(batch, heads, dk_, dv_) if dht is None else dht
    ds, dh0 = ds_pass(z, doc, dht)
    gr = chunk_vjp(z, qc, kc, ac, bc, h, doc, ds, scale)
    dg = unchunk(dg_from_cumsum_grads(gr["dG"], gr["dGp"]), seq_len, reverse)
    dg = torch.where(g_in < floor, 0.0, dg) if g_in.dim() == 4 else torch.where(g_in < floor, 0.0, dg.sum(-1))
    out = [unchunk(gr[n], seq_len, reverse) for n in ("dq", "dk", "dv", "da", "db")]
    return (*out, dg, dh0)


def hdla_backward_reference(do, dht, q, k, v, beta, g, scale, initial_state, reverse, c=16):
    """HDLA backward in float64: (dq, dk, dv, dbeta, dg, dh0), via the generalized one and the chain
    rule through A = [beta u, k], B = [k, beta u - beta^2 s k], u = exp(g) k, s = k.u."""
    gc = g.clamp(min=-750.0)
    a, b = hdla_decay_factors(k, beta, gc)
    dq, dkw, dv, da, db, dg, dh0 = generalized_backward_reference(
        do, dht, q, k.unsqueeze(3), v.unsqueeze(3), a, b, g, scale, initial_state, reverse, c)
    bt = beta.unsqueeze(-1)
    lam = gc.exp()
    u = lam * k
    s = (u * k).sum(-1, keepdim=True)
    da0, da1, db0, db1 = da[:, :, :, 0], da[:, :, :, 1], db[:, :, :, 0], db[:, :, :, 1]
    ds = -bt * bt * (db1 * k).sum(-1, keepdim=True)
    dk = dkw[:, :, :, 0] + da1 + db0 + bt * lam * (da0 + db1) - bt * bt * s * db1 + 2 * ds * u
    dg = dg + torch.where(g < -750.0, 0.0, bt * u * (da0 + db1) + ds * u * k)
    dbeta = (u * (da0 + db1)).sum(-1) - 2 * beta * s.squeeze(-1) * (db1 * k).sum(-1)
    return dq, dk, dv[:, :, :, 0], dbeta, dg, dh0
