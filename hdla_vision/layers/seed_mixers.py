"""The seed mixers as parameterizations of the generalized recurrence (the table in kernels/README.md §2).

Every function maps one mixer's per-token quantities to the inputs of
``chunk_generalized(q, k, v, a, b, g)`` (the ``*_steps`` functions: to the delta rule's sub-steps,
:class:`DeltaSteps`), whose step is

    S_t = (Diag(exp g_t) - A_t B_t^T) S_{t-1} + K_t V_t^T,      o_t = scale * S_t^T q_t

with the state ``S_t`` of shape K x V (keys index rows). The ``*_factors`` functions
return a :class:`GeneralizedStep` (except :func:`gated_deltaproduct_factors`, the shared merge of
Householder sub-steps, which the LM's Gated DeltaProduct mixer also uses) whose fields have the kernel's layout:
``k [B, T, H, r_kv, K]``, ``v [B, T, H, r_kv, V]``, ``a, b [B, T, H, r_ab, K]``, and ``g``: ``[B, T, H, K]``
for a decay per key channel (GLA, KDA, RWKV-7) or ``[B, T, H]`` for one per head (DeltaNet, Gated
DeltaNet, Gated DeltaProduct, Head-in-Head), which ``chunk_generalized`` takes as it is. Inputs are ``[B, T, H, K]`` per-token vectors and ``[B, T, H]`` per-head scalars unless stated.
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class GeneralizedStep(NamedTuple):
    """Inputs of the generalized op for one scan (see the module docstring for shapes)."""

    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    g: torch.Tensor


def _no_decay_factors(k: torch.Tensor) -> torch.Tensor:
    """An empty ``[B, T, H, 0, K]`` tensor: rank r_ab = 0."""
    return k.new_zeros(*k.shape[:-1], 0, k.shape[-1])


def _check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless the tensors share one shape. Compares shapes pairwise, not through a
    set: under ``torch.export`` with a dynamic batch a shape holds SymInts, which are not hashable."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if any(shape != first for shape in shapes.values()):
        raise ValueError(f"expected tensors of one shape [B, T, H, K], got {shapes}")


def _check_beta(beta: torch.Tensor, k: torch.Tensor) -> None:
    """Raise ValueError unless beta is ``[B, T, H]`` for k ``[B, T, H, K]``."""
    if beta.shape != k.shape[:-1]:
        raise ValueError(f"beta must have shape [B, T, H] = {list(k.shape[:-1])}, got {list(beta.shape)}")


def _check_substep_beta(beta: torch.Tensor, k: torch.Tensor) -> None:
    """Raise ValueError unless k is ``[B, T, H, n_h, K]`` and beta ``[B, T, H, n_h]`` (a token's sub-steps)."""
    if k.dim() != 5 or beta.shape != k.shape[:-1]:
        raise ValueError(f"expected k [B, T, H, n_h, K] and beta [B, T, H, n_h], got {list(k.shape)}, {list(beta.shape)}")


def _scalar_log_decay(log_alpha: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A per-head log decay ``[B, T, H]`` (checked against k ``[B, T, H, K]``), passed to the op as it is."""
    if log_alpha.shape != k.shape[:-1]:
        raise ValueError(f"log_alpha must have shape [B, T, H] = {list(k.shape[:-1])}, got {list(log_alpha.shape)}")
    return log_alpha


def _no_log_decay(k: torch.Tensor) -> torch.Tensor:
    """``g = 0`` (d = 1, no decay) per head: ``[B, T, H]`` in fp32 (float64 for float64 k)."""
    return torch.zeros(k.shape[:-1], dtype=torch.promote_types(k.dtype, torch.float32), device=k.device)


def gla_factors(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> GeneralizedStep:
    """GLA (Yang et al. 2024): ``S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T``, ``g = log alpha_t`` per channel."""
    _check_same_shape(k=k, g=g)
    return GeneralizedStep(k.unsqueeze(-2), v.unsqueeze(-2), _no_decay_factors(k), _no_decay_factors(k), g)


def deltanet_factors(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> GeneralizedStep:
    """DeltaNet: ``S_t = (I - beta k k^T) S_{t-1} + beta k v^T``: ``d = 1``, ``A = beta k``, ``B = k``."""
    _check_beta(beta, k)
    bk = (beta.unsqueeze(-1) * k).unsqueeze(-2)  # both the write's key and A: one tensor
    return GeneralizedStep(bk, v.unsqueeze(-2), bk, k.unsqueeze(-2), _no_log_decay(k))


def gated_deltanet_factors(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                           log_alpha: torch.Tensor) -> GeneralizedStep:
    """Gated DeltaNet: ``S_t = alpha (I - beta k k^T) S_{t-1} + beta k v^T`` with a scalar ``alpha`` per head.

    ``alpha (I - beta k k^T) = alpha I - (alpha beta k) k^T``: ``d = alpha``, ``A = alpha beta k``, ``B = k``;
    this is :func:`gated_deltaproduct_factors` with one Householder step.
    """
    return gated_deltaproduct_factors_5d(k.unsqueeze(-2), v.unsqueeze(-2), beta.unsqueeze(-1), log_alpha)


def gated_deltaproduct_factors_5d(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                                  log_alpha: torch.Tensor) -> GeneralizedStep:
    """Gated DeltaProduct with n_h steps: ``S <- alpha S``, then ``S <- (I - b_j k_j k_j^T) S + b_j k_j v_j^T``.

    Args: k ``[B, T, H, n_h, K]`` (unit rows), v ``[B, T, H, n_h, V]``, beta ``[B, T, H, n_h]``,
    log_alpha ``[B, T, H]`` (the step's g, per head). The sub-steps merge into one rank-n_h step
    (:func:`gated_deltaproduct_factors`).
    """
    _check_substep_beta(beta, k)
    g = _scalar_log_decay(log_alpha, k[..., 0, :])
    a, b, kw, vw = gated_deltaproduct_factors(k, v, beta, g)
    return GeneralizedStep(kw, vw, a, b, g)


def gated_deltaproduct_factors(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor):
    """Merge a gate and n_h delta-rule sub-steps into one generalized step.

    The token update is ``S <- alpha S`` then, for j = 1..n_h,
    ``S <- (I - b_j k_j k_j^T) S + b_j k_j v_j^T``. Unrolled,
    ``S_t = (alpha I - A B^T) S_{t-1} + K V^T`` with (n_h = 1: Gated DeltaNet; n_h = 2 written out)

        A = [alpha b_1 k_1,  alpha b_2 k_2]
        B = [k_1,  k_2 - b_1 (k_1 . k_2) k_1]
        K = [b_1 (k_1 - b_2 (k_2 . k_1) k_2),  b_2 k_2],  V = [v_1, v_2]

    In general, with the later sub-steps' product ``Q_j = prod_{i>j} (I - b_i k_i k_i^T)``, the
    write of sub-step j is ``Q_j b_j k_j v_j^T``, and the decay part follows from the recursion
    ``M_j = (I - b_j k_j k_j^T) M_{j-1}``, ``M_0 = I``, kept as ``I - A B^T``.

    Args:
        k: ``[B, T, H, n, K]`` (unit rows); v: ``[B, T, H, n, V]``; beta: ``[B, T, H, n]``;
        g: ``[B, T, H]`` the log gate per head (or ``[B, T, H, K]``, constant along K).
    Returns:
        a, b: ``[B, T, H, n, K]``; k_write: ``[B, T, H, n, K]``; v_write = v.
    """
    alpha = (g[..., :1] if g.dim() == k.dim() - 1 else g.unsqueeze(-1)).exp()  # [B, T, H, 1]
    a, b = _householder_merge(k, beta)
    return a * alpha.unsqueeze(-1), b, _written_keys(k, beta, beta), v


def _householder_merge(k: torch.Tensor, beta: torch.Tensor):
    """``(A, B)`` ``[B, T, H, n, K]`` with ``I - A B^T = prod_j (I - b_j k_j k_j^T)`` (the last j leftmost).

    M_j = M_{j-1} - b_j k_j (k_j^T M_{j-1}); with M = I - sum a_i b_i^T, k_j^T M_{j-1} = k_j^T - sum_i (k_j . a_i)
    b_i^T, so b_new = k_j - sum_i (k_j . a_i) b_i, a_new = b_j k_j."""
    a_cols, b_cols = [], []
    for j in range(k.shape[-2]):
        kj, bj = k[..., j, :], beta[..., j : j + 1]
        b_new = kj
        for a_i, b_i in zip(a_cols, b_cols):
            b_new = b_new - (kj * a_i).sum(-1, keepdim=True) * b_i
        a_cols.append(bj * kj)
        b_cols.append(b_new)
    return torch.stack(a_cols, dim=-2), torch.stack(b_cols, dim=-2)


def _written_keys(k: torch.Tensor, beta: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
    """The write keys ``[B, T, H, n, K]``: sub-step j's ``write_j k_j`` through the later sub-steps' Householder
    factors ``prod_{i > j} (I - b_i k_i k_i^T)``."""
    n = k.shape[-2]
    k_cols = []
    for j in range(n):
        w = write[..., j : j + 1] * k[..., j, :]
        for i in range(j + 1, n):
            ki, bi = k[..., i, :], beta[..., i : i + 1]
            w = w - bi * (ki * w).sum(-1, keepdim=True) * ki
        k_cols.append(w)
    return torch.stack(k_cols, dim=-2)


class DeltaSteps(NamedTuple):
    """Inputs of the delta rule's sub-step op for one scan (``kernels.chunk_delta_substeps``, kernels/README.md
    §12): a token is n delta-rule sub-steps ``S <- (I - beta_j k_j k_j^T) Diag(exp g_j) S + write_j k_j v_j^T``,
    the token's decay on the first (later ``g_j = 0``). ``k [B, T, H, n, K]`` (unit rows), ``v [B, T, H, n, V]``,
    ``beta`` and ``write`` ``[B, T, H, n]``, ``g`` ``[B, T, H, K]`` per channel or ``[B, T, H]`` per head. The
    mixers whose step is such a product (GLA, DeltaNet, Gated DeltaNet / DeltaProduct, KDA) give these on the delta
    rule's route (``seed.GeneralizedMixer.delta_route``: under ``HDLA_VISION_KERNELS=delta``, and for all of them
    but GLA under auto too)."""

    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    write: torch.Tensor
    g: torch.Tensor


def generalized_step(steps: DeltaSteps) -> GeneralizedStep:
    """The same recurrence as one generalized step: ``prod_j (I - b_j k_j k_j^T) Diag(alpha) = Diag(alpha) -
    A (alpha * B)^T`` with :func:`_householder_merge`'s A, B and :func:`_written_keys` (for the decoding step and
    the bidirectional own write)."""
    k, v, beta, write = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in steps[:4])
    a, b = _householder_merge(k, beta)
    alpha = steps.g.exp() if steps.g.dim() == k.dim() - 1 else steps.g.exp().unsqueeze(-1)  # [B, T, H, K | 1]
    return GeneralizedStep(_written_keys(k, beta, write), v, a, alpha.unsqueeze(-2).to(b.dtype) * b, steps.g)


def _one_step(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, ...] -> [B, T, H, 1, ...]``: one sub-step per token."""
    return x.unsqueeze(3)


def gla_steps(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> DeltaSteps:
    """GLA as one sub-step with no reflection (beta = 0) and write scale 1."""
    _check_same_shape(k=k, g=g)
    no_beta = torch.zeros(k.shape[:-1] + (1,), dtype=g.dtype, device=k.device)
    return DeltaSteps(_one_step(k), _one_step(v), no_beta, torch.ones_like(no_beta), g)


def deltanet_steps(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> DeltaSteps:
    """DeltaNet as one sub-step: reflection and write scale beta, no decay."""
    _check_beta(beta, k)
    return DeltaSteps(_one_step(k), _one_step(v), beta.unsqueeze(-1), beta.unsqueeze(-1), _no_log_decay(k))


def gated_deltaproduct_steps(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                             log_alpha: torch.Tensor) -> DeltaSteps:
    """Gated DeltaProduct (Gated DeltaNet at n_h = 1) as its n_h sub-steps (write scale beta_j), the scalar gate on
    the first. Args as :func:`gated_deltaproduct_factors_5d`."""
    _check_substep_beta(beta, k)
    return DeltaSteps(k, v, beta, beta, _scalar_log_decay(log_alpha, k[..., 0, :]))


def kda_steps(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> DeltaSteps:
    """KDA as one sub-step: reflection and write scale beta after the per-channel decay."""
    _check_same_shape(k=k, g=g)
    _check_beta(beta, k)
    return DeltaSteps(_one_step(k), _one_step(v), beta.unsqueeze(-1), beta.unsqueeze(-1), g)


def kda_factors(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> GeneralizedStep:
    """KDA (Kimi Delta Attention): ``S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T``.

    ``(I - beta k k^T) Diag(alpha) = Diag(alpha) - (beta k)(alpha * k)^T``: ``d = alpha = exp(g)``
    per channel, ``A = beta k``, ``B = alpha * k``.
    """
    _check_same_shape(k=k, g=g)
    _check_beta(beta, k)
    bk = (beta.unsqueeze(-1) * k).unsqueeze(-2)  # both the write's key and A: one tensor
    decayed_k = g.exp().to(k.dtype) * k
    return GeneralizedStep(bk, v.unsqueeze(-2), bk, decayed_k.unsqueeze(-2), g)


def rwkv7_factors(k: torch.Tensor, v: torch.Tensor, kappa_hat: torch.Tensor, icl_rate: torch.Tensor,
                  log_w: torch.Tensor) -> GeneralizedStep:
    """RWKV-7 (Peng et al. 2025), ``wkv_t = wkv_{t-1} (Diag(w_t) - kappa_hat^T (a_t * kappa_hat)) + v_t^T k_t``.

    The paper's state ``wkv`` is V x K with row vectors; ours is its transpose, so the transition
    acting on ``S = wkv^T`` is ``Diag(w) - (a * kappa_hat) kappa_hat^T``: ``d = w = exp(log_w)``,
    ``A = a * kappa_hat``, ``B = kappa_hat``, write ``k v^T`` (k is RWKV-7's replacement key k~).

    Args: k, kappa_hat (unit rows), icl_rate ``a`` in [0, 1], log_w: ``[B, T, H, K]``; v ``[B, T, H, V]``.
    """
    _check_same_shape(k=k, kappa_hat=kappa_hat, icl_rate=icl_rate, log_w=log_w)
    a = (icl_rate * kappa_hat).unsqueeze(-2)
    return GeneralizedStep(k.unsqueeze(-2), v.unsqueeze(-2), a, kappa_hat.unsqueeze(-2), log_w)


def head_in_head_mask(mask_logits: torch.Tensor) -> torch.Tensor:
    """``M_org`` of Head-in-Head (section 3.3): positive entries, each row L2-normalised.

    ``mask_logits [..., r, r] -> M_org [..., r, r]``; then ``M = M_org M_org^T`` has entries in [0, 1]
    and is positive semi-definite, so with unit keys and beta in [0, 1] the transition's eigenvalues
    stay in [0, 1] (the paper's appendix A).
    """
    return F.normalize(F.softplus(mask_logits), p=2.0, dim=-1)


def head_in_head_factors(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, mask_org: torch.Tensor,
                         log_alpha: Optional[torch.Tensor] = None) -> GeneralizedStep:
    """Head-in-Head (Gated) DeltaNet: ``S_t = alpha (I - beta (k k^T) o M) S_{t-1} + beta k v^T``.

    ``M = M_org M_org^T`` (r x r) is broadcast over r equal feature groups of K. With ``m_j`` the column
    j of ``M_org`` repeated over each group's features, ``(k k^T) o M = sum_j (k * m_j)(k * m_j)^T``,
    so ``d = alpha`` (1 without a gate), ``A = [alpha beta k * m_j]_j``, ``B = [k * m_j]_j`` (r_ab = r).

    Args:
        k: ``[B, T, H, K]`` unit keys; v ``[B, T, H, V]``; beta ``[B, T, H]`` in [0, 1].
        mask_org: ``[H, r, r]`` (static) or ``[B, T, H, r, r]`` (data-dependent), rows unit-norm and
            entries >= 0 (see :func:`head_in_head_mask`); r must divide K.
        log_alpha: ``[B, T, H]`` log of the scalar gate (Head-in-Head Gated DeltaNet) or None (DeltaNet).
    """
    dk, r = k.shape[-1], mask_org.shape[-1]
    if mask_org.shape[-2] != r or dk % r:
        raise ValueError(f"mask_org must be [..., r, r] with r dividing K={dk}, got {list(mask_org.shape)}")
    if mask_org.dim() == 3:
        mask_org = mask_org.expand(*k.shape[:2], *mask_org.shape)
    if mask_org.shape[:3] != k.shape[:3]:
        raise ValueError(f"mask_org must be [H, r, r] or [B, T, H, r, r] matching k {list(k.shape)}, got {list(mask_org.shape)}")
    # m[..., j, c] = M_org[group(c), j]: column j of M_org repeated over each group's K / r features
    m = mask_org.transpose(-1, -2).repeat_interleave(dk // r, dim=-1)  # [B, T, H, r, K]
    masked_k = k.unsqueeze(-2) * m.to(k.dtype)
    bk = beta.unsqueeze(-1) * k
    if log_alpha is None:
        g = _no_log_decay(k)
        alpha_beta = beta
    else:
        g = _scalar_log_decay(log_alpha, k)
        alpha_beta = log_alpha.exp().to(beta.dtype) * beta
    a = alpha_beta[..., None, None] * masked_k
    return GeneralizedStep(bk.unsqueeze(-2), v.unsqueeze(-2), a, masked_k, g)
