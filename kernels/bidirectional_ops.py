"""The bidirectional ops as ``torch.library`` custom ops (kernels/README.md §9): the vision mixers'
forward scan, reversed scan and own-write correction in one opaque node under ``torch.compile``.

    hdla_vision::chunk_hdla_bidirectional(q, k, v, beta, g, scale, initial_state, output_final_state, path)
    hdla_vision::chunk_generalized_bidirectional(q, k, v, a, b, g, scale, initial_state, output_final_state, path)
        -> (y [B, T, H, V], state, x)
    hdla_vision::fused_recurrent_hdla_bidirectional(q, k, v, beta, g, scale, initial_state) -> (y, states)
        (inference only: HDLA's token recurrence both ways, kernels/README.md §11)

``y = o_fwd + o_bwd - own``: the forward scan (t = 0..T-1) plus the reversed scan (t = T-1..0), each
with its own inputs, minus the reversed scan's own write ``own_t = scale * sum_l (q_t . K_bwd,t,l) V_bwd,t,l``
(so that the token's own write is counted once, through the forward scan: layers/mixer.py).

Inputs (checked by the public functions, ``ops.py``): an input that differs by direction is stacked
``[2, ...]`` (index 0 the forward scan, 1 the reversed one), a shared one has its single-direction
shape. HDLA: q, k ``[B, T, H, K]`` and v ``[B, T, H, V]`` shared, beta ``[2, B, T, H]`` and g
``[2, B, T, H, K]`` per direction. Generalized: q shared; each of k ``[B, T, H, r_kv, K]``,
v ``[B, T, H, r_kv, V]``, a, b ``[B, T, H, r_ab, K]`` shared or stacked; g ``[2, B, T, H, K]`` or
``[2, B, T, H]`` (a decay per head) always per direction. initial_state ``[2, B, H, K, V]`` or None.

Outputs (every output a tensor, as in ``custom_ops.py``): y in q's dtype; ``state``: the two final
states ``[2, B, H, K, V]`` in the accumulation dtype when ``output_final_state``, else ``[0]``;
``x`` (not differentiable): on the fused path the chunk64 states ``h [2, B, H, NT, K, V]``, else the
two single-direction ops' ``x`` stacked (``[2, 0]`` on the PyTorch chunk form).

Paths. Where the op's path is chunk64 (``custom_ops._generalized_path`` with ``bidirectional``,
``_hdla_path``), the fused path: every kernel launch covers both directions (a direction axis folded
into the batch-head grid axis, generalized/directions.py), the output kernel writes y once with the
correction, the backward reads dy once per direction and sums the shared inputs' gradients from
per-direction partials. Everywhere else (CPU without the interpreter, the chunk16 family, the PyTorch
chunk form, ranks or dtypes chunk64 does not run) the unfused path: the two single-direction ops'
bodies (``custom_ops.run_*``), then their sum and the correction in fp32 (float64 for float64 inputs),
the same semantics: one Triton kernel each way (``bidirectional_combine.py``) where Triton runs and k, v
are shared, elementwise PyTorch otherwise.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .custom_ops import (AUTO, FORM, NAMESPACE, _contiguous, _cotangents, _dh0_or_empty, _empty, _fake_outputs,
                         _generalized_path, _hdla_path, _state_dtype, run_generalized, run_generalized_backward,
                         run_hdla, run_hdla_backward)
from .utils import check_log_decay, use_triton

FUSED = "chunk64"
# The generalized op's inputs that may be shared or stacked per direction, and their single-direction dims.
GENERALIZED_STACKABLE = {"k": 5, "v": 5, "a": 5, "b": 5}


# ----------------------------------------------------------------------------- helpers
def per_direction(x: Tensor, single_dims: int) -> bool:
    """Whether ``x`` is stacked by direction: one more dim than its single-direction layout."""
    return x.dim() == single_dims + 1


def direction(x: Optional[Tensor], d: int, stacked: bool = True) -> Optional[Tensor]:
    """Direction ``d``'s slice of a stacked input (None stays None; a shared input is returned as it is)."""
    return None if x is None else (x[d] if stacked else x)


def _state_of(state: Tensor, d: int) -> Tensor:
    """Direction d's final state from the stacked ``[2, B, H, K, V]`` (or the empty placeholder)."""
    return state[d] if state.numel() else state


def _accumulation(q: Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def own_write(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``scale * sum_l (q_t . K_t,l) V_t,l``: ``[B, T, H, V]`` in fp32 (float64 for float64 q), for q
    ``[B, T, H, K]``, k ``[B, T, H, r, K]``, v ``[B, T, H, r, V]``."""
    acc = _accumulation(q)
    reads = (q.to(acc).unsqueeze(-2) * k.to(acc)).sum(-1, keepdim=True)  # [B, T, H, r, 1]
    return scale * (reads * v.to(acc)).sum(-2)


def own_write_vjp(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`own_write` for the cotangent ``dy [B, T, H, V]``, in its dtype:
    ``dq = scale sum_l (dy . V_l) K_l``, ``dK_l = scale (dy . V_l) q``, ``dV_l = scale (q . K_l) dy``."""
    acc = _accumulation(q)
    dy, q, k, v = (x.to(acc) for x in (dy, q, k, v))
    dy_v = (dy.unsqueeze(-2) * v).sum(-1, keepdim=True)  # [B, T, H, r, 1]
    q_k = (q.unsqueeze(-2) * k).sum(-1, keepdim=True)
    return scale * (dy_v * k).sum(-2), scale * dy_v * q.unsqueeze(-2), scale * q_k * dy.unsqueeze(-2)


def _stacked_states(initial_state: Optional[Tensor]) -> Optional[Tensor]:
    """``[2, B, H, K, V]`` -> the fused path's ``[2B, H, K, V]`` (forward batches, then reversed)."""
    return None if initial_state is None else initial_state.flatten(0, 1).contiguous()


def _fake_bidirectional(q: Tensor, v: Tensor, output_final_state: bool, path: str, r_ab: int, r_kv: int,
                        scalar: bool = False, hdla: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """Fake ``(y, state, x)``: one direction's fake outputs with the state and x stacked by direction."""
    y, state, x = _fake_outputs(q, v, output_final_state, path, r_ab, r_kv, scalar, hdla)
    batch, _, heads, dk = q.shape
    if output_final_state:
        state = q.new_empty(2, batch, heads, dk, v.shape[-1], dtype=_state_dtype(q, path != FORM))
    return y, state, x.new_empty(2, *x.shape)


def _fake_grads(inputs, initial_state: Optional[Tensor], q: Tensor) -> Tuple[Tensor, ...]:
    dh0 = _empty(q) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return (*(t.new_empty(t.shape) for t in inputs), dh0)


def _unfused_outputs(q: Tensor, parts, own: Tensor, output_final_state: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(y, state, x)`` of the unfused path from the two single-direction ``(o, state, x)``: y summed
    and corrected in the accumulation dtype, rounded once to q's dtype."""
    (o_f, s_f, x_f), (o_b, s_b, x_b) = parts
    y = (o_f.to(own.dtype) + o_b.to(own.dtype) - own).to(q.dtype)
    state = torch.stack([s_f, s_b]) if output_final_state else _empty(q)
    return _contiguous(y, state, torch.stack([x_f, x_b]))


def _combined_in_kernel(q: Tensor) -> bool:
    """Whether the unfused path sums the directions and subtracts the own write in one Triton kernel each
    way (bidirectional_combine.py): wherever Triton runs, except float64."""
    return use_triton(q) and q.dtype != torch.float64


def _combine(q: Tensor, k: Tensor, v: Tensor, scale: float, parts, output_final_state: bool
             ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(y, state, x)`` of the unfused path from the two directions' ``(o, state, x)``, with k, v
    ``[B, T, H, r, K|V]`` the reversed scan's (subtracted once): one combine kernel on the Triton
    path, else PyTorch (:func:`_unfused_outputs`)."""
    if not _combined_in_kernel(q):
        return _unfused_outputs(q, parts, own_write(q, k, v, scale), output_final_state)
    from .bidirectional_combine import combine_outputs

    (o_f, s_f, x_f), (o_b, s_b, x_b) = parts
    state = torch.stack([s_f, s_b]) if output_final_state else _empty(q)
    return _contiguous(combine_outputs(o_f, o_b, q, k, v, scale), state, torch.stack([x_f, x_b]))


def _combine_grads(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, grads_f, grads_b
                   ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the shared q, k ``[B, T, H, r, K]``, v ``[B, T, H, r, V]``: the two directions'
    ``(dq, dk, dv)`` summed, the own write's VJP subtracted (one kernel on the Triton path)."""
    if _combined_in_kernel(q):
        from .bidirectional_combine import combine_grads

        return combine_grads(dy, q, k, v, grads_f, grads_b, scale)
    dq, dk, dv = (_sum_shared([f, b], False, t.dtype) for f, b, t in zip(grads_f, grads_b, (q, k, v)))
    own_dq, own_dk, own_dv = own_write_vjp(dy, q, k, v, scale)
    return _minus(dq, own_dq), _minus(dk, own_dk), _minus(dv, own_dv)


def _sum_shared(grads, stacked: bool, dtype: torch.dtype) -> Tensor:
    """One input's gradient from the two directions' ``grads``: stacked for a per-direction input, else
    their sum (in fp32, rounded once)."""
    if stacked:
        return torch.stack(grads)
    return (grads[0].float() + grads[1].float()).to(dtype) if dtype != torch.float64 else grads[0] + grads[1]


def _minus(x: Tensor, correction: Tensor) -> Tensor:
    """``x - correction`` in the correction's (accumulation) dtype, rounded once to x's dtype."""
    return (x.to(correction.dtype) - correction).to(x.dtype)


def _setup_context(ctx, inputs, output):
    """Save the inputs, the state and x; keep scale, output_final_state and the path."""
    *tensors, scale, initial_state, output_final_state, path = inputs
    _, state, x = output
    ctx.mark_non_differentiable(x)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors, initial_state, x, state)
    ctx.scale, ctx.output_final_state, ctx.path = scale, output_final_state, path


# ----------------------------------------------------------------------------- HDLA
def _fused_hdla(q, k, v, beta, g, scale, initial_state, output_final_state):
    """Both directions of HDLA in one launch per stage (generalized/fwd.py): ``(y, state, h)``."""
    from .generalized import fwd

    q, k, v, beta, g = (t.contiguous() for t in (q, k, v, beta, g))
    strides = dict(g=g[0].numel(), hdla_beta=beta[0].numel())
    y, state, h = fwd.generalized_forward(q, k, v, None, None, g[0], scale, _stacked_states(initial_state), False,
                                          hdla_beta=beta[0], direction_strides=strides)
    state = state.view(2, *q.shape[:1], *state.shape[1:]) if output_final_state else _empty(q)
    return _contiguous(y, state, h.view(2, q.shape[0], *h.shape[1:]))


@torch.library.custom_op(f"{NAMESPACE}::chunk_hdla_bidirectional", mutates_args=())
def chunk_hdla_bidirectional_op(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, scale: float, initial_state: Optional[Tensor],
    output_final_state: bool, path: str = AUTO,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The bidirectional HDLA op on checked inputs (``ops.chunk_hdla_bidirectional``): ``(y, state, x)``,
    see the module docstring; ``path`` as ``custom_ops.chunk_hdla_op``'s."""
    path = _hdla_path(q, path)
    check_log_decay(g)
    if path == FUSED:
        return _fused_hdla(q, k, v, beta, g, scale, initial_state, output_final_state)
    parts = [run_hdla(q, k, v, beta[d], g[d], scale, direction(initial_state, d), output_final_state, d == 1, path)
             for d in (0, 1)]
    return _combine(q, k.unsqueeze(-2), v.unsqueeze(-2), scale, parts, output_final_state)


@chunk_hdla_bidirectional_op.register_fake
def _(q, k, v, beta, g, scale, initial_state, output_final_state, path=AUTO):
    return _fake_bidirectional(q, v, output_final_state, _hdla_path(q, path), 2, 1, hdla=True)


@torch.library.custom_op(f"{NAMESPACE}::chunk_hdla_bidirectional_backward", mutates_args=())
def chunk_hdla_bidirectional_backward_op(
    dy: Tensor, dht: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor,
    initial_state: Optional[Tensor], x: Tensor, state: Tensor, scale: float, path: str = AUTO,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbeta, dg, dh0)`` in the inputs' dtypes and shapes; dh0 empty without an initial
    state; ``dht`` the final states' cotangent ``[2, B, H, K, V]`` or None; ``path`` the forward's."""
    path = _hdla_path(q, path)
    if path == FUSED:
        from .generalized import bwd

        q, k, v, beta, g = (t.contiguous() for t in (q, k, v, beta, g))
        *grads, dbeta, dg, dh0 = bwd.generalized_backward(
            dy, _stacked_states(dht), q, k, v, None, None, g[0], scale, _stacked_states(initial_state),
            x.flatten(0, 1), False, hdla_beta=beta[0], direction_strides=dict(g=g[0].numel(), hdla_beta=beta[0].numel()))
        dh0 = None if dh0 is None else dh0.view(initial_state.shape)
        return _contiguous(*grads, dbeta, dg, _dh0_or_empty(dh0, initial_state, q))
    per = [run_hdla_backward(dy, direction(dht, d), q, k, v, beta[d], g[d], direction(initial_state, d), x[d],
                             _state_of(state, d), scale, d == 1, path) for d in (0, 1)]
    dq, dk, dv = _combine_grads(dy, q, k.unsqueeze(-2), v.unsqueeze(-2), scale,
                                *((p[0], p[1].unsqueeze(-2), p[2].unsqueeze(-2)) for p in per))
    dbeta, dg = torch.stack([p[3] for p in per]), torch.stack([p[4] for p in per])
    dh0 = torch.stack([p[5] for p in per]) if initial_state is not None else _empty(q)
    return _contiguous(dq, dk[..., 0, :], dv[..., 0, :], dbeta, dg, dh0)


@chunk_hdla_bidirectional_backward_op.register_fake
def _(dy, dht, q, k, v, beta, g, initial_state, x, state, scale, path=AUTO):
    return _fake_grads((q, k, v, beta, g), initial_state, q)


def _hdla_bidirectional_backward(ctx, dy, dstate, dx):
    if dy is None and dstate is None:
        return (None,) * 9
    q, k, v, beta, g, h0, x, state = ctx.saved_tensors
    dy, dht = _cotangents(ctx, q, v, dy, dstate)
    *grads, dh0 = chunk_hdla_bidirectional_backward_op(dy, dht, q, k, v, beta, g, h0, x, state, ctx.scale, ctx.path)
    return (*grads, None, None if h0 is None else dh0, None, None)


chunk_hdla_bidirectional_op.register_autograd(_hdla_bidirectional_backward, setup_context=_setup_context)



# ----------------------------------------------------------------------------- HDLA as a token recurrence
def _fused_recurrent():
    from .hdla import fused_recurrent  # noqa: PLC0415 (imports triton: loaded on first use)

    return fused_recurrent


@torch.library.custom_op(f"{NAMESPACE}::fused_recurrent_hdla_bidirectional", mutates_args=())
def fused_recurrent_hdla_bidirectional_op(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, scale: float, initial_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    """``chunk_hdla_bidirectional``'s recurrent path (``utils.use_recurrence``): both scans as token
    recurrences in one Triton launch (hdla/fused_recurrent.py), ``(y [B, T, H, V]`` in q's dtype, final
    states ``[2, B, H, K, V]`` fp32); its backward is one Triton launch for both directions too."""
    check_log_decay(g)
    return _contiguous(*_fused_recurrent().triton_fused_recurrent_hdla_bidirectional(q, k, v, beta, g, scale,
                                                                                     initial_state))


@fused_recurrent_hdla_bidirectional_op.register_fake
def _(q, k, v, beta, g, scale, initial_state):
    batch, _, heads, dk = q.shape
    return q.new_empty(v.shape), q.new_empty(2, batch, heads, dk, v.shape[-1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::fused_recurrent_hdla_bidirectional_backward", mutates_args=())
def fused_recurrent_hdla_bidirectional_backward_op(
    dy: Tensor, dstate: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, scale: float,
    initial_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbeta [2, ...], dg [2, ...], dh0 [2, B, H, K, V])`` of the recurrent bidirectional op;
    dh0 empty without an initial state."""
    *grads, dh0 = _fused_recurrent().triton_fused_recurrent_hdla_bidirectional_backward(dy, dstate, q, k, v, beta,
                                                                                       g, scale, initial_state)
    return _contiguous(*grads, _dh0_or_empty(dh0, initial_state, q))


@fused_recurrent_hdla_bidirectional_backward_op.register_fake
def _(dy, dstate, q, k, v, beta, g, scale, initial_state):
    return _fake_grads((q, k, v, beta, g), initial_state, q)


def _fused_recurrent_setup_context(ctx, inputs, output):
    q, k, v, beta, g, scale, initial_state = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, beta, g, initial_state)
    ctx.scale = scale


def _fused_recurrent_backward(ctx, dy, dstate):
    if dy is None and dstate is None:
        return (None,) * 7
    q, k, v, beta, g, h0 = ctx.saved_tensors
    if dy is None:
        dy = q.new_zeros(v.shape)
    *grads, dh0 = fused_recurrent_hdla_bidirectional_backward_op(dy, dstate, q, k, v, beta, g, ctx.scale, h0)
    return (*grads, None, None if h0 is None else dh0)


fused_recurrent_hdla_bidirectional_op.register_autograd(_fused_recurrent_backward,
                                                        setup_context=_fused_recurrent_setup_context)


# ----------------------------------------------------------------------------- generalized
def stacked_inputs(k: Tensor, v: Tensor, a: Tensor, b: Tensor) -> dict:
    """``{name: True}`` for each of k, v, a, b stacked by direction (the others are shared)."""
    return {name: per_direction(t, GENERALIZED_STACKABLE[name]) for name, t in dict(k=k, v=v, a=a, b=b).items()}


def _fused_generalized(q, k, v, a, b, g, scale, initial_state, output_final_state):
    """Both directions of the generalized op in one launch per stage: ``(y, state, h)``."""
    from .generalized import fwd

    stacked = stacked_inputs(k, v, a, b)
    q, k, v, a, b, g = (t.contiguous() for t in (q, k, v, a, b, g))
    inputs = dict(k=k, v=v, a=a, b=b)
    strides = {name: t[0].numel() for name, t in inputs.items() if stacked[name]}
    strides["g"] = g[0].numel()
    ks, vs, as_, bs = (t[0] if stacked[name] else t for name, t in inputs.items())
    y, state, h = fwd.generalized_forward(q, ks, vs, as_, bs, g[0], scale, _stacked_states(initial_state), False,
                                          direction_strides=strides)
    state = state.view(2, *q.shape[:1], *state.shape[1:]) if output_final_state else _empty(q)
    return _contiguous(y, state, h.view(2, q.shape[0], *h.shape[1:]))


def generalized_bidirectional_path(q: Tensor, k: Tensor, a: Tensor, g: Tensor, path: str = AUTO) -> str:
    """The path the bidirectional generalized op takes for these inputs (``custom_ops._generalized_path``: auto
    picks under the kernel setting, another ``path`` is checked; k, a shared or stacked, g ``[2, B, T, H(, K)]``)."""
    ks, as_ = (x[0] if per_direction(x, 5) else x for x in (k, a))
    return _generalized_path(q, ks, as_, g.dim() == 4, path, bidirectional=True)


@torch.library.custom_op(f"{NAMESPACE}::chunk_generalized_bidirectional", mutates_args=())
def chunk_generalized_bidirectional_op(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Tensor, scale: float, initial_state: Optional[Tensor],
    output_final_state: bool, path: str = AUTO,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The bidirectional generalized op on checked inputs (``ops.chunk_generalized_bidirectional``):
    ``(y, state, x)``, see the module docstring; ``path`` as ``custom_ops.chunk_generalized_op``'s."""
    stacked = stacked_inputs(k, v, a, b)
    path = generalized_bidirectional_path(q, k, a, g, path)
    check_log_decay(g)
    if path == FUSED:
        return _fused_generalized(q, k, v, a, b, g, scale, initial_state, output_final_state)
    parts = [run_generalized(q, direction(k, d, stacked["k"]), direction(v, d, stacked["v"]),
                             direction(a, d, stacked["a"]), direction(b, d, stacked["b"]), g[d], scale,
                             direction(initial_state, d), output_final_state, d == 1, path) for d in (0, 1)]
    return _combine(q, direction(k, 1, stacked["k"]), direction(v, 1, stacked["v"]), scale, parts, output_final_state)


@chunk_generalized_bidirectional_op.register_fake
def _(q, k, v, a, b, g, scale, initial_state, output_final_state, path=AUTO):
    path = generalized_bidirectional_path(q, k, a, g, path)
    return _fake_bidirectional(q, v, output_final_state, path, a.shape[-2], k.shape[-2], scalar=g.dim() == 4)


@torch.library.custom_op(f"{NAMESPACE}::chunk_generalized_bidirectional_backward", mutates_args=())
def chunk_generalized_bidirectional_backward_op(
    dy: Tensor, dht: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Tensor,
    initial_state: Optional[Tensor], x: Tensor, state: Tensor, scale: float, path: str = AUTO,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, da, db, dg, dh0)`` in the inputs' dtypes and shapes (a stacked input's gradient
    stacked, a shared one's summed over the directions); dh0 empty without an initial state; ``path``
    the forward's."""
    stacked = stacked_inputs(k, v, a, b)
    inputs = dict(k=k, v=v, a=a, b=b)
    path = generalized_bidirectional_path(q, k, a, g, path)
    if path == FUSED:
        from .generalized import bwd

        q, g = q.contiguous(), g.contiguous()
        inputs = {n: t.contiguous() for n, t in inputs.items()}
        strides = {n: t[0].numel() for n, t in inputs.items() if stacked[n]}
        strides["g"] = g[0].numel()
        *grads, dh0 = bwd.generalized_backward(
            dy, _stacked_states(dht), q, *(t[0] if stacked[n] else t for n, t in inputs.items()), g[0], scale,
            _stacked_states(initial_state), x.flatten(0, 1), False, direction_strides=strides)
        dh0 = None if dh0 is None else dh0.view(initial_state.shape)
        return _contiguous(*grads, _dh0_or_empty(dh0, initial_state, q))
    per = [run_generalized_backward(dy, direction(dht, d), q, *(direction(t, d, stacked[n]) for n, t in inputs.items()),
                                    g[d], direction(initial_state, d), x[d], _state_of(state, d), scale, d == 1,
                                    path) for d in (0, 1)]
    grads = {n: _sum_shared([p[i + 1] for p in per], stacked[n], t.dtype) for i, (n, t) in enumerate(inputs.items())
             if n in ("a", "b") or stacked["k"] or stacked["v"]}
    if stacked["k"] or stacked["v"]:
        dq = _sum_shared([p[0] for p in per], False, q.dtype)
        own_dq, own_dk, own_dv = own_write_vjp(dy, q, direction(k, 1, stacked["k"]), direction(v, 1, stacked["v"]),
                                               scale)
        dq = _minus(dq, own_dq)
        for name, own in (("k", own_dk), ("v", own_dv)):  # the reversed scan's write: its slice, or the shared input
            if stacked[name]:
                grads[name][1] = _minus(grads[name][1], own)
            else:
                grads[name] = _minus(grads[name], own)
    else:
        dq, grads["k"], grads["v"] = _combine_grads(dy, q, k, v, scale, *((p[0], p[1], p[2]) for p in per))
    grads = {n: grads[n] for n in inputs}
    dg = torch.stack([p[5] for p in per])
    dh0 = torch.stack([p[6] for p in per]) if initial_state is not None else _empty(q)
    return _contiguous(dq, *grads.values(), dg, dh0)


@chunk_generalized_bidirectional_backward_op.register_fake
def _(dy, dht, q, k, v, a, b, g, initial_state, x, state, scale, path=AUTO):
    return _fake_grads((q, k, v, a, b, g), initial_state, q)


def _generalized_bidirectional_backward(ctx, dy, dstate, dx):
    if dy is None and dstate is None:
        return (None,) * 10
    q, k, v, a, b, g, h0, x, state = ctx.saved_tensors
    dy, dht = _cotangents(ctx, q, v, dy, dstate)
    *grads, dh0 = chunk_generalized_bidirectional_backward_op(dy, dht, q, k, v, a, b, g, h0, x, state, ctx.scale,
                                                              ctx.path)
    return (*grads, None, None if h0 is None else dh0, None, None)


chunk_generalized_bidirectional_op.register_autograd(_generalized_bidirectional_backward,
                                                     setup_context=_setup_context)
