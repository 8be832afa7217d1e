"""The chunk ops as ``torch.library`` custom ops: one opaque node each under ``torch.compile``.

    hdla_vision::chunk_generalized(q, k, v, a, b, g, scale, initial_state, output_final_state, reverse, path)
    hdla_vision::chunk_hdla(q, k, v, beta, g, scale, initial_state, output_final_state, reverse, path)
        -> (o [B, T, H, V], state, x)
    hdla_vision::fused_recurrent_hdla(q, k, v, beta, g, scale, initial_state, reverse=False) -> (o, new_state)
    hdla_vision::fused_recurrent_generalized(q, k, v, a, b, g, scale, initial_state) -> (o, new_state)
    hdla_vision::chunk_delta_rule(q, k, v, beta, g, write, scale, initial_state, output_final_state, precision)
        -> (o, state, saved)   (the delta rule's Triton kernels; see its section at the end)

Every output is a tensor (custom ops cannot return None):

* ``o`` in q's dtype;
* ``state``: the final state ``[B, H, K, V]`` in the accumulation dtype (fp32 on the Triton path;
  fp32, or float64 for float64 q, on the PyTorch chunk form) when ``output_final_state``, else an
  empty ``[0]`` tensor. The public functions (``kernels/ops.py``) cast it to q's dtype or drop it;
* ``x``: what the Triton backward needs from the forward; not differentiable. On the chunk16
  kernels the reads ``X_t = S_{t-1}^T B_t`` ``[B, T, H, r_ab, V]`` (``[B, T, H, 2, V]`` for HDLA; empty
  at ``r_ab = 0``), bf16 for 16-bit q and fp32 otherwise (``generalized.chunk.stored_reads_dtype``); on the chunk64 kernels ``h [B, H, NT, K, V]``, the state entering
  each chunk (NT = cdiv(T, C), C from ``fwd.planned_chunk``), fp32 for fp32 q, else q's dtype;
  empty on the PyTorch chunk form.

The backward is a second pair of custom ops (``*_backward``), so a compiled backward graph holds
one opaque node too: the Triton backward (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)
or, on the PyTorch chunk form, autograd through the chunk form recomputed from the inputs: the
same autograd graph as differentiating the chunk form directly, so the gradients are those of the
eager chunk form, at the cost of a second forward in the backward.

``path`` (:data:`PATHS`) is where the op runs. The public functions (``ops.py``) pick it and pass it,
a constant of a compiled graph; ``auto`` (the default) lets the op pick by the same rule: the Triton
kernels where ``utils.use_triton`` says so, of the family ``utils.kernel_family`` names (env
``HDLA_VISION_KERNELS`` = ``auto``, the default, :func:`_path`: chunk64 from ``utils.CHUNK64_MIN_TOKENS``
tokens on, chunk16 below, with exceptions; or ``chunk16`` / ``chunk64``), else the PyTorch chunk form. chunk16 cannot run the ranks ``utils.triton_supports_ranks`` excludes; chunk64 runs r_ab
0..4, r_kv 1..4 at every head dim (``utils.chunk64_supports_ranks``) but not float64 inputs (its
kernels run fp32/bf16/fp16); ``auto`` then takes the other family, a named family the chunk form.
The shape, dtype and device checks stay in the public functions, before the op is called; the value
check ``g <= 0`` (CPU tensors) runs inside the ops, where it sees real tensors in eager and compiled
code alike (traced by dynamo it would be a data-dependent branch, i.e. a graph break).

``chunk_generalized`` takes ``g`` per key channel ``[B, T, H, K]`` or per head ``[B, T, H]`` (its
gradient comes back in g's shape). The chunk16 kernels get a per-head g broadcast to
``[B, T, H, K]``; the chunk64 kernels take it as it is (their scalar-decay specialisation).
"""
import warnings
from contextlib import contextmanager
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch._C import DispatchKey

from .generalized.torch_chunk import chunk_form, per_channel
from .hdla.naive import hdla_decay_factors
from .utils import (CHUNK64_MIN_TOKENS, check_log_decay, chunk64_supports_ranks, kernel_family, triton_supports_ranks,
                    use_triton)

NAMESPACE = "hdla_vision"


# ----------------------------------------------------------------------------- helpers
FORM = "form"  # the PyTorch chunk form
PATHS = ("chunk16", "chunk64", FORM)
# The chunk ops' ``path`` argument: ``auto`` lets the op pick (:func:`_path`); the public functions (ops.py) pass
# the path they picked, so that it is a constant of a compiled graph. The fake implementations give the stored
# tensors' shapes of that path; a path picked inside the op would leave the graph the same under every
# HDLA_VISION_KERNELS, and inductor's cache would hand a graph compiled for one family's shapes to another.
AUTO = "auto"


def _runs_on(family: str, q: Tensor, r_kv: int, r_ab: int, hdla: bool) -> bool:
    """Whether a Triton family runs these ranks and q's dtype (HDLA's own chunk16 kernels run it all)."""
    if family == "chunk64":
        return q.dtype != torch.float64 and chunk64_supports_ranks(r_kv, r_ab)
    return hdla or triton_supports_ranks(q.shape[-1], r_kv, r_ab)


def _path(q: Tensor, r_kv: int, r_ab: int, hdla: bool = False, per_head_decay: bool = False,
          bidirectional: bool = False) -> str:
    """Where an op runs: ``"chunk16"`` / ``"chunk64"`` (that Triton family) or ``FORM``. The setting
    ``auto`` tries chunk64 first from ``utils.CHUNK64_MIN_TOKENS`` tokens on, or at any length with one
    log-decay per head (``per_head_decay``) or for the bidirectional generalized op of rank r_ab >= 1
    (``bidirectional``), else chunk16 first, and takes the other family where the first cannot run the
    ranks or dtype. Raises ValueError for a bad ``HDLA_VISION_KERNELS`` whatever the device.

    Why per-head decay goes to chunk64: chunk16 runs it as K equal channels and sums their dg over K,
    terms that cancel; in bf16 on the GPU that dg was 1.06e-2 from float64 at T = 300 against 2.9e-3 on
    chunk64's scalar-decay kernels (benchmarks/results/launch_configs_h200/README.md). Why the bidirectional
    generalized op does: its fused path (both directions in each launch) took 4.14 / 7.01 ms fwd+bwd at rank 1
    against chunk16's 5.87 / 7.51 at (128, 196, 3, 64) / (256, 196, 3, 64) (H200, bf16,
    benchmarks/results/family_crossover_h200); rank 0 was not timed there and keeps the length rule."""
    setting = kernel_family()
    if not use_triton(q):
        return FORM
    if setting in ("auto", "delta"):  # delta reroutes the HDLA ops before they reach these (ops.py)
        chunk64_first = q.shape[1] >= CHUNK64_MIN_TOKENS or per_head_decay or (bidirectional and r_ab >= 1)
        order = ("chunk64", "chunk16") if chunk64_first else ("chunk16", "chunk64")
    else:
        order = (setting,)
    return next((family for family in order if _runs_on(family, q, r_kv, r_ab, hdla)), FORM)


def _generalized_path(q: Tensor, k: Tensor, a: Tensor, per_head_decay: bool, path: str = AUTO,
                      bidirectional: bool = False) -> str:
    """Where the generalized op (``bidirectional``: its bidirectional op) runs: :func:`_path` for ``path`` =
    auto, else ``path`` checked (:func:`_checked_path`); ``per_head_decay``: g holds one log-decay per head."""
    if path == AUTO:
        return _path(q, k.shape[-2], a.shape[-2], per_head_decay=per_head_decay, bidirectional=bidirectional)
    return _checked_path(path, q, k.shape[-2], a.shape[-2], hdla=False)


def _hdla_path(q: Tensor, path: str = AUTO) -> str:
    """Where the HDLA op runs: :func:`_path` for ``path`` = auto (HDLA has r_ab = 2, r_kv = 1), else
    ``path`` checked (:func:`_checked_path`)."""
    return _path(q, 1, 2, hdla=True) if path == AUTO else _checked_path(path, q, 1, 2, hdla=True)


def _checked_path(path: str, q: Tensor, r_kv: int, r_ab: int, hdla: bool) -> str:
    """``path`` where it names a path these inputs can run, else ValueError naming it."""
    if path not in PATHS:
        raise ValueError(f"path={path!r} is not a path of the chunk ops; expected one of {AUTO}, {', '.join(PATHS)}")
    if path != FORM and not (use_triton(q) and _runs_on(path, q, r_kv, r_ab, hdla)):
        raise ValueError(f"path={path!r} cannot run these inputs (r_kv = {r_kv}, r_ab = {r_ab}, {q.dtype} on "
                         f"{q.device.type}); path={AUTO!r} picks one that can")
    return path


def _state_dtype(q: Tensor, on_triton: bool) -> torch.dtype:
    """The dtype the final state is accumulated in."""
    return torch.float64 if q.dtype == torch.float64 and not on_triton else torch.float32


def _empty(q: Tensor) -> Tensor:
    """The placeholder for an output that is not there: ``[0]`` fp32 on q's device."""
    return q.new_empty(0, dtype=torch.float32)


def _state_or_empty(state: Tensor, q: Tensor, output_final_state: bool) -> Tensor:
    return state if output_final_state else _empty(q)


def _contiguous(*tensors: Tensor) -> Tuple[Tensor, ...]:
    """The ops' outputs are contiguous, as their fake implementations say (inductor checks strides)."""
    return tuple(t.contiguous() for t in tensors)


def _chunk64_states(q: Tensor, dv: int, r_ab: int, r_kv: int, scalar: bool, hdla: bool) -> Tensor:
    """Fake chunk64 ``x = h [B, H, NT, K, V]``, with the chunk the forward's host rule picks."""
    from .generalized import fwd  # imports triton: only on the Triton path

    batch, seq_len, heads, dk = q.shape
    chunk = fwd.planned_chunk(r_ab, r_kv, dk, dv, scalar, hdla, q.dtype)
    n_chunks = -(-seq_len // chunk)
    dtype = torch.float32 if q.dtype == torch.float32 else q.dtype
    return q.new_empty(batch, heads, n_chunks, dk, dv, dtype=dtype)


def _fake_outputs(q: Tensor, v: Tensor, output_final_state: bool, path: str, r_ab: int, r_kv: int = 1,
                  scalar: bool = False, hdla: bool = False):
    """Fake ``(o, state, x)``: shapes and dtypes only (x as the module docstring says, per path)."""
    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    on_triton = path != FORM
    o = q.new_empty(batch, seq_len, heads, dv)
    state = q.new_empty(batch, heads, dk, dv, dtype=_state_dtype(q, on_triton)) if output_final_state else _empty(q)
    if path == "chunk64":
        x = _chunk64_states(q, dv, r_ab, r_kv, scalar, hdla)
    elif path == "chunk16" and r_ab:
        x = q.new_empty(batch, seq_len, heads, r_ab, dv, dtype=torch.bfloat16 if q.dtype in (
            torch.bfloat16, torch.float16) else torch.float32)
    else:
        x = _empty(q)
    return o, state, x


def _fake_grads(q: Tensor, inputs, initial_state: Optional[Tensor]) -> Tuple[Tensor, ...]:
    """Fake gradients: contiguous, each input's shape and dtype; dh0 empty without an initial state."""
    dh0 = _empty(q) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return (*(t.new_empty(t.shape) for t in inputs), dh0)


@contextmanager
def _autograd_inside_op():
    """Autograd inside a custom op's implementation. The op's autograd wrapper runs the implementation
    below autograd (the autograd dispatch keys excluded for the call); re-admit them, and enable grad,
    for the nested backward of the chunk form. Plain autograd, so it works under any dispatch mode
    (``torch.func.vjp`` here fails under opcheck's and fake-tensor checks' modes)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther, DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _chunk_form_vjp(forward, primals, initial_state, do, dht):
    """Gradients of ``forward(*primals, initial_state) -> (o, state)`` for the cotangents ``do`` and
    ``dht`` (None: the state is not used), by autograd through the recomputed chunk form:
    ``(d primal for each primal..., dh0 or an empty tensor)``."""
    inputs = (*primals, initial_state) if initial_state is not None else primals
    with _autograd_inside_op():
        leaves = [t.detach().requires_grad_() for t in inputs]
        o, state = forward(*leaves[: len(primals)], leaves[-1] if initial_state is not None else None)
        outputs, cotangents = ((o, state), (do, dht)) if dht is not None else ((o,), (do,))
        grads = torch.autograd.grad(outputs, leaves, cotangents)
    grads = tuple(t.clone() if t.numel() == 0 else t for t in grads)  # empty a, b: expands of one zero
    return (*grads, *(() if initial_state is not None else (_empty(do),)))


def _dh0_or_empty(dh0: Optional[Tensor], initial_state: Optional[Tensor], q: Tensor) -> Tensor:
    """dh0 in the initial state's dtype, or the empty placeholder without an initial state."""
    return _empty(q) if dh0 is None else dh0.to(initial_state.dtype)


def _setup_context(ctx, inputs, output):
    """Save the inputs, the state and x; keep scale, output_final_state, reverse and the path."""
    *tensors, scale, initial_state, output_final_state, reverse, path = inputs
    _, state, x = output
    ctx.mark_non_differentiable(x)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors, initial_state, x, state)
    ctx.scale, ctx.output_final_state, ctx.reverse, ctx.path = scale, output_final_state, reverse, path


def _cotangents(ctx, q, v, do, dstate):
    """``do`` (zeros if the output was unused) and the final state's cotangent (None if not returned
    or unused). ``ctx.saved_tensors`` is read once, by the caller (activation checkpointing allows no more)."""
    if do is None:
        do = q.new_zeros(*q.shape[:-1], v.shape[-1])
    return do, (dstate if ctx.output_final_state else None)


# ----------------------------------------------------------------------------- chunk_generalized
@torch.library.custom_op(f"{NAMESPACE}::chunk_generalized", mutates_args=())
def chunk_generalized_op(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Tensor, scale: float,
    initial_state: Optional[Tensor], output_final_state: bool, reverse: bool, path: str = AUTO,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The generalized op on checked inputs (``ops.chunk_generalized``): ``(o, state, x)``, see the
    module docstring; ``path`` one of :data:`PATHS` or auto (:data:`AUTO`)."""
    path = _generalized_path(q, k, a, g.dim() == 3, path)
    check_log_decay(g)
    return run_generalized(q, k, v, a, b, g, scale, initial_state, output_final_state, reverse, path)


def run_generalized(q, k, v, a, b, g, scale, initial_state, output_final_state, reverse, path):
    """The body of :func:`chunk_generalized_op` on ``path`` (:func:`_generalized_path`; also one
    direction of the bidirectional op's unfused path, ``bidirectional_ops.py``)."""
    if path == "chunk64":
        from .generalized import fwd

        o, state, h = fwd.generalized_forward(q, k, v, a, b, g, scale, initial_state, reverse)
        return _contiguous(o, _state_or_empty(state, q, output_final_state), h)
    if path == "chunk16":
        from .generalized import chunk as triton_chunk

        g4 = per_channel(g, q.shape[-1])  # scalar decay: the chunk16 kernels take g per channel
        o, state, x = triton_chunk.triton_generalized_forward(q, k, v, a, b, g4, scale, initial_state, reverse)
        return _contiguous(o, _state_or_empty(state, q, output_final_state), _empty(q) if x is None else x)
    if q.is_cuda:
        warnings.warn(f"chunk_generalized: r_ab = {a.shape[-2]}, r_kv = {k.shape[-2]} at K = {q.shape[-1]} "
                      f"({q.dtype}) is outside what the {kernel_family()} Triton kernels run (kernels/utils.py: "
                      "triton_supports_ranks, chunk64_supports_ranks); using the slower PyTorch chunk form")
    o, state = chunk_form(q, k, v, a, b, g, scale, initial_state, reverse)
    return _contiguous(o, _state_or_empty(state, q, output_final_state), _empty(q))


@chunk_generalized_op.register_fake
def _(q, k, v, a, b, g, scale, initial_state, output_final_state, reverse, path=AUTO):
    path = _generalized_path(q, k, a, g.dim() == 3, path)
    return _fake_outputs(q, v, output_final_state, path, a.shape[-2], k.shape[-2],
                         scalar=g.dim() == 3)


@torch.library.custom_op(f"{NAMESPACE}::chunk_generalized_backward", mutates_args=())
def chunk_generalized_backward_op(
    do: Tensor, dht: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Tensor,
    initial_state: Optional[Tensor], x: Tensor, state: Tensor, scale: float, reverse: bool, path: str = AUTO,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, da, db, dg, dh0)`` in the inputs' dtypes and shapes (dg in g's shape); dh0 is
    empty without an initial state. ``dht`` is the final state's cotangent or None; ``path`` the forward's."""
    path = _generalized_path(q, k, a, g.dim() == 3, path)
    return run_generalized_backward(do, dht, q, k, v, a, b, g, initial_state, x, state, scale, reverse, path)


def run_generalized_backward(do, dht, q, k, v, a, b, g, initial_state, x, state, scale, reverse, path):
    """The body of :func:`chunk_generalized_backward_op` on ``path`` (also one direction of the
    bidirectional op's unfused path)."""
    if path == "chunk64":
        from .generalized import bwd

        *grads, dh0 = bwd.generalized_backward(do, dht, q, k, v, a, b, g, scale, initial_state, x, reverse)
        return _contiguous(*grads, _dh0_or_empty(dh0, initial_state, q))
    if path == "chunk16":
        from .generalized import chunk as triton_chunk

        g4 = per_channel(g, q.shape[-1])
        *grads, dg, dh0 = triton_chunk.triton_generalized_backward(
            do, dht, q, k, v, a, b, g4, initial_state, x, state, scale, reverse)
        dg = dg if g.dim() == 4 else dg.float().sum(-1).to(g.dtype)  # per head: sum over the broadcast
        return _contiguous(*grads, dg, _empty(q) if dh0 is None else dh0)

    def forward(q, k, v, a, b, g, h0):
        return chunk_form(q, k, v, a, b, g, scale, h0, reverse)

    return _contiguous(*_chunk_form_vjp(forward, (q, k, v, a, b, g), initial_state, do, dht))


@chunk_generalized_backward_op.register_fake
def _(do, dht, q, k, v, a, b, g, initial_state, x, state, scale, reverse, path=AUTO):
    return _fake_grads(q, (q, k, v, a, b, g), initial_state)


def _generalized_backward(ctx, do, dstate, dx):
    if do is None and dstate is None:
        return (None,) * 11
    q, k, v, a, b, g, h0, x, state = ctx.saved_tensors
    do, dht = _cotangents(ctx, q, v, do, dstate)
    *grads, dh0 = chunk_generalized_backward_op(do, dht, q, k, v, a, b, g, h0, x, state, ctx.scale, ctx.reverse,
                                                ctx.path)
    return (*grads, None, None if h0 is None else dh0, None, None, None)


chunk_generalized_op.register_autograd(_generalized_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- chunk_hdla
def _hdla_chunk_form(q, k, v, beta, g, scale, initial_state, reverse):
    """HDLA on the PyTorch chunk form: the generalized recurrence with HDLA's A, B."""
    a, b = hdla_decay_factors(k, beta, g)
    return chunk_form(q, k.unsqueeze(-2), v.unsqueeze(-2), a, b, g, scale, initial_state, reverse)


@torch.library.custom_op(f"{NAMESPACE}::chunk_hdla", mutates_args=())
def chunk_hdla_op(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, scale: float,
    initial_state: Optional[Tensor], output_final_state: bool, reverse: bool, path: str = AUTO,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The HDLA op on checked inputs (``ops.chunk_hdla``): ``(o, state, x)``, see the module docstring;
    ``path`` one of :data:`PATHS` or auto (:data:`AUTO`)."""
    path = _hdla_path(q, path)
    check_log_decay(g)
    return run_hdla(q, k, v, beta, g, scale, initial_state, output_final_state, reverse, path)


def run_hdla(q, k, v, beta, g, scale, initial_state, output_final_state, reverse, path):
    """The body of :func:`chunk_hdla_op` on ``path`` (also one direction of the bidirectional op's unfused
    path)."""
    if path == "chunk64":
        from .generalized import fwd

        o, state, h = fwd.generalized_forward(q, k, v, None, None, g, scale, initial_state, reverse, hdla_beta=beta)
        return _contiguous(o, _state_or_empty(state, q, output_final_state), h)
    if path == "chunk16":
        from .hdla import chunk as triton_hdla

        o, state, x = triton_hdla.triton_hdla_forward(q, k, v, beta, g, scale, initial_state, reverse)
        return _contiguous(o, _state_or_empty(state, q, output_final_state), x)
    o, state = _hdla_chunk_form(q, k, v, beta, g, scale, initial_state, reverse)
    return _contiguous(o, _state_or_empty(state, q, output_final_state), _empty(q))


@chunk_hdla_op.register_fake
def _(q, k, v, beta, g, scale, initial_state, output_final_state, reverse, path=AUTO):
    return _fake_outputs(q, v, output_final_state, _hdla_path(q, path), 2, 1, hdla=True)


@torch.library.custom_op(f"{NAMESPACE}::chunk_hdla_backward", mutates_args=())
def chunk_hdla_backward_op(
    do: Tensor, dht: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor,
    initial_state: Optional[Tensor], x: Tensor, state: Tensor, scale: float, reverse: bool, path: str = AUTO,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbeta, dg, dh0)`` in the inputs' dtypes; dh0 is empty without an initial state;
    ``path`` the forward's."""
    return run_hdla_backward(do, dht, q, k, v, beta, g, initial_state, x, state, scale, reverse, _hdla_path(q, path))


def run_hdla_backward(do, dht, q, k, v, beta, g, initial_state, x, state, scale, reverse, path):
    """The body of :func:`chunk_hdla_backward_op` on ``path`` (also one direction of the bidirectional op's
    unfused path)."""
    if path == "chunk64":
        from .generalized import bwd

        *grads, dh0 = bwd.generalized_backward(do, dht, q, k, v, None, None, g, scale, initial_state, x, reverse,
                                               hdla_beta=beta)
        return _contiguous(*grads, _dh0_or_empty(dh0, initial_state, q))
    if path == "chunk16":
        from .hdla import chunk as triton_hdla

        *grads, dh0 = triton_hdla.triton_hdla_backward(
            do, dht, q, k, v, beta, g, initial_state, x, state, scale, reverse)
        return _contiguous(*grads, _empty(q) if dh0 is None else dh0)

    def forward(q, k, v, beta, g, h0):
        return _hdla_chunk_form(q, k, v, beta, g, scale, h0, reverse)

    return _contiguous(*_chunk_form_vjp(forward, (q, k, v, beta, g), initial_state, do, dht))


@chunk_hdla_backward_op.register_fake
def _(do, dht, q, k, v, beta, g, initial_state, x, state, scale, reverse, path=AUTO):
    return _fake_grads(q, (q, k, v, beta, g), initial_state)


def _hdla_backward(ctx, do, dstate, dx):
    if do is None and dstate is None:
        return (None,) * 10
    q, k, v, beta, g, h0, x, state = ctx.saved_tensors
    do, dht = _cotangents(ctx, q, v, do, dstate)
    *grads, dh0 = chunk_hdla_backward_op(do, dht, q, k, v, beta, g, h0, x, state, ctx.scale, ctx.reverse, ctx.path)
    return (*grads, None, None if h0 is None else dh0, None, None, None)


chunk_hdla_op.register_autograd(_hdla_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- fused_recurrent_hdla
def _fused_recurrent():
    from .hdla import fused_recurrent  # imports triton: loaded on first use

    return fused_recurrent


def _fused_on_triton(q: Tensor) -> bool:
    return use_triton(q) and q.dtype != torch.float64


@torch.library.custom_op(f"{NAMESPACE}::fused_recurrent_hdla", mutates_args=())
def fused_recurrent_hdla_op(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, scale: float, initial_state: Optional[Tensor],
    reverse: bool = False,
) -> Tuple[Tensor, Tensor]:
    """The token recurrence on checked inputs (``fused_recurrent_hdla``; ``chunk_hdla``'s recurrent path):
    ``(o [B, T, H, V]`` in v's dtype, ``new_state [B, H, K, V]`` fp32, float64 for float64 inputs)."""
    check_log_decay(g)
    module = _fused_recurrent()
    run = module.triton_fused_recurrent_hdla if _fused_on_triton(q) else module.torch_fused_recurrent_hdla
    return _contiguous(*run(q, k, v, beta, g, scale, initial_state, reverse))


@fused_recurrent_hdla_op.register_fake
def _(q, k, v, beta, g, scale, initial_state, reverse=False):
    batch, seq_len, heads, dk = q.shape
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return v.new_empty(v.shape), q.new_empty(batch, heads, dk, v.shape[-1], dtype=state_dtype)


@torch.library.custom_op(f"{NAMESPACE}::fused_recurrent_hdla_backward", mutates_args=())
def fused_recurrent_hdla_backward_op(
    do: Tensor, dstate: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, scale: float,
    initial_state: Optional[Tensor], reverse: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbeta, dg, dh0)``: the Triton backward of the recurrence where the forward ran on
    Triton, else autograd through the PyTorch token loop; dh0 empty without an initial state."""
    module = _fused_recurrent()
    if _fused_on_triton(q):
        *grads, dh0 = module.triton_fused_recurrent_hdla_backward(do, dstate, q, k, v, beta, g, scale, initial_state,
                                                                  reverse)
        return _contiguous(*grads, _dh0_or_empty(dh0, initial_state, q))

    def forward(q, k, v, beta, g, h0):
        return module.torch_fused_recurrent_hdla(q, k, v, beta, g, scale, h0, reverse)

    return _contiguous(*_chunk_form_vjp(forward, (q, k, v, beta, g), initial_state, do, dstate))


@fused_recurrent_hdla_backward_op.register_fake
def _(do, dstate, q, k, v, beta, g, scale, initial_state, reverse=False):
    return _fake_grads(q, (q, k, v, beta, g), initial_state)


def _fused_setup_context(ctx, inputs, output):
    q, k, v, beta, g, scale, initial_state, reverse = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, beta, g, initial_state)
    ctx.scale, ctx.reverse = scale, reverse


def _fused_backward(ctx, do, dstate):
    if do is None and dstate is None:
        return (None,) * 8
    q, k, v, beta, g, h0 = ctx.saved_tensors
    if do is None:
        do = v.new_zeros(v.shape)
    *grads, dh0 = fused_recurrent_hdla_backward_op(do, dstate, q, k, v, beta, g, ctx.scale, h0, ctx.reverse)
    return (*grads, None, None if h0 is None else dh0, None)


fused_recurrent_hdla_op.register_autograd(_fused_backward, setup_context=_fused_setup_context)


# ----------------------------------------------------------------------------- fused_recurrent_generalized
def _fused_recurrent_generalized_module():
    from .generalized import fused_recurrent  # imports triton: loaded on first use

    return fused_recurrent


@torch.library.custom_op(f"{NAMESPACE}::fused_recurrent_generalized", mutates_args=())
def fused_recurrent_generalized_op(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Tensor, scale: float, initial_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    """The generalized decoding op on checked inputs (``fused_recurrent_generalized``): ``(o [B, T, H, V]``
    in v's dtype, ``new_state [B, H, K, V]`` fp32, float64 for float64 inputs)."""
    check_log_decay(g)
    module = _fused_recurrent_generalized_module()
    run = (module.triton_fused_recurrent_generalized if _fused_on_triton(q)
           else module.torch_fused_recurrent_generalized)
    return _contiguous(*run(q, k, v, a, b, g, scale, initial_state))


@fused_recurrent_generalized_op.register_fake
def _(q, k, v, a, b, g, scale, initial_state):
    batch, seq_len, heads, dk = q.shape
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (v.new_empty(batch, seq_len, heads, v.shape[-1]),
            q.new_empty(batch, heads, dk, v.shape[-1], dtype=state_dtype))


@torch.library.custom_op(f"{NAMESPACE}::fused_recurrent_generalized_backward", mutates_args=())
def fused_recurrent_generalized_backward_op(
    do: Tensor, dstate: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Tensor,
    scale: float, initial_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, da, db, dg, dh0)`` by autograd through the PyTorch token loop, recomputed on any
    device (the Triton kernel has no backward); dg in g's shape, dh0 empty without an initial state."""
    loop = _fused_recurrent_generalized_module().torch_fused_recurrent_generalized

    def forward(q, k, v, a, b, g, h0):
        return loop(q, k, v, a, b, g, scale, h0)

    return _contiguous(*_chunk_form_vjp(forward, (q, k, v, a, b, g), initial_state, do, dstate))


@fused_recurrent_generalized_backward_op.register_fake
def _(do, dstate, q, k, v, a, b, g, scale, initial_state):
    return _fake_grads(q, (q, k, v, a, b, g), initial_state)


def _fused_generalized_setup_context(ctx, inputs, output):
    q, k, v, a, b, g, scale, initial_state = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, a, b, g, initial_state)
    ctx.scale = scale


def _fused_generalized_backward(ctx, do, dstate):
    if do is None and dstate is None:
        return (None,) * 8
    q, k, v, a, b, g, h0 = ctx.saved_tensors
    if do is None:
        do = v.new_zeros(*q.shape[:-1], v.shape[-1])
    *grads, dh0 = fused_recurrent_generalized_backward_op(do, dstate, q, k, v, a, b, g, ctx.scale, h0)
    return (*grads, None, None if h0 is None else dh0)


fused_recurrent_generalized_op.register_autograd(_fused_generalized_backward,
                                                 setup_context=_fused_generalized_setup_context)


# ----------------------------------------------------------------------------- chunk_delta_rule
# hdla_vision::chunk_delta_rule(q, k, v, beta, g, write, scale, initial_state, output_final_state, precision,
#     recompute) -> (o, state, saved): the delta rule's Triton kernels (delta_rule/chunk.py, kernels/README.md §12);
#     ``saved`` the terms its backward reads, one fp32 buffer (delta_rule/terms.py; with ``recompute`` the states
#     alone, the backward remaking the rest). Inputs checked by the caller
#     (``delta_rule.chunk.chunk_delta_rule``); only its Triton path comes here.
@torch.library.custom_op(f"{NAMESPACE}::chunk_delta_rule", mutates_args=())
def chunk_delta_rule_op(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, write: Tensor, scale: float,
    initial_state: Optional[Tensor], output_final_state: bool, precision: Optional[str] = None,
    recompute: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(o [B, T, H, V]`` in q's dtype, the final state fp32 or empty, ``saved)``."""
    from .delta_rule.chunk import delta_rule_forward

    check_log_decay(g)
    o, state, saved = delta_rule_forward(q, k, v, beta, g, write, scale, initial_state, precision, recompute)
    return _contiguous(o, _state_or_empty(state, q, output_final_state), saved)


@chunk_delta_rule_op.register_fake
def _(q, k, v, beta, g, write, scale, initial_state, output_final_state, precision=None, recompute=False):
    from .delta_rule.terms import half_terms, resolved_precision, saved_numel, saved_terms

    batch, seq_len, heads, dk = q.shape
    dv = v.shape[-1]
    state = q.new_empty(batch, heads, dk, dv, dtype=torch.float32) if output_final_state else _empty(q)
    saved = q.new_empty(saved_numel(batch, seq_len, heads, dk, dv, g.dim() == 3, saved_terms(recompute),
                                    half_terms(resolved_precision(precision, q))), dtype=torch.float32)
    return q.new_empty(batch, seq_len, heads, dv), state, saved


@torch.library.custom_op(f"{NAMESPACE}::chunk_delta_rule_backward", mutates_args=())
def chunk_delta_rule_backward_op(
    do: Tensor, dht: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, write: Tensor,
    initial_state: Optional[Tensor], saved: Tensor, scale: float, precision: Optional[str] = None,
    recompute: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbeta, dg, dwrite, dh0)`` in the inputs' dtypes; dh0 is empty without an initial state."""
    from .delta_rule.chunk import delta_rule_backward

    *grads, dh0 = delta_rule_backward(do, dht, q, k, v, beta, g, write, scale, initial_state, saved, precision,
                                      recompute)
    return _contiguous(*grads, _dh0_or_empty(dh0, initial_state, q))


@chunk_delta_rule_backward_op.register_fake
def _(do, dht, q, k, v, beta, g, write, initial_state, saved, scale, precision=None, recompute=False):
    return _fake_grads(q, (q, k, v, beta, g, write), initial_state)


def _delta_rule_setup_context(ctx, inputs, output):
    *tensors, scale, initial_state, output_final_state, precision, recompute = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors, initial_state, output[2])
    ctx.scale, ctx.output_final_state, ctx.precision, ctx.recompute = scale, output_final_state, precision, recompute


def _delta_rule_backward(ctx, do, dstate, dsaved):
    if do is None and dstate is None:
        return (None,) * 11
    q, k, v, beta, g, write, h0, saved = ctx.saved_tensors
    do, dht = _cotangents(ctx, q, v, do, dstate)
    *grads, dh0 = chunk_delta_rule_backward_op(do, dht, q, k, v, beta, g, write, h0, saved, ctx.scale, ctx.precision,
                                               ctx.recompute)
    return (*grads, None, None if h0 is None else dh0, None, None, None)


chunk_delta_rule_op.register_autograd(_delta_rule_backward, setup_context=_delta_rule_setup_context)
