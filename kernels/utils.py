"""Input checks shared by the ops: every error names the argument and what was expected."""
import os
from typing import Optional, Tuple

import torch

def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints: ``triton.cdiv``'s value without its per-call cost (a constexpr_function
    since Triton 3.6, ~4 us per call on the host; the ops' launch code called it ~160 times per fwd+bwd)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two ``>= n`` for a host int (0 for ``n <= 0``, as ``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def use_triton(x: torch.Tensor) -> bool:
    """Triton runs CUDA tensors, and CPU tensors when ``TRITON_INTERPRET=1``."""
    return x.is_cuda or interpreted(x)


def interpreted(x: torch.Tensor) -> bool:
    """Triton's interpreter runs x: a CPU tensor under ``TRITON_INTERPRET=1``."""
    return not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") == "1"


# The Triton kernel family of the chunk ops (kernels/README.md §8):
#   chunk16: the 16-token chunk kernels (generalized/chunk.py, scan.py; hdla/chunk.py);
#   chunk64: the chunk kernels of issue 11 (generalized/fwd.py, bwd.py): 32- or 64-token chunks, one
#            [K x K] . [K x BV] product per chunk on the state chain, a chunk-local backward;
#   auto (the default): chunk64 from CHUNK64_MIN_TOKENS tokens on, chunk16 below; a generalized op with one
#            log-decay per head, and the bidirectional generalized op of rank r_ab >= 1, on chunk64 at every
#            length (custom_ops._path: chunk16's per-head dg is less exact; the fused bidirectional path is faster);
#   delta:   the HDLA ops (one and both directions) on the delta rule's kernels over two steps per token
#            (delta_rule/, kernels/README.md §12; head dims up to 128; the registered op chunk_delta_rule), and the
#            seed mixers that are products of delta steps (layers/seed.py); the generalized ops as auto. ~1.7x
#            fla's KDA on an H200 so far (benchmarks/results/delta_kernels_h200). Under auto DeltaNet, Gated
#            DeltaNet / DeltaProduct and KDA take it, for 16-bit inputs of enough sequences (ops.on_delta_rule).
KERNEL_FAMILY_ENV = "HDLA_VISION_KERNELS"
KERNEL_FAMILIES = ("auto", "chunk16", "chunk64", "delta")
DEFAULT_KERNEL_FAMILY = "auto"
# chunk_hdla fwd+bwd on an H100 (bf16, H = 3, d = 64, ~25-33k tokens per call; 2026-11-24, commits da9490a
# and d296277, benchmarks/results/crossover_h100 and b1_inputs_h100): chunk16 / chunk64 took 3.87 / 4.28 ms
# at T = 196, 4.06 / 4.06 at 576, 4.76 / 3.66 at 1024, 5.38 / 3.72 at 2048, 7.79 / 4.47 at 4096; at the LM
# shape (T = 4096, H = 16, d = 128) 29.1 / 19.0 ms. Below ~576 tokens chunk16's shorter chunks win. On an H200
# after chunk64's launch merges (2026-11-28, d942eb7, benchmarks/results/family_crossover_h200): 2.94 / 4.36 ms at
# (128, 196, 3, 64), 3.54 / 3.95 at (64, 576, 3, 64); both directions in one op 6.64 / 5.74 ms at (128, 196, 3, 64).
# (custom_ops picks the family per call, and the other one where the first cannot run the ranks or dtype.)
CHUNK64_MIN_TOKENS = 576
# HDLA's recurrent path (kernels/README.md §11): under the auto setting, a chunk_hdla or
# chunk_hdla_bidirectional call that no gradient will flow through runs the token recurrence
# (hdla/fused_recurrent.py) up to this many tokens. H100, bf16, d = 64, forward, both directions in one
# op (2026-11-24, benchmarks/results/recurrent_h100): 0.35 against 1.49 ms at (B, T, H) = (128, 196, 3),
# 1.37 / 5.73 at (512, 196, 3), 1.81 / 6.63 at (128, 1024, 3), 2.71 / 6.57 at (32, 4096, 3) (twice the work of
# one block of the 224, 512 and 1024 px backbones at their benchmark batches). A program walks all T tokens,
# about 0.8 µs each: at 16384 tokens (2048 px, batch 2: 48 programs) that walk alone would take ~13 ms, more
# than the chunk kernels' ~3 ms for a whole block there (an estimate: not measured).
RECURRENT_MAX_TOKENS = 4096
# ... and in training (a gradient to compute) up to this many. Both directions' fwd+bwd of one block on an H200
# (bf16, d = 64, 2026-11-28, benchmarks/results/crossover_h200, after the chunk backward's speed-ups of
# 2026-11-25..28): 6.45 ms on the recurrence against 7.67 ms on the chunk kernels at (B, T, H) = (256, 196, 3),
# 10.63 against 8.47 at (64, 1024, 3); the ratio crosses 1 near 520 tokens (linear between the two). Before
# (H100, 2026-11-25): 7.82 / 8.17 and 13.19 / 15.37 ms, when the limit was 1024.
RECURRENT_TRAIN_MAX_TOKENS = 512
# ... and only for at least this many sequences walked at once (batch x heads x directions). A program walks
# all T tokens (~0.55 µs each on an H200), so the recurrence takes about T x 0.55 µs however many sequences run
# side by side, where the chunk kernels' time grows with the tokens, ~6 ns per token and sequence: the two meet
# near 92 sequences. H200, forward, bf16, d = 64, 2026-11-28 (crossover_h200): one direction at (32, 4096, 3)
# (96 sequences) 2.25 ms each; at (8, 4096, 3) (24) 2.21 ms recurrence against 0.70 ms chunk kernels; both
# directions at (8, 4096, 3) (48) 2.26 against 1.23 ms, at (32, 4096, 3) (192) 2.69 against 4.35 ms.
RECURRENT_MIN_SEQUENCES = 96
# ... except up to this many tokens, where the walk costs at most ~0.3 ms (512 x 0.55 us) whatever the batch: about
# what the chunk path's own launches cost on the host (five or more, 36-55 us each; benchmarks/results/NOTES.md,
# 2026-11-24/25), so a short sequence (a 224 px image, a prompt) keeps the recurrence at any batch (an estimate from
# those two measurements; batches below 96 sequences were not timed at these lengths).
RECURRENT_SHORT_TOKENS = 512
RECURRENT_MAX_HEAD_DIM = 64  # measured at d = 64 only; wider heads (the LM's 128) keep the chunk kernels


def env_switch(name: str, default: bool) -> bool:
    """An on/off setting from ``$name`` ("1" / "0"; unset or empty: ``default``); any other value is a ValueError."""
    flag = os.environ.get(name)
    if flag not in (None, "", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {flag!r}")
    return default if not flag else flag == "1"


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a gradient will flow from a call on ``tensors``: grad mode on and one of them requires it."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def use_recurrence(q: torch.Tensor, *tensors: Optional[torch.Tensor], directions: int = 1) -> bool:
    """Whether an HDLA chunk op's call runs the token recurrence instead of the chunk kernels: the auto
    setting, a Triton device, fp32 / bf16 / fp16 inputs, at most ``RECURRENT_MAX_HEAD_DIM`` channels per
    head, at most ``RECURRENT_MAX_TOKENS`` tokens, or ``RECURRENT_TRAIN_MAX_TOKENS`` where an input needs a
    gradient (the recurrence's backward against the chunk kernels': kernels/README.md §11), and above
    ``RECURRENT_SHORT_TOKENS`` tokens at least ``RECURRENT_MIN_SEQUENCES`` sequences (``q [B, T, H, K]``:
    B x H x ``directions``)."""
    if kernel_family() != "auto" or not use_triton(q) or q.dtype == torch.float64:
        return False
    if q.shape[-1] > RECURRENT_MAX_HEAD_DIM:
        return False
    training = needs_grad(q, *tensors)
    seq_len = q.shape[1]
    if seq_len > (RECURRENT_TRAIN_MAX_TOKENS if training else RECURRENT_MAX_TOKENS):
        return False
    return seq_len <= RECURRENT_SHORT_TOKENS or q.shape[0] * q.shape[2] * directions >= RECURRENT_MIN_SEQUENCES


def kernel_family() -> str:
    """The kernel family setting of the chunk ops' Triton path: ``$HDLA_VISION_KERNELS`` (unset or empty:
    the default, auto). Read at every op call, so set it before the first call (a compiled graph keeps
    the family it was traced with). Any other value raises ValueError."""
    family = os.environ.get(KERNEL_FAMILY_ENV, "") or DEFAULT_KERNEL_FAMILY
    if family not in KERNEL_FAMILIES:
        raise ValueError(f"{KERNEL_FAMILY_ENV}={family!r} is not a kernel family; expected one of "
                         f"{', '.join(KERNEL_FAMILIES)} (unset means {DEFAULT_KERNEL_FAMILY})")
    return family


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_HEAD_DIM = 256
MIN_HEAD_DIM = 1

# The log-decay floor. exp(x) is exactly 0 in fp32 for x <= -110 (the smallest fp32 denormal is
# e^-103.3; with flush-to-zero on GPUs, e^-87.3), and in float64 for x <= -750 (e^-744.4). The chunk
# forms take differences of cumulative sums of g, and -inf - (-inf) is NaN, so they clamp g at the
# floor of their compute dtype: g = -inf (lambda = 0, a full reset) gives exactly the reset, and
# dL/dg is 0 there (and wherever g < floor, where exp(g) underflows to 0 anyway). The floor is as
# high as it can be: the sums after a reset carry it, and their rounding grows with it.
LOG_ZERO_FP32 = -110.0
LOG_ZERO_FP64 = -750.0


def log_zero(compute_dtype: torch.dtype) -> float:
    """The log-decay floor of a compute dtype (float64, else fp32)."""
    return LOG_ZERO_FP64 if compute_dtype == torch.float64 else LOG_ZERO_FP32


def check_log_decay(g: torch.Tensor) -> None:
    """Refuse ``g > 0`` (outside the op's domain: d = exp(g) <= 1) for CPU tensors, where the check
    costs no device synchronisation. CUDA inputs are not checked (a host sync per call)."""
    if g.device.type == "cpu" and bool((g > 0).any()):
        raise ValueError(f"g is a log-decay and must be <= 0 (lambda = exp(g) in [0, 1]); got max g = {g.max().item():.4g}")


def check_dtypes(q: torch.Tensor, same: dict, may_be_fp32: dict) -> None:
    """The dtype rule: every tensor in ``same`` (k, v, a, b) has q's dtype; the gates in
    ``may_be_fp32`` (g, beta) have q's dtype or float32 (mixers keep gates in fp32 under bf16)."""
    for name, x in same.items():
        if x.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {x.dtype}; expected q's dtype {q.dtype} "
                             f"(q, k, v, a, b share one dtype; only g and beta may be float32 instead)")
    for name, x in may_be_fp32.items():
        if x.dtype not in (q.dtype, torch.float32):
            expected = "torch.float32" if q.dtype == torch.float32 else f"q's dtype {q.dtype} or torch.float32"
            raise ValueError(f"{name} has dtype {x.dtype}; expected {expected}")


def _shape(x: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in x.shape) + "]"


def check_tensor(name: str, x, expected: Tuple[int, ...], ref: torch.Tensor, layout: str) -> None:
    """Raise ValueError unless ``x`` is a tensor of shape ``expected`` on ``ref``'s device and dtype."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if tuple(x.shape) != tuple(expected):
        exp = "[" + ", ".join(str(d) for d in expected) + "]"
        raise ValueError(f"{name} must have shape {layout} = {exp}, got {_shape(x)}")
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but q is on {ref.device}; all inputs must share one device")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; expected one of float32, bfloat16, float16, float64")


def check_head_dims(dk: int, dv: int) -> None:
    for name, d in (("K (head dim of q/k)", dk), ("V (head dim of v)", dv)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} = {d} is not supported; expected 1 <= {name.split()[0]} <= {MAX_HEAD_DIM}")


def check_common(
    q: torch.Tensor,
    dv: int,
    initial_state: Optional[torch.Tensor],
    scale: Optional[float],
) -> Tuple[int, int, int, int]:
    """Check q and the initial state; return (B, T, H, K)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        got = _shape(q) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must have shape [B, T, H, K], got {got}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; expected one of float32, bfloat16, float16, float64")
    batch, seq_len, heads, dk = q.shape
    if seq_len < 1 or batch < 1 or heads < 1:
        raise ValueError(f"q must have B, T, H >= 1, got shape {_shape(q)}")
    check_head_dims(dk, dv)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (batch, heads, dk, dv), q, "[B, H, K, V]")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {type(scale).__name__}")
    return batch, seq_len, heads, dk


def check_generalized_inputs(q, k, v, a, b, g, initial_state, scale) -> Tuple[int, int]:
    """Validate the generalized op's shapes, dtypes and devices; return (r_kv, r_ab). The value check
    ``g <= 0`` is :func:`check_log_decay`, run inside the custom op (``custom_ops.py``)."""
    if not isinstance(v, torch.Tensor) or v.dim() != 5:
        got = _shape(v) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"v must have shape [B, T, H, r_kv, V], got {got}")
    batch, seq_len, heads, dk = check_common(q, v.shape[-1], initial_state, scale)
    r_kv, dv = v.shape[-2], v.shape[-1]
    if r_kv < 1:
        raise ValueError(f"v must have r_kv >= 1 (shape [B, T, H, r_kv, V]), got {_shape(v)}")
    check_tensor("v", v, (batch, seq_len, heads, r_kv, dv), q, "[B, T, H, r_kv, V]")
    check_tensor("k", k, (batch, seq_len, heads, r_kv, dk), q, "[B, T, H, r_kv, K]")
    check_log_decay_shape(g, q)
    if not isinstance(a, torch.Tensor) or a.dim() != 5:
        got = _shape(a) if isinstance(a, torch.Tensor) else type(a).__name__
        raise ValueError(f"a must have shape [B, T, H, r_ab, K], got {got}")
    r_ab = a.shape[-2]
    check_tensor("a", a, (batch, seq_len, heads, r_ab, dk), q, "[B, T, H, r_ab, K]")
    check_tensor("b", b, (batch, seq_len, heads, r_ab, dk), q, "[B, T, H, r_ab, K] (same r_ab as a)")
    check_dtypes(q, dict(k=k, v=v, a=a, b=b), dict(g=g))
    return r_kv, r_ab


def check_log_decay_shape(g, q: torch.Tensor) -> None:
    """The generalized op's g: ``[B, T, H, K]`` (a log-decay per key channel) or ``[B, T, H]`` (one
    per head), on q's device, in a supported dtype."""
    batch, seq_len, heads, dk = q.shape
    per_channel, per_head = (batch, seq_len, heads, dk), (batch, seq_len, heads)
    if isinstance(g, torch.Tensor) and tuple(g.shape) not in (per_channel, per_head):
        raise ValueError(f"g must have shape [B, T, H, K] = {list(per_channel)} (a log-decay per key channel) "
                         f"or [B, T, H] = {list(per_head)} (one per head), got {_shape(g)}")
    shape = tuple(g.shape) if isinstance(g, torch.Tensor) else per_channel
    check_tensor("g", g, shape, q, "[B, T, H, K] or [B, T, H]")


def triton_supports_ranks(dk: int, r_kv: int, r_ab: int) -> bool:
    """Whether the chunk16 Triton kernels run ``(r_ab, r_kv)`` at key head dim ``dk`` correctly. It
    applies to the chunk16 family only; chunk64 runs every rank it accepts
    (:func:`chunk64_supports_ranks`) at every head dim.

    Measured, not derived (``tests/gpu_rank_sweep.py`` on an H100, Triton 3.6; the table is
    ``benchmarks/results/rank_sweep_h100.md``). Outside this region:
    - r_ab >= 3 (4 padded rank slots) with a padded key block of 128 or more: the chunk-local
      kernels compile into code that returns wrong values (r_ab = 3, r_kv = 1, K = 128: 9% output
      error) or makes illegal memory accesses;
    - r_ab >= 3 at K <= 16: the tf32 products lose too much in the triangular solve of 48 or
      64 rows (up to 1.2e-2 at r_ab = 3, 2.0e-2 at r_ab = 4 relative error in bf16 against the
      loop on the same rounded inputs);
    - r_ab + r_kv > 4 at K > 128: the backward's adjoint pass reads that many query vectors per
      token and needs more shared memory than the GPU has.
    The ops send these cases to the PyTorch chunk form, which has no such limit, so every input
    the checks accept runs correctly."""
    if r_ab >= 3 and dk > 64:
        return False
    if r_ab >= 3 and dk <= 16:
        return False
    return dk <= 128 or r_ab + r_kv <= 4


CHUNK64_MAX_RANK = 4


def chunk64_supports_ranks(r_kv: int, r_ab: int) -> bool:
    """Whether the chunk64 kernels take ``(r_ab, r_kv)``: r_ab in 0..4 and r_kv in 1..4 at any head dim
    1..256 (the rank stacks are padded to 4 rows per token at most). Larger ranks run on the PyTorch
    chunk form."""
    return 0 <= r_ab <= CHUNK64_MAX_RANK and 1 <= r_kv <= CHUNK64_MAX_RANK


def check_hdla_inputs(q, k, v, beta, g, initial_state, scale) -> None:
    """Validate the HDLA ops' shapes, dtypes and devices (the value check ``g <= 0`` is
    :func:`check_log_decay`, run by the ops themselves)."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        got = _shape(v) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"v must have shape [B, T, H, V], got {got}")
    batch, seq_len, heads, dk = check_common(q, v.shape[-1], initial_state, scale)
    check_tensor("v", v, (batch, seq_len, heads, v.shape[-1]), q, "[B, T, H, V]")
    check_tensor("k", k, (batch, seq_len, heads, dk), q, "[B, T, H, K]")
    check_tensor("g", g, (batch, seq_len, heads, dk), q, "[B, T, H, K]")
    check_tensor("beta", beta, (batch, seq_len, heads), q, "[B, T, H]")
    check_dtypes(q, dict(k=k, v=v), dict(beta=beta, g=g))


DIRECTIONS_LAYOUT = "(index 0 the forward scan, 1 the reversed scan)"


def check_hdla_bidirectional_inputs(q, k, v, beta, g, initial_state, scale) -> None:
    """Validate the bidirectional HDLA op's inputs: q, k ``[B, T, H, K]`` and v ``[B, T, H, V]`` shared,
    beta ``[2, B, T, H]``, g ``[2, B, T, H, K]`` and initial_state ``[2, B, H, K, V]`` (or None) per
    direction; dtypes as :func:`check_hdla_inputs`."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        got = _shape(v) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"v must have shape [B, T, H, V] (shared by both directions), got {got}")
    batch, seq_len, heads, dk = check_common(q, v.shape[-1], None, scale)
    dv = v.shape[-1]
    check_tensor("v", v, (batch, seq_len, heads, dv), q, "[B, T, H, V] (shared by both directions)")
    check_tensor("k", k, (batch, seq_len, heads, dk), q, "[B, T, H, K] (shared by both directions)")
    check_tensor("beta", beta, (2, batch, seq_len, heads), q, f"[2, B, T, H] {DIRECTIONS_LAYOUT}")
    check_tensor("g", g, (2, batch, seq_len, heads, dk), q, f"[2, B, T, H, K] {DIRECTIONS_LAYOUT}")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (2, batch, heads, dk, dv), q, f"[2, B, H, K, V] {DIRECTIONS_LAYOUT}")
    check_dtypes(q, dict(k=k, v=v), dict(beta=beta, g=g))


def _shared_or_stacked(name: str, x, single: Tuple[int, ...], q: torch.Tensor, layout: str) -> None:
    """``x`` has the single-direction shape ``single`` (shared) or ``[2, *single]`` (one per direction)."""
    stacked = isinstance(x, torch.Tensor) and x.dim() == len(single) + 1
    check_tensor(name, x, (2, *single) if stacked else single, q,
                 f"{layout} (shared) or [2, {layout[1:]} {DIRECTIONS_LAYOUT}")


def check_generalized_bidirectional_inputs(q, k, v, a, b, g, initial_state, scale) -> Tuple[int, int]:
    """Validate the bidirectional generalized op's inputs; return (r_kv, r_ab). q ``[B, T, H, K]`` is
    shared; each of k ``[B, T, H, r_kv, K]``, v ``[B, T, H, r_kv, V]``, a, b ``[B, T, H, r_ab, K]``
    shared or stacked ``[2, ...]`` per direction; g ``[2, B, T, H, K]`` or ``[2, B, T, H]`` and
    initial_state ``[2, B, H, K, V]`` (or None) per direction; dtypes as :func:`check_generalized_inputs`."""
    for name, x in dict(v=v, k=k, a=a, b=b).items():
        if not isinstance(x, torch.Tensor) or x.dim() not in (5, 6):
            got = _shape(x) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must have shape [B, T, H, r, D] (shared) or [2, B, T, H, r, D] "
                             f"{DIRECTIONS_LAYOUT}, got {got}")
    batch, seq_len, heads, dk = check_common(q, v.shape[-1], None, scale)
    r_kv, dv, r_ab = v.shape[-2], v.shape[-1], a.shape[-2]
    if r_kv < 1:
        raise ValueError(f"v must have r_kv >= 1 (shape [B, T, H, r_kv, V]), got {_shape(v)}")
    head = (batch, seq_len, heads)
    _shared_or_stacked("v", v, (*head, r_kv, dv), q, "[B, T, H, r_kv, V]")
    _shared_or_stacked("k", k, (*head, r_kv, dk), q, "[B, T, H, r_kv, K]")
    _shared_or_stacked("a", a, (*head, r_ab, dk), q, "[B, T, H, r_ab, K]")
    _shared_or_stacked("b", b, (*head, r_ab, dk), q, "[B, T, H, r_ab, K] (same r_ab as a)")
    per_channel, per_head = (2, *head, dk), (2, *head)
    if not isinstance(g, torch.Tensor) or tuple(g.shape) not in (per_channel, per_head):
        got = _shape(g) if isinstance(g, torch.Tensor) else type(g).__name__
        raise ValueError(f"g must have shape [2, B, T, H, K] = {list(per_channel)} or [2, B, T, H] = {list(per_head)} "
                         f"{DIRECTIONS_LAYOUT}, got {got}")
    check_tensor("g", g, tuple(g.shape), q, "[2, B, T, H, K] or [2, B, T, H]")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (2, batch, heads, dk, dv), q, f"[2, B, H, K, V] {DIRECTIONS_LAYOUT}")
    check_dtypes(q, dict(k=k, v=v, a=a, b=b), dict(g=g))
    return r_kv, r_ab


# CUDA caps a launch grid's second and third axes at 65535 programs, and the kernels put B*H there.
MAX_GRID_BATCH_HEADS = 65535


def batch_slices(batch: int, heads: int, limit: Optional[int] = None) -> Tuple[slice, ...]:
    """Slices of the batch axis with at most ``limit`` (default ``MAX_GRID_BATCH_HEADS``) batch-head
    pairs each: one slice unless ``batch * heads`` exceeds it (the log-linear ops fold every bucket
    block into the batch, so they reach it at ordinary sizes).

    The one-slice case is decided by a comparison, not by iterating ``range(batch)``: under
    ``torch.compile`` with a dynamic batch, ``batch`` is symbolic and the comparison becomes a range
    guard, where the loop would specialise the graph to one batch size (a recompile per size)."""
    limit = MAX_GRID_BATCH_HEADS if limit is None else limit
    if heads > limit:
        raise ValueError(f"heads must be at most {limit} (a kernel grid axis), got {heads}")
    if batch * heads <= limit:
        return (slice(0, batch),)
    per = max(1, limit // heads)
    return tuple(slice(start, min(start + per, batch)) for start in range(0, batch, per))


def per_batch_slice(op, tensors: dict, heads: int):
    """``op(**tensors)`` run on each slice of :func:`batch_slices` and its outputs concatenated along
    the batch axis. ``tensors`` are batch-first (None stays None); ``op`` returns a tuple whose
    entries are batch-first tensors or None."""
    batch = next(x for x in tensors.values() if x is not None).shape[0]
    slices = batch_slices(batch, heads)
    if len(slices) == 1:
        return op(**tensors)
    parts = [op(**{n: None if x is None else x[s] for n, x in tensors.items()}) for s in slices]
    return tuple(None if outs[0] is None else torch.cat(outs) for outs in zip(*parts))
