"""TEMPORARY stand-in for ``kernels.generalized.fwd.chunk_prepare`` / ``chunk_state_pass`` (issue 11).

The forward helper builds the Triton versions; until they are merged, the backward kernels in
``bwd.py`` read their inputs (N, Qeff, gamma per chunk, and the per-chunk entering states h)
from this PyTorch implementation of the same interface (/work/kernel_plan.md, "The interface").
It computes the chunk map in float64 with exact pairwise decays and casts to the interface's
dtypes. Delete this module once ``fwd.py`` exists; ``bwd._chunk_prepare`` is the only caller.
"""
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..hdla.naive import hdla_decay_factors
from ..utils import LOG_ZERO_FP32


def default_chunk(r_ab: int, r_kv: int, dk: int) -> int:
    """C = 64 where r_ab*C <= 128, r_kv*C <= 128 and K <= 128, else 32, else 16 (kernel_plan.md)."""
    for c in (64, 32, 16):
        if r_ab * c <= 128 and r_kv * c <= 128 and (c < 64 or dk <= 128):
            return c
    return 16


def _chunked(x: torch.Tensor, reverse: bool, c: int) -> torch.Tensor:
    """``[B, T, H, ...] -> [B, H, NT, C, ...]`` in scan order, zero-padded, float64."""
    x = x.double()
    x = x.flip(1) if reverse else x
    x = x.transpose(1, 2)
    pad = -x.shape[2] % c
    x = F.pad(x, [0, 0] * (x.dim() - 3) + [0, pad])
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] // c, c, *x.shape[3:])


def _pairwise(X: torch.Tensor, Y: torch.Tensor, rx: int, ry: int, strict: bool) -> torch.Tensor:
    """exp(X_t - Y_i) per channel for token pairs (i < t or i <= t), on flat rank rows: ``[.., C rx, C ry, K]``."""
    c = X.shape[-2]
    t = torch.arange(c, device=X.device)
    mask = (t[None, :] < t[:, None]) if strict else (t[None, :] <= t[:, None])
    e = (X.unsqueeze(-2) - Y.unsqueeze(-3)).masked_fill(~mask[..., None], float("-inf")).exp()
    return e.repeat_interleave(rx, -3).repeat_interleave(ry, -2)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def prepare_reference(q, k, v, a, b, g, scale, reverse, hdla_beta=None, chunk=None) -> Dict[str, torch.Tensor]:
    """PyTorch ``chunk_prepare``: N, Cc, Qeff, Mo, gamma per chunk and the chunk size (shapes in
    kernel_plan.md). HDLA: a, b are None and ``hdla_beta [B, T, H]`` builds them; k, v are then
    ``[B, T, H, K]``, ``[B, T, H, V]``."""
    g = g.clamp(min=LOG_ZERO_FP32)
    if hdla_beta is not None:
        a, b = hdla_decay_factors(k.double(), hdla_beta.double(), g.double())
        k, v = k.unsqueeze(3), v.unsqueeze(3)
    if g.dim() == 3:
        g = g.unsqueeze(-1).expand(*g.shape, q.shape[-1])
    r_kv, r_ab, dk = k.shape[3], a.shape[3], q.shape[-1]
    c = chunk or default_chunk(r_ab, r_kv, dk)
    qc, kc, vc, ac, bc, gc = (_chunked(x, reverse, c) for x in (q, k, v, a, b, g))
    G = gc.cumsum(-2)
    Gp = G - gc
    GL = G[..., -1:, :]
    Kf, Vf, Af = _flat(kc), _flat(vc), _flat(ac)
    Qh = scale * qc * G.exp()
    Kt = Kf * (GL - G).exp().repeat_interleave(r_kv, -2)
    m_qk = torch.einsum("...tk,...ik,...tik->...ti", scale * qc, Kf, _pairwise(G, G, 1, r_kv, False))
    nt = qc.shape[2]
    if r_ab:
        Bf = _flat(bc)
        At = Af * (GL - G).exp().repeat_interleave(r_ab, -2)
        Bh = Bf * Gp.exp().repeat_interleave(r_ab, -2)
        l_ab = torch.einsum("...tk,...ik,...tik->...ti", Bf, Af, _pairwise(Gp, G, r_ab, r_ab, True))
        l_kb = torch.einsum("...tk,...ik,...tik->...ti", Bf, Kf, _pairwise(Gp, G, r_ab, r_kv, True))
        m_qa = torch.einsum("...tk,...ik,...tik->...ti", scale * qc, Af, _pairwise(G, G, 1, r_ab, False))
        eye = torch.eye(c * r_ab, dtype=torch.float64, device=q.device)
        tinv = torch.linalg.solve_triangular(eye + l_ab, eye.expand_as(l_ab), upper=False, unitriangular=True)
        W, U = tinv @ Bh, tinv @ l_kb
        qeff, mo = Qh - m_qa @ W, m_qk - m_qa @ U
        n_mat = At.transpose(-1, -2) @ W
        cc = (Kt.transpose(-1, -2) - At.transpose(-1, -2) @ U) @ Vf
    else:
        qeff, mo = Qh, m_qk
        n_mat = torch.zeros(*qc.shape[:3], dk, dk, dtype=torch.float64, device=q.device)
        cc = Kt.transpose(-1, -2) @ Vf
    low = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    return dict(N=n_mat.to(low), Cc=cc.float(), Qeff=qeff.reshape(*qeff.shape[:2], nt * c, dk).to(low),
                Mo=mo.to(low), gamma=GL.squeeze(-2).exp().float(), chunk=c)


def state_pass_reference(prep, initial_state: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """PyTorch ``chunk_state_pass``: (h ``[B, H, NT, K, V]``, the state entering each chunk, in N's
    dtype; final state ``[B, H, K, V]`` fp32)."""
    n_mat, cc, gamma = prep["N"].float(), prep["Cc"], prep["gamma"]
    state = torch.zeros_like(cc[:, :, 0]) if initial_state is None else initial_state.float()
    states = []
    for i in range(n_mat.shape[2]):
        states.append(state)
        state = gamma[:, :, i, :, None] * state - n_mat[:, :, i] @ state + cc[:, :, i]
    return torch.stack(states, 2).to(prep["N"].dtype), state
