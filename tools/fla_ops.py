"""The seed mixers on two kernels: fla 0.6's dedicated chunk kernel and ours: ``chunk_generalized``, or under
``HDLA_VISION_KERNELS=delta`` the delta rule's sub-step op for the mixers that are products of delta steps (as the
mixers run them, ``layers/seed.py``).

Each entry of :data:`MIXERS` draws one mixer's raw per-token inputs (the quantities its paper
names: keys, values, gates, betas) and runs them through fla's kernel and through ours via the
factor functions of ``hdla_vision.layers.seed_mixers``. Both sides see the same leaf tensors, so
outputs and gradients compare directly. Shapes: ``q, k, v [B, T, H, D]``, per-head scalars
``[B, T, H]``; Gated DeltaProduct's keys, values and betas carry ``n_h`` steps per token.
Gates are float32 log-decays, everything else is in the requested dtype.

fla is imported lazily: this module loads without it.
"""
import torch
import torch.nn.functional as F

from hdla_vision.kernels import chunk_delta_substeps, chunk_generalized, on_delta_rule
from hdla_vision.layers import seed_mixers as sm
from hdla_vision.layers.mixer import activation_recompute
from hdla_vision.layers.seed import DeltaNetMixer, GatedDeltaNetMixer, GatedDeltaProductMixer, GLAMixer, KDAMixer


def _rand(gen, device, *shape):
    return torch.randn(*shape, device=device, generator=gen)


def _unit(x):
    return F.normalize(x, dim=-1)


def _leaf(tensors, dtype):
    """Detached leaves that require grad: gates (``g``/``log_*``) stay float32."""
    out = {}
    for name, t in tensors.items():
        keep_fp32 = name.startswith(("g", "log"))
        out[name] = t.to(torch.float32 if keep_fp32 else dtype).detach().requires_grad_()
    return out


def _ours(q, step, scale, op):
    """The op on a factor function's step: k, v, a, b in q's dtype, g as given (fp32), as the mixers
    do (the op refuses other mixes; a factor function may return fp32 a, b from an fp32 gate)."""
    k, v, a, b = (t.to(q.dtype) for t in (step.k, step.v, step.a, step.b))
    return op(q, k, v, a, b, step.g, scale=scale)[0]


def _ours_by_route(q, factors, steps, scale, op, mixer):
    """Our side as the mixers run it: on the delta rule's route (``on_delta_rule``: under ``HDLA_VISION_KERNELS=
    delta``, or under auto where the ``mixer`` class's ``delta_by_default`` is set) the delta rule's sub-step op on
    the mixer's ``*_steps`` (``steps()``), else ``op`` on its factor function's step (``factors()``); the float64
    reference (``op`` another than ``chunk_generalized``) always the latter. The delta rule saves for its backward
    what the mixers have it save (its recompute mode while activation recompute is on)."""
    if op is chunk_generalized and on_delta_rule(q, mixer.delta_by_default):
        return chunk_delta_substeps(q, *steps(), scale=scale, recompute=activation_recompute())[0]
    return _ours(q, factors(), scale, op)


# ---- GLA: S = Diag(alpha) S + k v^T --------------------------------------------------------
def gla_inputs(B, T, H, D, dtype, device, gen):
    g = F.logsigmoid(_rand(gen, device, B, T, H, D) + 3.0)
    return _leaf(dict(q=_rand(gen, device, B, T, H, D), k=_rand(gen, device, B, T, H, D),
                      v=_rand(gen, device, B, T, H, D), g=g), dtype)


def gla_fla(x, scale):
    from fla.ops.gla import chunk_gla
    return chunk_gla(x["q"], x["k"], x["v"], x["g"], scale=scale)[0]


def gla_ours(x, scale, op=chunk_generalized):
    return _ours_by_route(x["q"], lambda: sm.gla_factors(x["k"], x["v"], x["g"]),
                          lambda: sm.gla_steps(x["k"], x["v"], x["g"]), scale, op, GLAMixer)


# ---- DeltaNet: S = (I - beta k k^T) S + beta k v^T ------------------------------------------
def deltanet_inputs(B, T, H, D, dtype, device, gen):
    return _leaf(dict(q=_rand(gen, device, B, T, H, D), k=_unit(_rand(gen, device, B, T, H, D)),
                      v=_rand(gen, device, B, T, H, D), beta=torch.sigmoid(_rand(gen, device, B, T, H))), dtype)


def deltanet_fla(x, scale):
    from fla.ops.delta_rule import chunk_delta_rule
    return chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], scale=scale)[0]


def deltanet_ours(x, scale, op=chunk_generalized):
    return _ours_by_route(x["q"], lambda: sm.deltanet_factors(x["k"], x["v"], x["beta"]),
                          lambda: sm.deltanet_steps(x["k"], x["v"], x["beta"]), scale, op, DeltaNetMixer)


# ---- Gated DeltaNet: S = alpha (I - beta k k^T) S + beta k v^T, scalar alpha per head -------
def gdn_inputs(B, T, H, D, dtype, device, gen):
    x = deltanet_inputs(B, T, H, D, dtype, device, gen)
    x["log_alpha"] = F.logsigmoid(_rand(gen, device, B, T, H) + 3.0).requires_grad_()
    return x


def gdn_fla(x, scale):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["log_alpha"], x["beta"], scale=scale)[0]


def gdn_ours(x, scale, op=chunk_generalized):
    k1, v1, beta1 = x["k"].unsqueeze(3), x["v"].unsqueeze(3), x["beta"].unsqueeze(-1)
    return _ours_by_route(x["q"], lambda: sm.gated_deltanet_factors(x["k"], x["v"], x["beta"], x["log_alpha"]),
                          lambda: sm.gated_deltaproduct_steps(k1, v1, beta1, x["log_alpha"]), scale, op,
                          GatedDeltaNetMixer)


# ---- KDA: S = (I - beta k k^T) Diag(alpha) S + beta k v^T -----------------------------------
def kda_inputs(B, T, H, D, dtype, device, gen):
    x = deltanet_inputs(B, T, H, D, dtype, device, gen)
    x["g"] = F.logsigmoid(_rand(gen, device, B, T, H, D) + 3.0).requires_grad_()
    return x


def kda_fla(x, scale):
    from fla.ops.kda import chunk_kda
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale)[0]


def kda_ours(x, scale, op=chunk_generalized):
    return _ours_by_route(x["q"], lambda: sm.kda_factors(x["k"], x["v"], x["beta"], x["g"]),
                          lambda: sm.kda_steps(x["k"], x["v"], x["beta"], x["g"]), scale, op, KDAMixer)


# ---- RWKV-7 (diagonal plus rank 1): S = (Diag(w) - (a * kh) kh^T) S + k v^T -----------------
def rwkv7_inputs(B, T, H, D, dtype, device, gen):
    return _leaf(dict(
        q=_rand(gen, device, B, T, H, D), k=_rand(gen, device, B, T, H, D), v=_rand(gen, device, B, T, H, D),
        kappa_hat=_unit(_rand(gen, device, B, T, H, D)), icl_rate=torch.sigmoid(_rand(gen, device, B, T, H, D)),
        log_w=F.logsigmoid(_rand(gen, device, B, T, H, D) + 3.0)), dtype)


def rwkv7_fla(x, scale):
    """fla's DPLR step is ``S = (Diag(exp gk) + b a^T) S + k v^T``: a = kh, b = -(icl * kh)."""
    from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule
    kh = x["kappa_hat"]
    return chunk_dplr_delta_rule(x["q"], x["k"], x["v"], kh, -(x["icl_rate"] * kh), x["log_w"], scale=scale)[0]


def rwkv7_ours(x, scale, op=chunk_generalized):
    return _ours(x["q"], sm.rwkv7_factors(x["k"], x["v"], x["kappa_hat"], x["icl_rate"], x["log_w"]), scale, op)


# ---- Gated DeltaProduct: alpha, then n_h Householder steps per token -------------------------
def gdp_inputs(B, T, H, D, dtype, device, gen, num_householder=2):
    n = num_householder
    return _leaf(dict(
        q=_rand(gen, device, B, T, H, D), k=_unit(_rand(gen, device, B, T, H, n, D)),
        v=_rand(gen, device, B, T, H, n, D), beta=torch.sigmoid(_rand(gen, device, B, T, H, n)),
        log_alpha=F.logsigmoid(_rand(gen, device, B, T, H) + 3.0)), dtype)


def _steps_flat(x):
    """``[B, T, H, n, ...] -> [B, T * n, H, ...]``: fla's token-major order of the sub-steps."""
    return x.transpose(2, 3).flatten(1, 2)


def gdp_fla(x, scale):
    from fla.ops.gated_delta_product import chunk_gated_delta_product
    n = x["k"].shape[3]
    return chunk_gated_delta_product(x["q"], _steps_flat(x["k"]), _steps_flat(x["v"]), x["log_alpha"],
                                     _steps_flat(x["beta"]), num_householder=n, scale=scale)[0]


def gdp_ours(x, scale, op=chunk_generalized):
    return _ours_by_route(x["q"], lambda: sm.gated_deltaproduct_factors_5d(x["k"], x["v"], x["beta"], x["log_alpha"]),
                          lambda: sm.gated_deltaproduct_steps(x["k"], x["v"], x["beta"], x["log_alpha"]), scale, op,
                          GatedDeltaProductMixer)


def _gdp3_inputs(*args):
    return gdp_inputs(*args, num_householder=3)


def as_float64(x):
    """Float64 copies of the leaves (for the token-loop reference)."""
    return {name: t.detach().double().requires_grad_() for name, t in x.items()}


# name: (inputs, fla op, ours, fla function name)
MIXERS = {
    "gla": (gla_inputs, gla_fla, gla_ours, "chunk_gla"),
    "deltanet": (deltanet_inputs, deltanet_fla, deltanet_ours, "chunk_delta_rule"),
    "gated_deltanet": (gdn_inputs, gdn_fla, gdn_ours, "chunk_gated_delta_rule"),
    "kda": (kda_inputs, kda_fla, kda_ours, "chunk_kda"),
    "rwkv7": (rwkv7_inputs, rwkv7_fla, rwkv7_ours, "chunk_dplr_delta_rule"),
    "gated_deltaproduct_2": (gdp_inputs, gdp_fla, gdp_ours, "chunk_gated_delta_product"),
    "gated_deltaproduct_3": (_gdp3_inputs, gdp_fla, gdp_ours, "chunk_gated_delta_product"),
}


# ---- HDLA as fla's DPLR over the doubled sequence (the kernel benchmark's exact fla baseline) ----
def fla_dplr_doubled(q, k, v, beta, g):
    """HDLA as fla's DPLR over 2T steps (kernels/README.md §6): output at the odd steps."""
    from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule

    batch, seq_len, heads, dim = q.shape
    z = torch.zeros_like(q)
    bk = beta.unsqueeze(-1) * k

    def interleave(even, odd):
        return torch.stack([even, odd], dim=2).reshape(batch, 2 * seq_len, heads, -1)

    lam = g.float().exp().to(q.dtype)
    qq = interleave(z, q)
    kk = interleave(z, k)
    vv = interleave(torch.zeros_like(v), v)
    aa = interleave(-bk, -bk)
    bb = interleave(lam * k, k)
    gk = interleave(g, torch.zeros_like(g))
    o, _ = chunk_dplr_delta_rule(qq, kk, vv, aa, bb, gk, scale=1.0)
    return o[:, 1::2]
