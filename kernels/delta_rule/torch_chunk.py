"""The rank-one delta rule with a separate write scale, in chunks, as batched PyTorch products (kernels/README.md §12).

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + omega_t k_t v_t^T,      o_t = scale * S_t^T q_t

is KDA's recurrence (``omega = beta``) with the write's scale ``omega`` apart from the Householder coefficient
``beta``: HDLA is this recurrence over two steps per token (kernels/README.md §2, :mod:`.steps`). Within a chunk of
C steps, with G the inclusive cumulative log-decay (per channel) and the read r_t = k_t^T Diag(e^{g_t}) S_{t-1},
each step writes k_t u_t^T with u_t = omega_t v_t - beta_t r_t, so (§12):

    A[t, i]   = beta_t sum_c k_tc k_ic e^{G_tc - G_ic}                (i < t)
    Aqk[t, i] = scale sum_c q_tc k_ic e^{G_tc - G_ic}                 (i <= t)
    T = (I + A)^-1,   w = T (beta k e^G),   u~ = T (omega v)
    U = u~ - w S_0,   O = scale (q e^G) S_0 + Aqk U,   S_C = e^{G_C} S_0 + (k e^{G_C - G})^T U

This module is the CPU form of the Triton kernels in :mod:`.chunk` and the specification they follow; every decay
is a difference of cumulative sums with a known sign (<= 0), as the kernels take them.
"""
from typing import Optional, Tuple

import torch

from ..utils import log_zero

CHUNK = 64


def _chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, T, H, ...]`` -> ``[B, H, N, C, ...]``, padded at the end with zeros (identity steps: no decay, no
    reflection, no write, no read)."""
    batch, seq_len, heads = x.shape[:3]
    n_chunks = -(-seq_len // chunk)
    pad = n_chunks * chunk - seq_len
    x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
    x = x.reshape(batch, n_chunks, chunk, heads, *x.shape[3:])
    return x.transpose(2, 3).transpose(1, 2)


def chunk_terms(q, k, v, beta, g, write, scale: float, chunk: int = CHUNK):
    """Each chunk's terms, ``[B, H, N, ...]``: ``Aqk [C, C]``, ``w [C, K]``, ``u~ [C, V]``, ``kg [C, K]``
    (= k e^{G_C - G}), ``qg [C, K]`` (= scale q e^G), ``gamma [K]`` (= e^{G_C}); float64 or fp32 as the inputs."""
    qc, kc, vc, gc = (_chunked(x, chunk) for x in (q, k, v, g))
    bc, wc = (_chunked(x.unsqueeze(-1), chunk) for x in (beta, write))
    G = gc.cumsum(3)
    steps = torch.arange(chunk, device=q.device)
    # e^{G_t - G_i} for i <= t (exponent <= 0); the upper triangle's exponent set to -inf before exp
    below = (steps[:, None] >= steps[None, :]).view(1, 1, 1, chunk, chunk, 1)
    pair = torch.where(below, G.unsqueeze(4) - G.unsqueeze(3), float("-inf")).exp()  # [B, H, N, C, C, K]
    strict = (steps[:, None] > steps[None, :]).to(q.dtype)
    a_mat = bc * torch.einsum("bhntc,bhnic,bhntic->bhnti", kc, kc, pair) * strict
    aqk = scale * torch.einsum("bhntc,bhnic,bhntic->bhnti", qc, kc, pair)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    t_mat = torch.linalg.solve_triangular(eye + a_mat, eye.expand_as(a_mat), upper=False, unitriangular=True)
    w = t_mat @ (bc * kc * G.exp())
    u = t_mat @ (wc * vc)
    last = G[:, :, :, -1:]
    return dict(aqk=aqk, w=w, u=u, kg=kc * (last - G).exp(), qg=scale * qc * G.exp(), gamma=last.squeeze(3).exp())


def state_pass(terms, initial_state: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The serial pass over chunks: ``(h [B, H, N, K, V]`` the state entering each chunk, ``U [B, H, N, C, V]``,
    the final state ``[B, H, K, V])``."""
    w, u, kg, gamma = terms["w"], terms["u"], terms["kg"], terms["gamma"]
    batch, heads, n_chunks, _, dk = w.shape
    state = w.new_zeros(batch, heads, dk, u.shape[-1]) if initial_state is None else initial_state.to(w.dtype)
    states, news = [], []
    for n in range(n_chunks):
        states.append(state)
        new = u[:, :, n] - w[:, :, n] @ state
        news.append(new)
        state = gamma[:, :, n].unsqueeze(-1) * state + kg[:, :, n].transpose(-1, -2) @ new
    return torch.stack(states, 2), torch.stack(news, 2), state


def torch_chunk_delta_rule(q, k, v, beta, g, write, scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                           chunk: int = CHUNK) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(o [B, T, H, V], final state [B, H, K, V] or None)`` of the delta rule above, in the inputs' dtype
    (computed in fp32 for 16-bit inputs). q, k, g ``[B, T, H, K]`` (g <= 0), v ``[B, T, H, V]``, beta and
    write ``[B, T, H]``, initial_state ``[B, H, K, V]``."""
    dtype = q.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, beta, g, write = (x.to(work) for x in (q, k, v, beta, g, write))
    g = g.clamp_min(log_zero(work))  # g = -inf (a reset) as exp's exact 0: no -inf - -inf in the pair decays
    terms = chunk_terms(q, k, v, beta, g, write, 1.0 if scale is None else float(scale), chunk)
    h, news, final = state_pass(terms, initial_state)
    o = terms["qg"] @ h + terms["aqk"] @ news  # [B, H, N, C, V]
    batch, heads, n_chunks, c, dv = o.shape
    o = o.reshape(batch, heads, n_chunks * c, dv)[:, :, :q.shape[1]].transpose(1, 2)
    return o.to(dtype), (final if output_final_state else None)
