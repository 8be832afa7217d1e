"""Float64 specification of HDLA's four chunk Grams as one Gram product, which B2's S2 and S5a compute
(kernels/generalized/bwd_chunk.py ``_hdla_gram_kernel``, ``_hdla_gram_vjp_kernel``; kernels/README.md §8 "HDLA's
Grams as one product", §2 and §8 notation, stacks token-major with rank fastest).

HDLA's rank stacks are built from k alone (§2): ``A = [beta u, k]``, ``B = [k, beta u - beta^2 s k]`` with
``u = lambda * k``, ``s = k.u``, and ``u_i e^{-G_i} = k_i e^{-G'_i}``. So every entry of M_QK, M_QA, L_AB and
L_KB is a combination of six base Grams ``X_Y[t, i] = sum_c x_tc k_ic e^{X_tc - Y_ic}`` (i <= t) of the row
stacks ``[k e^{G'}; k e^{G}; scale q e^{G}]`` against the column stacks ``[k e^{-G}; k e^{-G'}]``: 6 C^2 K
multiply-adds per chunk instead of the 9 C^2 K of the four Grams over the rank stacks (C + 2C + 4C + 2C
columns times their rows), and no rank stacks in memory. The Grams then follow by an elementwise 2 x 2
mixing with beta_t, beta_i and s_t (:func:`mix`), whose VJP (:func:`mix_vjp`) sends the Grams' cotangents
to the six base Grams and to beta and s.

Base Grams (names: row cumsum, column cumsum; ``p`` = G', ``g`` = G; ``q`` the query rows):
    qg = sum q e^{G_t - G_i} k_i,   qp = sum q e^{G_t - G'_i} k_i,
    pg = sum k_t e^{G'_t - G_i} k_i, pp = sum k_t e^{G'_t - G'_i} k_i, gg = ..., gp = ...
"""
from typing import Dict

import torch

from tests.chunk_bwd_reference import _token_mask, gram

BASES = ("qg", "qp", "pg", "pp", "gg", "gp")


def base_grams(q, k, g, scale) -> Dict[str, torch.Tensor]:
    """The six base Grams ``[..., C, C]`` (entries i <= t, else 0) of one chunk: q, k, g ``[..., C, K]``
    (g the chunk-local log-decays; cumsums inside)."""
    c = q.shape[-2]
    G = g.cumsum(-2)
    Gp = G - g
    mask = _token_mask(c, 1, 1, False, q.device)
    rows = dict(q=(scale * q, G), p=(k, Gp), g=(k, G))
    cols = dict(g=G, p=Gp)
    return {name: gram(*rows[name[0]], k, cols[name[1]], mask) for name in BASES}


def _mixing_terms(base, beta, s):
    """What :func:`mix` and :func:`mix_vjp` share: the strict token mask ``[C, C]``, b_t ``[..., C, 1]``, b_i
    ``[..., 1, C]``, c_t = b_t^2 s_t ``[..., C, 1]``, and the key-row base Grams pg, pp, gg, gp strictly lower."""
    strict = _token_mask(beta.shape[-1], 1, 1, True, beta.device)
    bt, bi, ct = beta[..., :, None], beta[..., None, :], (beta * beta * s)[..., :, None]
    return (strict, bt, bi, ct, *(base[n] * strict for n in ("pg", "pp", "gg", "gp")))


def mix(base: Dict[str, torch.Tensor], beta, s) -> Dict[str, torch.Tensor]:
    """M_QK ``[C, C]``, M_QA ``[C, 2C]``, L_AB ``[2C, 2C]``, L_KB ``[2C, C]`` (the L's strictly lower) from the
    base Grams, beta ``[..., C]`` and s ``[..., C]``: with ``b_t = beta_t``, ``c_t = beta_t^2 s_t``,
        M_QA[t, (i, 0)] = qp b_i,   M_QA[t, (i, 1)] = qg,   M_QK = qg,
        L_AB[(t, 0), (i, 0)] = pp b_i,                L_AB[(t, 0), (i, 1)] = pg,
        L_AB[(t, 1), (i, 0)] = (b_t gp - c_t pp) b_i,  L_AB[(t, 1), (i, 1)] = b_t gg - c_t pg,
        L_KB[(t, 0), i] = pg,   L_KB[(t, 1), i] = b_t gg - c_t pg."""
    c = beta.shape[-1]
    _, bt, bi, ct, pg, pp, gg, gp = _mixing_terms(base, beta, s)
    l1 = bt * gg - ct * pg  # row rank 1 against a column k (L_KB and L_AB's column rank 1)

    def interleave(*blocks):  # [..., C, C] blocks (row rank, column rank) -> token-major stack
        rr, cr = len(blocks), len(blocks[0])
        x = torch.stack([torch.stack(row, -1) for row in blocks], -3)  # [..., C, rr, C, cr]
        return x.reshape(*x.shape[:-4], c * rr, c * cr)

    return dict(M_QK=base["qg"], M_QA=interleave((base["qp"] * bi, base["qg"])),
                L_AB=interleave((pp * bi, pg), ((bt * gp - ct * pp) * bi, l1)), L_KB=interleave((pg,), (l1,)))


def mix_vjp(base, beta, s, D: Dict[str, torch.Tensor]):
    """The VJP of :func:`mix` for the cotangents D of its four outputs: (the base Grams' cotangents, dbeta,
    ds), each dbeta / ds ``[..., C]`` summed over the rows (t) and columns (i) a token appears in."""
    c = beta.shape[-1]
    strict, bt, bi, ct, pg, pp, gg, gp = _mixing_terms(base, beta, s)

    def split(x, rr, cr):  # token-major stack -> {(row rank, column rank): [..., C, C]}
        x = x.reshape(*x.shape[:-2], c, rr, c, cr)
        return {(m, l): x[..., :, m, :, l] for m in range(rr) for l in range(cr)}

    qa, ab, kb = split(D["M_QA"], 1, 2), split(D["L_AB"], 2, 2), split(D["L_KB"], 2, 1)
    ab = {key: val * strict for key, val in ab.items()}
    kb = {key: val * strict for key, val in kb.items()}
    d1 = ab[1, 1] + kb[1, 0]  # the cotangent of b_t gg - c_t pg (L_AB's (1, 1) and L_KB's rank-1 rows)
    d_base = dict(qg=D["M_QK"] + qa[0, 1], qp=qa[0, 0] * bi,
                  pg=ab[0, 1] + kb[0, 0] - ct * d1, pp=(ab[0, 0] - ct * ab[1, 0]) * bi,
                  gg=bt * d1, gp=bt * bi * ab[1, 0])
    dbeta_col = (qa[0, 0] * base["qp"] + ab[0, 0] * pp + ab[1, 0] * (bt * gp - ct * pp)).sum(-2)
    dct = -(ab[1, 0] * bi * pp + d1 * pg).sum(-1)  # the cotangent of c_t = beta_t^2 s_t
    dbeta_row = (ab[1, 0] * bi * gp + d1 * gg).sum(-1) + 2 * beta * s * dct
    return d_base, dbeta_col + dbeta_row, beta * beta * dct
