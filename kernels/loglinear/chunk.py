"""Log-linear attention on the linear chunk ops, one call per level (kernels/README.md §7).

The hierarchical mask splits exactly by level (log-linear paper eq. 4-5): a pair ``s <= t`` of
absolute positions has ``bit_length(t XOR s) = l >= 1`` iff ``t`` and ``s`` lie in the same aligned
block of ``2^l`` positions, ``s`` in its earlier half and ``t`` in its later half. So level ``l``'s
share of the output is the linear op run on each such block separately, from a zero state, with
the writes of the later half masked (``v = 0``) and the queries of the earlier half zeroed, the
later half's queries scaled by ``lambda_t^(l)``: the state a reader sees is then exactly
``sum_{s in earlier half} Phi(t, s) K_s V_s^T``. Level 0 is the token's own write. Levels
``>= L - 1`` are all read with ``lambda^(L-1)``.

The blocks are folded into the batch: block ``n`` of level ``l`` holds the call's tokens in
``[n 2^l, (n+1) 2^l)`` (absolute), in order, padded at the end to ``min(2^l, T)`` slots with
identity steps (all inputs zero: no write, transition I, no read). A cache's levels (initial state)
are read by one more call with every write masked, one batch copy per level ``j``, whose queries
carry the weight of the level ``levels.initial_level`` gives. The existing autograd of the linear
ops gives every gradient (``level_scales`` through the scaled queries).

Cost: ``O(log T)`` linear-op calls on at most ``3 T`` tokens each (plus ``L T`` with an initial state).
A call without a cache or final state takes instead the one chunk form of ``torch_chunk.py`` (everywhere but under
the Triton interpreter; :data:`PATH_ENV` to force either path), kernels/README.md §7; without gradients, with
each chunk's terms from the linear op's F1 kernel (``triton_chunk.py``).
"""
import functools
import os
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

from ..hdla.naive import hdla_decay_factors
from ..ops import chunk_generalized, chunk_hdla
from ..utils import check_generalized_inputs, check_hdla_inputs, env_switch, use_triton
from .checks import check_loglinear_inputs
from .levels import initial_level, max_level
from .torch_chunk import chunk_form_loglinear
from .triton_chunk import triton_chunk_form_loglinear, triton_terms_apply

# Which form runs a call without a cache or final state (the others always take the levels):
#   auto        the one chunk form (torch_chunk.py), except under the Triton interpreter (there the levels run the
#               Triton kernels, which is what the interpreter tests are for); on an H200 (bf16, fwd+bwd,
#               2026-11-28, benchmarks/results/loglinear_paths_h200) it took 38.0 / 47.9 / 185.4 ms against the
#               levels' 54.8 / 52.0 / 470.8 ms at (8, 4096, 3, 64), (8, 4096, 4, 64) and the LM shape (4, 4096, 16, 128);
#   levels      the per-level calls everywhere;  chunk_form  the one chunk form everywhere (the interpreter too).
PATH_ENV = "HDLA_VISION_LOGLINEAR"
PATHS = ("auto", "levels", "chunk_form")


def one_chunk_form(q: torch.Tensor, offset: int, initial_state, output_final_state: bool) -> bool:
    """Whether a call runs :func:`.torch_chunk.chunk_form_loglinear` (:data:`PATH_ENV`)."""
    path = os.environ.get(PATH_ENV, "") or "auto"
    if path not in PATHS:
        raise ValueError(f"{PATH_ENV} must be one of {', '.join(PATHS)}, got {path!r}")
    if initial_state is not None or output_final_state or path == "levels":
        return False
    return path == "chunk_form" or not (use_triton(q) and q.device.type == "cpu")

# Whether the one chunk form runs compiled by inductor (``torch.compile`` of torch_chunk.chunk_form_loglinear, one
# graph: its pairwise decays, masks and products fused), "1" / "0", for the calls that take it (on a Triton device
# those a gradient flows through: the others take F1's terms, triton_chunk.py). Unset: on for CUDA tensors, off on the
# CPU (inductor's C++ build per shape). On an H200 (bf16, fwd+bwd, 2026-11-29,
# benchmarks/results/loglinear_compiled_h200) 15.4 ms against 32.8 eager at (8, 4096, 3, 64) and 20.2 against 42.9 at
# (8, 4096, 4, 64); on a 2-core CPU (fp32, fwd+bwd at (1, 256, 2, 32)) 4.3 ms against 17.6. One graph per shape, dtype
# and offset (static shapes: the levels come from bit_length(offset + T - 1)); past dynamo's recompile limit a new one
# runs eagerly, and after a compiler failure (one warning) every call. A call inside a running trace takes the eager
# form, which the caller's compilation takes in.
COMPILE_ENV = "HDLA_VISION_LOGLINEAR_COMPILE"
COMPILE_BACKEND = "inductor"


@functools.lru_cache(maxsize=None)
def _compiled(backend) -> Callable:
    return torch.compile(chunk_form_loglinear, backend=backend, fullgraph=True, dynamic=False)  # bit_length of T


_compile_failed = []  # the first BackendCompilerFailed of this process: later calls run eagerly


def _compiled_or_eager(*args):
    """The compiled chunk form, or the eager one for a call that would need a graph past dynamo's recompile limit
    (with fullgraph, dynamo raises there instead of falling back) and, with a warning, for every call once the
    backend failed to compile a graph (the same function, unfused: slower, never wrong)."""
    from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit

    if _compile_failed:
        return chunk_form_loglinear(*args)
    try:
        return _compiled(COMPILE_BACKEND)(*args)
    except FailOnRecompileLimitHit:
        return chunk_form_loglinear(*args)
    except BackendCompilerFailed as error:
        _compile_failed.append(error)
        cause = type(error.inner_exception).__name__
        warnings.warn(f"log-linear chunk form: the compiler failed ({cause}); it runs eagerly from now on "
                      f"({COMPILE_ENV}=0 skips the attempt)", RuntimeWarning)
        return chunk_form_loglinear(*args)


def chunk_form(q: torch.Tensor) -> Callable:
    """:func:`.torch_chunk.chunk_form_loglinear` for a call on ``q``, compiled by :data:`COMPILE_BACKEND` where
    :data:`COMPILE_ENV` says so (unset: ``q`` on CUDA) and no trace is running."""
    if env_switch(COMPILE_ENV, q.is_cuda) and not torch.compiler.is_compiling():
        return _compiled_or_eager
    return chunk_form_loglinear


# op(tokens, initial_state) -> (o [B', T', H, V], final state [B', H, K, V]); tokens maps names to [B', T', H, ...]
LinearOp = Callable[[Dict[str, torch.Tensor], Optional[torch.Tensor]], Tuple[torch.Tensor, torch.Tensor]]


def level_blocks(offset: int, seq_len: int, level: int, device=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The folding of level ``level >= 1``.

    Returns:
        gather ``[n_blocks, m]``: the token in each slot (``seq_len`` = the padding token);
        flat ``[T]``: where each token went, as an index into the flattened ``n_blocks * m`` slots;
        later ``[T]`` bool: the token lies in the later half of its block (a reader, not a writer).
    """
    pos = offset + torch.arange(seq_len, device=device)
    block = (pos >> level) - (offset >> level)
    start_in_block = offset & ((1 << level) - 1)  # the first block starts at the call's first token
    within = (pos & ((1 << level) - 1)) - torch.where(block == 0, start_in_block, 0)
    last = offset + seq_len - 1
    n_blocks, slots = (last >> level) - (offset >> level) + 1, min(1 << level, seq_len)  # host ints: no device sync
    flat = block * slots + within
    gather = torch.full((n_blocks * slots,), seq_len, dtype=torch.long, device=device)
    gather[flat] = torch.arange(seq_len, device=device)
    later = ((pos >> (level - 1)) & 1).bool()
    return gather.view(n_blocks, slots), flat, later


def _fold(x: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, ...]`` -> ``[B * n_blocks, m, H, ...]`` by ``gather`` (index T: an all-zero token)."""
    padded = torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)
    n_blocks, slots = gather.shape
    folded = padded[:, gather.flatten()]
    return folded.reshape(x.shape[0] * n_blocks, slots, *x.shape[2:])


def _masked(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Zero the tokens where ``keep`` ``[T]`` is False."""
    return x * keep.view(1, -1, *([1] * (x.dim() - 2))).to(x.dtype)


def _weighted(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``q`` ``[B, T, H, K]`` times a weight ``[B, T, H]``, in q's dtype."""
    return (q * weight.unsqueeze(-1)).to(q.dtype)


def _exact_zero(*tensors: torch.Tensor) -> torch.Tensor:
    """A scalar 0 that depends on ``tensors`` with gradient 0, finite also at g = -inf (clamped
    first: ``0 * inf`` is NaN), so that autograd returns zeros for them instead of None."""
    return sum((x.clamp(-1.0, 1.0) * 0).sum() for x in tensors)


def _summed_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _run_level(op: LinearOp, tokens, level_scales, offset: int, level: int):
    """Level ``level``'s share of the output ``[B, T, H, V]`` and its final state ``[B, H, K, V]``
    (the level's bucket after the last token: zero unless the last token is in a later half)."""
    q = tokens["q"]
    batch, seq_len = q.shape[:2]
    gather, flat, later = level_blocks(offset, seq_len, level, q.device)
    weight = level_scales[..., min(level, level_scales.shape[-1] - 1)]
    level_tokens = dict(tokens, q=_masked(_weighted(q, weight), later), v=_masked(tokens["v"], ~later))
    o, final = op({n: _fold(x, gather) for n, x in level_tokens.items()}, None)
    o = o.reshape(batch, -1, *o.shape[2:])[:, flat]
    final = final.reshape(batch, gather.shape[0], *final.shape[1:])[:, -1]  # the last block's readers' state
    last_is_reader = (offset + seq_len - 1) >> (level - 1) & 1
    return o, (final if last_is_reader else torch.zeros_like(final))


def _read_cache(op: LinearOp, tokens, level_scales, initial_state: torch.Tensor, offset: int):
    """What the cache's levels ``[B, H, L, K, V]`` add: the output ``[B, T, H, V]`` and the final
    levels ``[B, H, L, K, V]`` (level j's content, carried to the last token, at
    ``initial_level(last, offset, j)``)."""
    batch, seq_len = tokens["q"].shape[:2]
    num_levels = level_scales.shape[-1]
    level_of = torch.tensor([[initial_level(offset + i, offset, j, num_levels) for j in range(num_levels)]
                             for i in range(seq_len)], device=level_scales.device)  # [T, L]: copy j at token i
    weight = level_scales.gather(-1, level_of[None, :, None, :].expand_as(level_scales))  # [B, T, H, L]: copy j's weight

    def per_level(x):  # [B, T, ...] -> [B * L, T, ...], copy j of batch b at b * L + j
        return x.unsqueeze(1).expand(batch, num_levels, *x.shape[1:]).reshape(batch * num_levels, *x.shape[1:])

    copies = {n: per_level(x) for n, x in tokens.items()}
    copies["q"] = _weighted(copies["q"], weight.permute(0, 3, 1, 2).reshape(batch * num_levels, seq_len, -1))
    copies["v"] = torch.zeros_like(copies["v"])
    heads, dk, dv = initial_state.shape[1], initial_state.shape[3], initial_state.shape[4]
    state = initial_state.transpose(1, 2).reshape(batch * num_levels, heads, dk, dv)  # copy j starts from level j
    o, final = op(copies, state)
    o = o.reshape(batch, num_levels, *o.shape[1:]).sum(1)
    moved_to = torch.nn.functional.one_hot(level_of[-1], num_levels).to(final.dtype)  # [L (from), L (to)]
    final = torch.einsum("bjhkv,jl->bhlkv", final.reshape(batch, num_levels, *final.shape[1:]), moved_to)
    return o, final


def _chunk_loglinear(
    op: LinearOp,
    tokens: Dict[str, torch.Tensor],
    own_read: torch.Tensor,
    own_write: torch.Tensor,
    level_scales: torch.Tensor,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    offset: int,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum the levels. ``own_read`` ``[B, T, H, V]`` is level 0's unscaled, unweighted output
    ``V_t K_t^T q_t``; ``own_write`` ``[B, H, K, V]`` the last token's write ``K V^T``; both in
    the dtype the levels are summed in."""
    seq_len = own_read.shape[1]
    num_levels = level_scales.shape[-1]
    compute = own_read.dtype  # the levels are summed in fp32 (float64 for float64 inputs)
    o = (1.0 if scale is None else scale) * level_scales[..., :1].to(compute) * own_read
    finals = [own_write] + [torch.zeros_like(own_write)] * (num_levels - 1)
    for level in range(1, max_level(offset, seq_len) + 1):
        o_level, final_level = _run_level(op, tokens, level_scales, offset, level)
        o = o + o_level.to(compute)
        top = min(level, num_levels - 1)
        finals[top] = finals[top] + final_level.to(compute)
    final = torch.stack(finals, dim=2)
    if initial_state is not None:
        o_cache, final_cache = _read_cache(op, tokens, level_scales, initial_state, offset)
        o, final = o + o_cache.to(compute), final + final_cache.to(compute)
    elif seq_len == 1:  # no linear-op call ran: the transition's inputs get their (zero) gradients too
        o = o + _exact_zero(*tokens.values()).to(compute)
    return o.to(tokens["q"].dtype), (final.to(tokens["q"].dtype) if output_final_state else None)


def chunk_loglinear_generalized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
    offset: int = 0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-linear generalized attention: the linear op's states split by Fenwick bucket.

    ``o_t = scale * sum_l lambda_t^(l) S_t^(l)^T q_t`` with ``S_t^(l) = sum_{s: level(t,s)=l} Phi(t, s) K_s V_s^T``,
    ``level(t, s) = min(bit_length(t XOR s), L - 1)`` on absolute positions ``t = offset + i``, and
    ``Phi`` the transitions ``Diag(exp g) - A B^T`` of :func:`~hdla_vision.kernels.chunk_generalized`
    (log-linear paper eq. 3-4; kernels/README.md §7).

    Args:
        q, g: ``[B, T, H, K]``; k ``[B, T, H, r_kv, K]``; v ``[B, T, H, r_kv, V]``;
            a, b ``[B, T, H, r_ab, K]``: as :func:`~hdla_vision.kernels.chunk_generalized`.
        level_scales: ``[B, T, H, L]``, the weights lambda_t^(l), q's dtype or float32. Levels
            ``>= L - 1`` are all read with the last weight (so they form one state, level L - 1);
            ``L >= bit_length(offset + T - 1) + 1`` gives every bucket its own weight.
        scale: output scale, None means 1.
        initial_state: ``[B, H, L, K, V]`` the levels of a cache after ``offset`` tokens (from
            ``output_final_state`` or the decoding step), or None.
        output_final_state: also return the levels after the last token.
        reverse: scan from token T-1 down to 0, levels relative to the reversed order (position
            ``T-1-i`` for token ``i``); offset and initial_state are refused with it.
        offset: absolute position of token 0, >= 0.

    Returns:
        ``(o [B, T, H, V], final [B, H, L, K, V] or None)`` in q's dtype; ``final`` holds the
        levels as :func:`fused_recurrent_loglinear_generalized` does after the same tokens.
    """
    check_generalized_inputs(q, k, v, a, b, g, None, scale)
    check_loglinear_inputs(q, v.shape[-1], level_scales, initial_state, offset, reverse)
    if reverse:
        o, final = chunk_loglinear_generalized(*(x.flip(1) for x in (q, k, v, a, b, g, level_scales)), scale=scale,
                                               output_final_state=output_final_state)
        return o.flip(1), final

    if one_chunk_form(q, offset, initial_state, output_final_state):
        if triton_terms_apply(q, k.shape[3], a.shape[3], k, v, a, b, g, level_scales):  # no gradient: F1's terms
            return triton_chunk_form_loglinear(q, k, v, a, b, g, level_scales, scale, offset), None
        return chunk_form(q)(q, k, v, a, b, g, level_scales, scale, offset), None

    def op(t, state):
        return chunk_generalized(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"], scale, state, True)

    q_, k_, v_ = (x.to(_summed_dtype(q)) for x in (q, k, v))
    own_read = torch.einsum("bthrk,bthk,bthrv->bthv", k_, q_, v_)
    own_write = torch.einsum("bhrk,bhrv->bhkv", k_[:, -1], v_[:, -1])
    tokens = dict(q=q, k=k, v=v, a=a, b=b, g=g)
    return _chunk_loglinear(op, tokens, own_read, own_write, level_scales, scale, initial_state, output_final_state, offset)


def chunk_loglinear_hdla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
    offset: int = 0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-linear HDLA: :func:`chunk_loglinear_generalized` with HDLA's transition
    ``(I - beta k k^T) Diag(exp g) (I - beta k k^T)`` and write ``k v^T``.

    q, k, g: ``[B, T, H, K]`` (k L2-normalised); v ``[B, T, H, V]``; beta ``[B, T, H]``;
    level_scales ``[B, T, H, L]``; initial_state / final ``[B, H, L, K, V]``. Only v is masked
    per level: k is also the Householder vector of the transition.
    """
    check_hdla_inputs(q, k, v, beta, g, None, scale)
    check_loglinear_inputs(q, v.shape[-1], level_scales, initial_state, offset, reverse)
    if reverse:
        o, final = chunk_loglinear_hdla(*(x.flip(1) for x in (q, k, v, beta, g, level_scales)), scale=scale,
                                        output_final_state=output_final_state)
        return o.flip(1), final

    if one_chunk_form(q, offset, initial_state, output_final_state):
        if triton_terms_apply(q, 1, 2, k, v, beta, g, level_scales):  # no gradient: F1's terms, HDLA's builder
            return triton_chunk_form_loglinear(q, k, v, None, None, g, level_scales, scale, offset, hdla_beta=beta), None
        a, b = hdla_decay_factors(k, beta, g)
        return chunk_form(q)(q, k.unsqueeze(-2), v.unsqueeze(-2), a, b, g, level_scales, scale, offset), None

    def op(t, state):
        return chunk_hdla(t["q"], t["k"], t["v"], t["beta"], t["g"], scale, state, True)

    q_, k_, v_ = (x.to(_summed_dtype(q)) for x in (q, k, v))
    own_read = (k_ * q_).sum(-1, keepdim=True) * v_
    own_write = k_[:, -1].unsqueeze(-1) * v_[:, -1].unsqueeze(-2)
    tokens = dict(q=q, k=k, v=v, beta=beta, g=g)
    return _chunk_loglinear(op, tokens, own_read, own_write, level_scales, scale, initial_state, output_final_state, offset)
