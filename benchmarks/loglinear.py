"""Log-linear attention against linear attention, ours and fla's, on a GPU (issue 14).

    python -m benchmarks.loglinear                          # all parts, JSON under $OUT (or --out)
    python -m benchmarks.loglinear --parts ours,fla --no-fla-check

Three parts, each timed with ``triton.testing.do_bench`` medians after warm-up (bf16 inputs, random
data, fwd and fwd+bwd), all in one process so that the ratios compare like with like:
  * ``ours``: ``chunk_loglinear_hdla`` against ``chunk_hdla`` (the linear op it is built on) at the
    kernel benchmark's vision, high-res and LM shapes (``benchmarks/kernels.py``) and a sweep of T from
    1K to 16K at 32K tokens per call (H = 4, d = 64); the ratio ``loglinear / linear`` is what the
    issue's target (within 2x at T = 4096) is about. The forward without gradients is timed both ways
    across chunks (``$HDLA_VISION_LOGLINEAR_ACROSS``, ``kernels/loglinear/triton_chunk.py``), each set
    explicitly: by the doubling (``fwd``) and by F2's chains (``loglinear_chains_fwd``, the op's default).
  * ``fla``: the log-linear paper's implementation benchmark (its §3.3 / appendix C: batch 2, 48 heads,
    head dim 64, state dim 128, q and k shared by all heads as Mamba-2's multi-value attention):
    fla's ``chunk_log_linear_attn`` against fla's linear ``chunk_simple_gla`` (the same Mamba-2
    recurrence without levels), our ``chunk_loglinear_generalized`` in the same rank-0 scalar-decay
    case, and SDPA (causal, 48 heads of 64) over T = 2K..16K.
  * ``check``: our log-linear HDLA in bf16 against the float64 token loop (``naive_loglinear_hdla``),
    and our Mamba-2 case against fla's ``chunk_log_linear_attn`` and the float64 loop (outputs and
    every gradient), each a relative error ``|a - b| / |b|``.
  * ``paths``: ``chunk_loglinear_hdla`` through the one PyTorch chunk form (``kernels/loglinear/torch_chunk.py``),
    through the per-level calls (``$HDLA_VISION_LOGLINEAR``) and through the chunk form compiled by inductor
    (``$HDLA_VISION_LOGLINEAR_COMPILE=1``; the first call's compilation is not timed: the timings warm up), each
    against ``chunk_hdla``, at ``--paths-shapes``. Its forward column is a call without gradients, which takes F1's
    terms on CUDA whatever the path.
The level weights are ``softplus`` of random logits, with ``L = bit_length(T - 1) + 1`` levels (one per
bucket). fla is an optional baseline, never a dependency: without it the ``fla`` part is skipped.
"""
import argparse
import json
import os
import platform

import torch
import torch.nn.functional as F
import triton

from benchmarks.kernels import SHAPES, make_inputs, peak_memory_mib, rel_err
from benchmarks.timing import cpu_median_ms, median_ms, time_fwd_bwd
from hdla_vision.kernels import (chunk_generalized, chunk_hdla, chunk_loglinear_generalized, chunk_loglinear_hdla,
                                 naive_loglinear_generalized, naive_loglinear_hdla)
from tools.provenance import provenance

SWEEP_TOKENS = 32768
SWEEP_LENGTHS = (1024, 2048, 4096, 8192, 16384)
PAPER_BATCH, PAPER_HEADS, PAPER_DV, PAPER_DK = 2, 48, 64, 128
PAPER_LENGTHS = (2048, 4096, 8192, 16384)


def num_levels(seq_len: int) -> int:
    """Levels that give every Fenwick bucket of a length-``seq_len`` sequence its own weight."""
    return max(seq_len - 1, 1).bit_length() + 1


def level_scales_like(q: torch.Tensor, heads: int, seed: int = 3) -> torch.Tensor:
    """Positive level weights ``[B, T, heads, L]`` (fp32, as the mixers give them), requiring grad."""
    batch, seq_len = q.shape[:2]
    gen = torch.Generator(device=q.device).manual_seed(seed)
    logits = torch.randn(batch, seq_len, heads, num_levels(seq_len), device=q.device, generator=gen)
    return F.softplus(logits).requires_grad_()


def hdla_linear(q, k, v, beta, g, level_scales):
    return chunk_hdla(q, k, v, beta, g)[0]


def hdla_loglinear(q, k, v, beta, g, level_scales):
    return chunk_loglinear_hdla(q, k, v, beta, g, level_scales)[0]


def ours_pair(shape, dtype, device) -> dict:
    """Linear and log-linear HDLA at one (B, T, H, D): fwd / fwd+bwd ms and the ratio."""
    batch, seq_len, heads, dim = shape
    q, k, v, beta, g = make_inputs(batch, seq_len, heads, dim, dtype, device)
    inputs = [q, k, v, beta, g, level_scales_like(q, heads)]
    row = {"linear": dict(zip(("fwd", "fwd_bwd"), time_fwd_bwd(hdla_linear, inputs)))}
    with across_chunks("doubling"):  # fwd_bwd needs gradients: the PyTorch terms, either way
        row["loglinear"] = dict(zip(("fwd", "fwd_bwd"), time_fwd_bwd(hdla_loglinear, inputs)))
    row["ratio_fwd_bwd"] = row["loglinear"]["fwd_bwd"] / row["linear"]["fwd_bwd"]
    row["ratio_fwd"] = row["loglinear"]["fwd"] / row["linear"]["fwd"]  # no gradient: log-linear on F1's terms
    with across_chunks("chains"), torch.no_grad():  # the same no-gradient call across chunks by F2's chains
        row["loglinear_chains_fwd"] = median_ms(lambda: hdla_loglinear(*inputs))
    row["ratio_fwd_chains"] = row["loglinear_chains_fwd"] / row["linear"]["fwd"]
    return row


def across_chunks(way: str):
    """``$HDLA_VISION_LOGLINEAR_ACROSS`` set to ``way`` within the block (restored after)."""
    from benchmarks.launch_configs import launch_settings
    from hdla_vision.kernels.loglinear.triton_chunk import ACROSS_ENV

    return launch_settings({f"env:{ACROSS_ENV}": way})


def ours_part(dtype, device) -> dict:
    shapes = dict(SHAPES)
    shapes.pop("long")
    shapes.update({f"T{t}": (SWEEP_TOKENS // t, t, 4, 64) for t in SWEEP_LENGTHS})
    result = {}
    for name, shape in shapes.items():
        result[name] = dict(bthd=list(shape), **ours_pair(shape, dtype, device))
        r = result[name]
        print(f"ours {name:7s} {str(shape):22s} linear {r['linear']['fwd_bwd']:8.3f} ms  "
              f"loglinear {r['loglinear']['fwd_bwd']:8.3f} ms  x{r['ratio_fwd_bwd']:.2f}  "
              f"(fwd {r['linear']['fwd']:.3f} / {r['loglinear']['fwd']:.3f} ms, x{r['ratio_fwd']:.2f}; chains "
              f"{r.get('loglinear_chains_fwd', float('nan')):.3f} ms, x{r.get('ratio_fwd_chains', float('nan')):.2f})",
              flush=True)
    return result


def paths_part(dtype, device, shapes) -> dict:
    """``chunk_loglinear_hdla`` on each of its paths (``$HDLA_VISION_LOGLINEAR``: the one PyTorch chunk form,
    then the per-level linear-op calls, then the chunk form compiled by inductor) against ``chunk_hdla``, at the
    named shapes (or ``BxTxHxD``): fwd / fwd+bwd ms (CPU: wall-clock medians,
    :func:`benchmarks.timing.cpu_median_ms`) and, on CUDA, the fwd+bwd's peak memory above the inputs (MiB)."""
    from hdla_vision.kernels.loglinear.chunk import COMPILE_ENV, PATH_ENV
    table = dict(SHAPES, **{f"T{t}": (SWEEP_TOKENS // t, t, 4, 64) for t in SWEEP_LENGTHS})
    median = cpu_median_ms if device == "cpu" else median_ms
    specs = {name: table[name] if name in table else _shape_spec(name, table) for name in shapes}  # before any run
    saved = {name: os.environ.get(name) for name in (PATH_ENV, COMPILE_ENV)}
    result = {}
    for name, (batch, seq_len, heads, dim) in specs.items():
        q, k, v, beta, g = make_inputs(batch, seq_len, heads, dim, dtype, device)
        inputs = [q, k, v, beta, g, level_scales_like(q, heads)]
        row = result[name] = dict(bthd=[batch, seq_len, heads, dim])
        for label, path, fn in (("chunk_form", "chunk_form", hdla_loglinear), ("linear", None, hdla_linear),
                                ("levels", "levels", hdla_loglinear),
                                ("chunk_form_compiled", "chunk_form", hdla_loglinear)):
            os.environ[PATH_ENV] = path or "auto"
            os.environ[COMPILE_ENV] = "1" if label == "chunk_form_compiled" else "0"
            row[label] = dict(zip(("fwd", "fwd_bwd"), time_fwd_bwd(fn, inputs, median)))
            if device != "cpu":
                row[label]["peak_mib"] = peak_memory_mib(fn, inputs)
            print(f"paths {name:7s} {label:10s} fwd {row[label]['fwd']:8.3f} ms  fwd+bwd {row[label]['fwd_bwd']:8.3f} ms",
                  flush=True)
        for label in ("chunk_form", "levels", "chunk_form_compiled"):
            row[f"{label}_over_linear"] = row[label]["fwd_bwd"] / row["linear"]["fwd_bwd"]
    for env, value in saved.items():
        if value is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = value
    return result


def _shape_spec(name: str, table: dict) -> tuple:
    """``BxTxHxD`` as four positive ints, else a ValueError naming ``--paths-shapes``."""
    parts = name.split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--paths-shapes: {name!r} is neither a shape name ({', '.join(table)}) nor BxTxHxD")
    return tuple(int(p) for p in parts)


def mamba2_inputs(batch, seq_len, heads, dk, dv, dtype, device, seed=0):
    """Mamba-2 multi-value attention: q, k ``[B, T, 1, dk]`` shared by all heads, v ``[B, T, H, dv]``,
    g ``[B, T, H]`` (log-decay per head), level weights ``[B, T, H, L]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q = rnd(batch, seq_len, 1, dk) * dk ** -0.5
    k = rnd(batch, seq_len, 1, dk) * dk ** -0.5
    v = rnd(batch, seq_len, heads, dv)
    g = F.logsigmoid(rnd(batch, seq_len, heads) + 3.0)
    tensors = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [g.requires_grad_()]
    return tensors + [level_scales_like(v, heads, seed + 1)]


def fla_loglinear(q, k, v, g, level_scales):
    from fla.ops.log_linear_attn import chunk_log_linear_attn

    # fla's kernel multiplies the level weights into q's dtype tiles: it takes them in q's dtype
    return chunk_log_linear_attn(q, k, v, g, level_scales.to(q.dtype), scale=1.0)[0]


def fla_linear(q, k, v, g, level_scales):
    from fla.ops.simple_gla import chunk_simple_gla

    heads = v.shape[2]
    return chunk_simple_gla(q.expand(-1, -1, heads, -1), k.expand(-1, -1, heads, -1), v, g, scale=1.0)[0]


def _rank0_generalized(q, k, v, g, heads):
    """Our op's arguments for the Mamba-2 case: rank 0 transition ``exp(g) I``, write ``k v^T``."""
    qh, kh = q.expand(-1, -1, heads, -1), k.expand(-1, -1, heads, -1)
    empty = qh.new_zeros(*qh.shape[:3], 0, qh.shape[-1])
    return qh, kh.unsqueeze(3), v.unsqueeze(3), empty, empty


def ours_mamba2_loglinear(q, k, v, g, level_scales):
    qh, kh, vh, a, b = _rank0_generalized(q, k, v, g, v.shape[2])
    return chunk_loglinear_generalized(qh, kh, vh, a, b, g, level_scales, scale=1.0)[0]


def ours_mamba2_linear(q, k, v, g, level_scales):
    qh, kh, vh, a, b = _rank0_generalized(q, k, v, g, v.shape[2])
    return chunk_generalized(qh, kh, vh, a, b, g, scale=1.0)[0]


def sdpa_heads(q, k, v, g, level_scales):
    heads = v.shape[2]
    qh = q.expand(-1, -1, heads, -1)[..., :v.shape[-1]].transpose(1, 2)
    kh = k.expand(-1, -1, heads, -1)[..., :v.shape[-1]].transpose(1, 2)
    return F.scaled_dot_product_attention(qh, kh, v.transpose(1, 2), is_causal=True).transpose(1, 2)


FLA_OPS = {"fla_loglinear": fla_loglinear, "fla_linear": fla_linear, "ours_loglinear": ours_mamba2_loglinear,
           "ours_linear": ours_mamba2_linear, "sdpa": sdpa_heads}


def fla_part(dtype, device) -> dict:
    result = {}
    for seq_len in PAPER_LENGTHS:
        inputs = mamba2_inputs(PAPER_BATCH, seq_len, PAPER_HEADS, PAPER_DK, PAPER_DV, dtype, device)
        row = {}
        for name, fn in FLA_OPS.items():
            try:
                row[name] = dict(zip(("fwd", "fwd_bwd"), time_fwd_bwd(fn, inputs)))
            except (RuntimeError, ValueError, torch.cuda.OutOfMemoryError) as err:  # recorded, not fatal
                row[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            torch.cuda.empty_cache()
        result[f"T{seq_len}"] = row
        print(f"paper T={seq_len:6d} " + "  ".join(
            f"{n} {r['fwd_bwd']:.3f}" if "fwd_bwd" in r else f"{n} {r['error'][:40]}" for n, r in row.items()),
              flush=True)
    return result


def grads_of(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


def compare(fn, ref_fn, inputs, names):
    """Relative errors of ``fn`` (given inputs) against ``ref_fn`` in float64: output and gradients."""
    out = fn(*inputs)
    grad = torch.randn_like(out)
    wrt = [x for x in inputs if x.requires_grad]
    ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in inputs]
    ref = ref_fn(*ref_in)
    errs = {"o": rel_err(out, ref)}
    ref_wrt = [x for x in ref_in if x.requires_grad]
    for name, a, b in zip(names, grads_of(out, wrt, grad), grads_of(ref, ref_wrt, grad.double())):
        errs[f"d{name}"] = rel_err(a, b)
    return errs


def check_part(dtype, device, with_fla: bool) -> dict:
    result = {}
    for seq_len in (77, 300):
        q, k, v, beta, g = make_inputs(2, seq_len, 2, 64, dtype, device, seed=5)
        inputs = [q, k, v, beta, g, level_scales_like(q, 2)]
        result[f"loglinear_hdla_T{seq_len}_vs_loop"] = compare(
            hdla_loglinear, lambda *x: naive_loglinear_hdla(*x)[0], inputs, ["q", "k", "v", "beta", "g", "lambda"])
    inputs = mamba2_inputs(2, 300, 4, 128, 64, dtype, device, seed=7)

    def loop(q, k, v, g, level_scales):
        qh, kh, vh, a, b = _rank0_generalized(q, k, v, g, v.shape[2])
        return naive_loglinear_generalized(qh, kh, vh, a, b, g, level_scales, scale=1.0)[0]

    names = ["q", "k", "v", "g", "lambda"]
    result["mamba2_ours_vs_loop"] = compare(ours_mamba2_loglinear, loop, inputs, names)
    if with_fla:
        result["mamba2_fla_vs_loop"] = compare(fla_loglinear, loop, inputs, names)
        ours_out, fla_out = ours_mamba2_loglinear(*inputs), fla_loglinear(*inputs)
        result["mamba2_ours_vs_fla"] = {"o": rel_err(ours_out, fla_out)}
    for name, errs in result.items():
        print(f"check {name}: " + " ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
    return result


def fla_available() -> bool:
    try:
        import fla.ops.log_linear_attn  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="check,ours,fla", help="comma list of: check, ours, fla, paths")
    parser.add_argument("--paths-shapes", default="hires,T4096", help="the paths part's shapes (comma list)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the paths part only")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = set(parts) - {"check", "ours", "fla", "paths"}
    if unknown:
        raise ValueError(f"--parts: unknown {sorted(unknown)}; expected check, ours, fla, paths")
    device, dtype = args.device, getattr(torch, args.dtype)
    if device == "cpu" and parts != ["paths"]:
        raise ValueError("--device cpu runs the paths part only (--parts paths)")
    has_fla = fla_available() and device == "cuda"
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({cpu_model()}, {torch.get_num_threads()} threads)"
    result = {**provenance(name), "torch": torch.__version__, "triton": triton.__version__,
              "dtype": args.dtype, "fla": has_fla}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "loglinear.json")
    builders = {"check": lambda: check_part(dtype, device, has_fla), "ours": lambda: ours_part(dtype, device),
                "fla": lambda: fla_part(dtype, device),
                "paths": lambda: paths_part(dtype, device, args.paths_shapes.split(","))}
    for part in parts:
        if part == "fla" and not has_fla:
            print("fla not installed: the fla part is skipped", flush=True)
            continue
        result[part] = builders[part]()
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
