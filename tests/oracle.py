"""Shared helpers for kernel tests: random problems and their float64 references."""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hdla_vision.kernels import (
    chunk_loglinear_generalized,
    custom_ops,
    chunk_loglinear_hdla,
    fused_recurrent_loglinear_generalized,
    fused_recurrent_loglinear_hdla,
    naive_generalized,
    naive_hdla,
    naive_loglinear_generalized,
    naive_loglinear_hdla,
)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; the absolute error where ref is exactly zero (e.g. the
    gradient of a decay that only ever acts on a zero state). NaN propagates, so it never passes."""
    x, ref = x.double(), ref.double()
    scale = ref.norm()
    return ((x - ref).norm() / (scale if scale > 0 else 1.0)).item()


def worst(errors: dict) -> float:
    """The largest of ``{name: relative error}``, NaN if any is NaN: ``max`` alone returns a NaN only where it comes
    first (each later comparison with it is False), so ``max(errors.values()) < tol`` can pass a NaN."""
    values = list(errors.values())
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def with_resets(g: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """g with full resets (g = -inf, lambda = 0): about ``fraction`` of the tokens in every channel
    and, elsewhere, about ``fraction`` of the single channels (a per-head g ``[B, T, H]``: of the tokens)."""
    if not fraction:
        return g
    tokens = torch.rand(g.shape[:3], generator=gen) < fraction
    if g.dim() == 3:
        return g.masked_fill(tokens, float("-inf"))
    channels = torch.rand(g.shape, generator=gen) < fraction
    return g.masked_fill(tokens[..., None] | channels, float("-inf"))


def generalized_problem(batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min=-3.0, h0=True, seed=0, resets=0.0,
                        per_head_g=False):
    """Random inputs (float64) of the generalized op; g uniform in [g_min, 0], with a fraction
    ``resets`` of g = -inf (see :func:`with_resets`); g is ``[B, T, H, K]``, or ``[B, T, H]`` (one
    log-decay per head) with ``per_head_g``."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    problem = dict(
        q=rnd(batch, seq_len, heads, dk),
        k=rnd(batch, seq_len, heads, r_kv, dk) / dk**0.5,
        v=rnd(batch, seq_len, heads, r_kv, dv),
        a=rnd(batch, seq_len, heads, r_ab, dk) / dk**0.5,
        b=rnd(batch, seq_len, heads, r_ab, dk) / dk**0.5,
        g=torch.rand(batch, seq_len, heads, *(() if per_head_g else (dk,)), generator=gen, dtype=torch.float64) * g_min,
        initial_state=rnd(batch, heads, dk, dv) if h0 else None,
    )
    problem["g"] = with_resets(problem["g"], resets, gen)
    return problem


def hdla_problem(batch, seq_len, heads, dk, dv, g_min=-3.0, h0=True, seed=0, resets=0.0):
    """Random HDLA inputs (float64): unit k, beta in [0, 2], g uniform in [g_min, 0] (and a
    fraction ``resets`` of g = -inf)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    problem = dict(
        q=rnd(batch, seq_len, heads, dk),
        k=F.normalize(rnd(batch, seq_len, heads, dk), dim=-1),
        v=rnd(batch, seq_len, heads, dv),
        beta=2 * torch.rand(batch, seq_len, heads, generator=gen, dtype=torch.float64),
        g=torch.rand(batch, seq_len, heads, dk, generator=gen, dtype=torch.float64) * g_min,
        initial_state=rnd(batch, heads, dk, dv) if h0 else None,
    )
    problem["g"] = with_resets(problem["g"], resets, gen)
    return problem


GRAD_NAMES = {"generalized": ("q", "k", "v", "a", "b", "g", "initial_state"),
              "hdla": ("q", "k", "v", "beta", "g", "initial_state")}


def compare_with_loop(op, kind, inputs, scale=None, reverse=False, dtype=torch.float32, seed=1,
                      round_reference=False):
    """Run ``op`` in ``dtype`` and the float64 token loop on the same inputs; return the relative
    errors of the output, the final state and every gradient (random output cotangents).

    ``round_reference``: the loop runs on the inputs rounded to ``dtype`` (then float64), i.e. on
    exactly what the op received, so the errors measure the op and not the rounding of its inputs
    (which an expansive transition, e.g. rank 4 at K = 16, amplifies past 1e-2 in bf16).

    Zero-size inputs (a, b at r_ab = 0) must get zero-size gradients like any other input: their
    entry is 0.0 if the op's gradient is a tensor of the input's shape, inf if it is None.
    g = -inf is allowed: the loop resets there (exp(-inf) = 0) and its gradient is 0."""
    if round_reference:
        inputs = {n: None if x is None else x.to(dtype).double() for n, x in inputs.items()}
    names = [n for n in GRAD_NAMES[kind] if inputs[n] is not None and inputs[n].numel() > 0]
    empty = [n for n in GRAD_NAMES[kind] if inputs[n] is not None and inputs[n].numel() == 0]
    loop = naive_generalized if kind == "generalized" else naive_hdla

    def run(fn, cast):
        leaves = {n: (cast(x).requires_grad_() if n in names + empty else (None if x is None else cast(x)))
                  for n, x in inputs.items()}
        o, final = fn(**leaves, scale=scale, output_final_state=True, reverse=reverse)
        return leaves, o, final

    ref_leaves, ref_o, ref_s = run(loop, lambda x: x.clone())
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(ref_o.shape, generator=gen, dtype=torch.float64).to(ref_o.device)
    ds = torch.randn(ref_s.shape, generator=gen, dtype=torch.float64).to(ref_o.device)
    ref_grads = torch.autograd.grad((ref_o * do).sum() + (ref_s * ds).sum(), [ref_leaves[n] for n in names])
    leaves, o, s = run(op, lambda x: x.detach().to(dtype))
    grads = torch.autograd.grad((o.double() * do).sum() + (s.double() * ds).sum(),
                                [leaves[n] for n in names + empty], allow_unused=True)
    errors = {"o": rel_err(o, ref_o), "final_state": rel_err(s, ref_s)}
    for n, g, r in zip(names, grads, ref_grads):  # a gradient of another shape (broadcast) is an error
        errors[f"d{n}"] = rel_err(g, r) if g is not None and g.shape == r.shape else float("inf")
    for n, g in zip(empty, grads[len(names):]):
        errors[f"d{n}"] = 0.0 if g is not None and g.shape == leaves[n].shape else float("inf")
    return errors


def hdla_recurrence(q, k, v, beta, g, initial_state=None, scale=None, reverse=False, output_final_state=True):
    """HDLA's token recurrence (its custom op, whose gradients are its Triton backward on the Triton backends)
    with chunk_hdla's keywords, for :func:`compare_with_loop`; it always returns the final state."""
    return custom_ops.fused_recurrent_hdla_op(q, k, v, beta, g, 1.0 if scale is None else scale, initial_state,
                                              reverse)


class LoopCase(NamedTuple):
    """One comparison of an op with the float64 loop (:func:`compare_with_loop`): ``problem`` holds
    the arguments of :func:`hdla_problem` / :func:`generalized_problem`, ``op`` the op's keywords
    (scale, reverse); the op runs in ``dtype`` and every relative error must be below ``tol``."""
    name: str
    problem: dict
    op: dict = {}
    dtype: torch.dtype = torch.float32
    tol: float = 1e-4


def case_name(case: LoopCase) -> str:
    """A LoopCase's test id."""
    return case.name


# ----------------------------------------------------------------------------- log-linear (kernels/README.md §7)
LOGLINEAR_OPS = {  # kind: (chunk op, float64 loop, decoding step)
    "hdla": (chunk_loglinear_hdla, naive_loglinear_hdla, fused_recurrent_loglinear_hdla),
    "generalized": (chunk_loglinear_generalized, naive_loglinear_generalized, fused_recurrent_loglinear_generalized),
}
LOGLINEAR_GRAD_NAMES = {"hdla": ("q", "k", "v", "beta", "g", "level_scales", "initial_state"),
                        "generalized": ("q", "k", "v", "a", "b", "g", "level_scales", "initial_state")}
UNBOUNDED = 64  # more levels than any test sequence has: every bucket gets its own weight


def loglinear_problem(kind, seq_len, num_levels, batch=2, heads=2, dk=8, dv=4, r_kv=1, r_ab=1, g_min=-3.0,
                      h0=False, scalar_decay=False, resets=0.0, seed=0):
    """Random float64 inputs of the log-linear op of ``kind`` ("hdla" or "generalized"): the linear
    op's (:func:`hdla_problem`, :func:`generalized_problem`), level weights softplus(N(0, 1))
    ``[B, T, H, L]`` and, with ``h0``, a random cache ``[B, H, L, K, V]`` (every level filled, also
    those a Fenwick cache would keep empty); ``resets``: a fraction of g = -inf."""
    if kind == "hdla":
        p = hdla_problem(batch, seq_len, heads, dk, dv, g_min=g_min, h0=False, seed=seed, resets=resets)
    else:
        p = generalized_problem(batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min=g_min, h0=False, seed=seed,
                                resets=resets)
    if scalar_decay:
        p["g"] = p["g"][..., :1].expand_as(p["g"]).contiguous()
    gen = torch.Generator().manual_seed(seed + 100)
    p["level_scales"] = F.softplus(torch.randn(batch, seq_len, heads, num_levels, generator=gen, dtype=torch.float64))
    p["initial_state"] = (torch.randn(batch, heads, num_levels, dk, dv, generator=gen, dtype=torch.float64)
                          if h0 else None)
    return p


def compare_with_definition(kind, inputs, dtype=torch.float32, final_state=True, **kwargs):
    """Relative errors of the log-linear chunk op run in ``dtype`` against the float64 loop, on the
    inputs' device: the output, the final levels (``final_state``: the op asked for them) and every
    gradient (random cotangents on both outputs)."""
    chunk, loop, _ = LOGLINEAR_OPS[kind]
    names = [n for n in LOGLINEAR_GRAD_NAMES[kind] if inputs[n] is not None and inputs[n].numel() > 0]
    empty = [n for n in LOGLINEAR_GRAD_NAMES[kind] if inputs[n] is not None and inputs[n].numel() == 0]

    def run(fn, cast):
        leaves = {n: None if x is None else cast(x).requires_grad_(n in names + empty) for n, x in inputs.items()}
        o, s = fn(**leaves, output_final_state=True if fn is loop else final_state, **kwargs)
        return leaves, o, s if final_state else o.new_zeros(())

    ref_leaves, ref_o, ref_s = run(loop, lambda x: x.clone())
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(ref_o.shape, generator=gen, dtype=torch.float64).to(ref_o.device)
    ds = torch.randn(ref_s.shape, generator=gen, dtype=torch.float64).to(ref_o.device)
    ref_grads = torch.autograd.grad((ref_o * do).sum() + (ref_s * ds).sum(), [ref_leaves[n] for n in names])
    leaves, o, s = run(chunk, lambda x: x.detach().to(dtype))
    assert o.dtype == dtype and s.dtype == dtype
    grads = torch.autograd.grad((o.double() * do).sum() + (s.double() * ds).sum(),
                                [leaves[n] for n in names + empty], allow_unused=True)
    errors = {"o": rel_err(o, ref_o)}
    if final_state:
        errors["final_state"] = rel_err(s, ref_s)
    errors.update({f"d{n}": rel_err(g, r) for n, g, r in zip(names, grads, ref_grads)})
    for n, g in zip(empty, grads[len(names):]):  # a, b at r_ab = 0 get (empty) gradients of their shape
        errors[f"d{n}"] = 0.0 if g is not None and g.shape == leaves[n].shape else float("inf")
    return errors


def loglinear_tokens(p, start, stop):
    """The inputs of tokens ``start:stop`` (the cache as it is, absent inputs left out)."""
    return {n: (x[:, start:stop] if n != "initial_state" else x) for n, x in p.items() if x is not None}


def bad_loglinear_problem(kind, **over):
    """A good fp32 log-linear problem of ``kind`` ([B, T, H, L, K, V] = [2, 6, 2, 3, 8, 4]) with the arguments ``over``."""
    p = {n: None if x is None else x.float() for n, x in loglinear_problem(kind, 6, 3).items()}
    p.update(over)
    return p


LOGLINEAR_GENERALIZED_BAD_INPUT = [  # (overrides of bad_loglinear_problem, message): refused by the
    # generalized chunk op and decoding step alike
    (dict(level_scales=torch.rand(2, 6, 3, 3)), "level_scales must have shape [B, T, H, L]"),
    (dict(level_scales=torch.rand(2, 6, 2, 3, dtype=torch.float64)), "level_scales has dtype torch.float64"),
    (dict(level_scales=torch.ones(2, 6, 2, 3, dtype=torch.long)), "level_scales has dtype torch.int64"),
    (dict(offset=True), "offset must be an int"),
    (dict(initial_state=torch.zeros(2, 2, 4, 8, 4)), "initial_state must have shape [B, H, L, K, V]"),
    (dict(a=torch.randn(2, 6, 2, 1, 7)), "a must have shape [B, T, H, r_ab, K]"),
]


def assert_reset_gradients_zero_and_finite(run, inputs: dict) -> None:
    """``run(**inputs) -> (o, state)`` on inputs with some g = -inf (leaves that require grad): the
    outputs and every gradient are finite, g's gradient is exactly 0 at the resets and a real
    gradient (non-zero) at most other entries."""
    o, s = run(**inputs)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    (o.square().sum() + s.square().sum()).backward()
    for name, x in inputs.items():
        assert torch.isfinite(x.grad).all(), name
    reset = torch.isinf(inputs["g"])
    assert reset.any() and (inputs["g"].grad[reset] == 0).all()
    assert (inputs["g"].grad[~reset] != 0).float().mean() > 0.5  # the other entries are real gradients


def assert_full_reset_forgets(op, problem: dict, t: int, tol: float) -> None:
    """With g = -inf in every channel at token t, ``op``'s outputs from t on equal ``op`` run on the
    suffix from a zero state (within ``tol``: the chunk boundaries differ), and the inputs before t
    get no gradient. ``problem``: fp32 inputs on the backend's device; q and v are made leaves."""
    problem["g"][:, t] = float("-inf")
    problem["q"].requires_grad_()
    problem["v"].requires_grad_()
    o, _ = op(**problem)
    suffix = {n: (x[:, t:] if n != "initial_state" else None) for n, x in problem.items()}
    o_suffix, _ = op(**suffix)
    assert rel_err(o[:, t:], o_suffix) < tol
    o[:, t:].square().sum().backward()
    assert problem["v"].grad[:, :t].abs().max() == 0 and problem["v"].grad[:, t:].abs().max() > 0
