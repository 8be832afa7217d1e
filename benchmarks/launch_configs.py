"""Launch settings of the chunk64 kernels timed on a device: warps, pipeline stages and column tiles of the
forward (F1ab, F1c, F2: ``fwd.launch_warps``), B1 (``bwd.b1_config``) and B2 (``bwd_chunk.b2_config``),
each variant against the defaults in the same process, per kernel and for the whole op.

    python -m benchmarks.launch_configs --shapes b1024 hires lm --variants base f1ab_w8 b2_block_w4 ...
    python -m benchmarks.launch_configs --list

Those tables were set from sm_90a compiles without spills (``--part aot`` of the stage benchmarks), never
timed; this is the timing. A variant changes launch settings only, not the arithmetic's order within a
product, so its gradients must match the defaults' to bf16 rounding (``max_rel_vs_base``; NaN fails).
Shapes: ``b1024`` is hdla_tiny's 1024 px training batch through ``chunk_hdla_bidirectional`` (both
directions, B = 16, T = 4096, H = 3, d = 64; ``b2048``, ``b224`` the 2048 / 224 px ones), ``hires`` and ``lm``
single-direction ``chunk_hdla`` at (8, 4096, 3, 64) and (4, 4096, 16, 128); ``<shape>:gla`` (``kda``, ``gdn``)
the generalized op at rank 0 (rank 1 with vector decay, rank 1 with a decay per head); bf16, mild gates. Per kernel: torch.profiler's device µs per
call of the op's fwd+bwd; whole op: ``triton.testing.do_bench`` median. Needs CUDA.
"""
import argparse
import json
import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F
import triton

from benchmarks.kernel_stages_bwd import _rel as rel
from benchmarks.kernel_stages_bwd import profile_launches
from hdla_vision.kernels import chunk_generalized, chunk_generalized_bidirectional, chunk_hdla, chunk_hdla_bidirectional
from hdla_vision.kernels import utils
from hdla_vision.kernels.generalized import bwd, bwd_chunk, fwd
from tools.provenance import provenance

SHAPES = {"b1024": (16, 4096, 3, 64, True), "b2048": (2, 16384, 3, 64, True), "hires": (8, 4096, 3, 64, False),
          "lm": (4, 4096, 16, 128, False), "b224": (256, 196, 3, 64, True)}
# kind -> (r_ab, scalar decay per head); "hdla" runs the HDLA ops, the others chunk_generalized(_bidirectional)
# with r_kv = 1 as the seed mixers call them: GLA (rank 0), KDA (rank 1, vector decay), GDN (rank 1, decay per head)
KINDS = {"hdla": (2, False), "gla": (0, False), "kda": (1, False), "gdn": (1, True)}

# variant -> overrides: "fwd:<stage>" a forward stage's warps (F1ab, F1c, F2), "f2:BV" F2's state columns per
# program, "maxnreg:<stage>" a forward stage's register cap, "b1:<key>" and "b2:<key>" an entry of b1_config /
# b2_config, "env:<name>" an environment variable (B2's scratch budget), "utils:<name>" a routing limit of
# kernels.utils, "slices:old" the chunk backward's batch slices by the rule before 0c1e469 (:func:`old_slices`)
VARIANTS = {
    "base": {},
    "old_defaults": {"fwd:F1ab": 8, "b2:BKV": 32},  # the tables before this benchmark (HDLA at d <= 64)
    "before": {"fwd:F1ab": 8, "b2:BKV": 32, "slices:old": True},  # and the slice rule before 0c1e469
    "old_bkv": {"b2:BKV": 32},
    "f1ab_w4": {"fwd:F1ab": 4}, "f1ab_w8": {"fwd:F1ab": 8}, "f1ab_w2": {"fwd:F1ab": 2},
    "f1c_w4": {"fwd:F1c": 4}, "f1c_w8": {"fwd:F1c": 8},
    "f2_w8": {"fwd:F2": 8}, "f2_w2": {"fwd:F2": 2}, "f2_w4": {"fwd:F2": 4},
    "b1_w8": {"b1:num_warps": 8}, "b1_w2": {"b1:num_warps": 2},
    "b2_block_w4": {"b2:warps_block": 4}, "b2_block_w8": {"b2:warps_block": 8},
    "b2_vjp_w4": {"b2:warps_vjp": 4}, "b2_vjp_w8": {"b2:warps_vjp": 8}, "b2_vjp_s2": {"b2:stages_vjp": 2},
    "b2_gemm_w8": {"b2:warps_gemm": 8}, "b2_gemm_w2": {"b2:warps_gemm": 2},
    "b2_gemm_s3": {"b2:stages_gemm": 3}, "b2_gemm_s1": {"b2:stages_gemm": 1},
    "s4_single": {"b2:s4_group": 1},  # S4 as one launch per product (before 2026-11-28)
    "b2_stacks_w8": {"b2:warps_stacks": 8}, "b2_stacks_w2": {"b2:warps_stacks": 2},
    "b2_bkv64": {"b2:BKV": 64}, "b2_bkv128": {"b2:BKV": 128}, "b2_bkv16": {"b2:BKV": 16}, "b2_bks32": {"b2:BKS": 32},
    "f1ab_w4_bkv64": {"fwd:F1ab": 4, "b2:BKV": 64}, "f1ab_w4_bkv128": {"fwd:F1ab": 4, "b2:BKV": 128},
    "budget_1152": {"env:HDLA_VISION_B2_SCRATCH_MIB": "1152"}, "budget_2048": {"env:HDLA_VISION_B2_SCRATCH_MIB": "2048"},
    "budget_0": {"env:HDLA_VISION_B2_SCRATCH_MIB": "0"},
    # operands of B2's factored diagonal Gram blocks (bwd_chunk.DIAG_PRECISIONS): S2 / S2b (diag_gram, default tf32;
    # tf32x3 before 2026-11-25), S5a (diag_vjp, per Gram: bwd_chunk.VJP_DIAG_PRECISIONS; all tf32x3 before)
    "s2_tf32x3": {"b2:diag_gram": "tf32x3"}, "s2_bf16": {"b2:diag_gram": "bf16"}, "s5_tf32": {"b2:diag_vjp": "tf32"},
    **{f"s5_tf32_{name}": {"b2:diag_vjp": tuple("tf32" if i == gid else "tf32x3" for i in range(4))}
       for gid, name in enumerate(("qk", "qa", "ab", "kb"))},  # one Gram VJP's diagonal blocks on tf32
    "s5_tf32_m": {"b2:diag_vjp": ("tf32", "tf32", "tf32x3", "tf32x3")},  # M_QK's and M_QA's
    "s5_tf32x3": {"b2:diag_vjp": "tf32x3"},  # every Gram VJP on tf32x3 (the default before 2026-11-25)
    "diag_tf32x3": {"b2:diag_gram": "tf32x3", "b2:diag_vjp": "tf32x3"},  # S2 and S5a as before 2026-11-25
    "rank_grams": {"b2:hdla_gram": False},  # HDLA's S2 and S5a over the rank stacks (before 2026-11-25)
    "full_stacks": {"b2:hdla_lean": False},  # HDLA's S1 writes every stack, fp32 At and Bh (before 2026-11-28)
    "f1_gram": {"env:HDLA_VISION_F1_GRAM": "1"},  # F1 for HDLA from six base Grams (fwd.f1_hdla_gram; off by default)
    "stacks16": {"env:HDLA_VISION_B2_SCRATCH": "lowp_stacks"},  # B2's copies of k, a, b in 16 bits (off by default)
    "bkg64": {"b2:BKG": 64},  # HDLA's S2 on 64 K columns per step (spills 168 bytes on sm_90a)
    "groups8": {"env:HDLA_VISION_STATE_GROUPS": "8"},  # F2's and B1's two-level scan on 8 groups of chunks
    "b1_bv16": {"b1:BV": 16},  # B1 on 16 V columns per program (twice the programs of K = 128's 32)
    "b1_bv64": {"b1:BV": 64},
    # F2 on 32 / 64 / 128 state columns per program (fwd.f2_block_v: 16 at the LM and high-res shapes): fewer
    # programs, each re-reading N [K, K] per chunk for fewer columns
    "f2_bv32": {"f2:BV": 32}, "f2_bv64": {"f2:BV": 64}, "f2_bv128": {"f2:BV": 128},
    # HDLA's token recurrence as routed before 2026-11-28 (kernels.utils): training up to 1024 tokens, any batch
    "recurrence_train_1024": {"utils:RECURRENT_TRAIN_MAX_TOKENS": 1024},
    "recurrence_any_batch": {"utils:RECURRENT_MIN_SEQUENCES": 1},
    # F1ab's registers capped (ptxas .maxnreg; fwd.launch_register_cap): 128 at 8 warps allows two blocks per SM, 168 at
    # 4 warps three, at the cost of spills
    "f1ab_reg128": {"maxnreg:F1ab": 128}, "f1ab_reg168_w4": {"maxnreg:F1ab": 168, "fwd:F1ab": 4},
}


def old_slices(batch: int, bytes_per_batch: int, programs_per_element: int = 0, resident_programs: int = 0):
    """``bwd.scratch_batch_slices`` before 0c1e469: ceil(batch * bytes / budget) even slices, which could each
    exceed the budget and be sliced again by the slice's own backward (the A/B's "before")."""
    budget = bwd.scratch_budget_bytes()
    parts = 1 if budget == 0 else max(1, min(batch, triton.cdiv(batch * bytes_per_batch, budget)))
    return bwd.slices_keeping_waves(batch, parts, programs_per_element, resident_programs)


@contextmanager
def launch_settings(overrides: dict):
    """The launch tables with ``overrides`` applied (module attributes patched, restored on exit)."""
    real = (fwd.launch_warps, bwd.b1_config, bwd_chunk.b2_config, fwd.f2_block_v, fwd.launch_register_cap)

    def launch_warps(stage, *args):
        return overrides.get(f"fwd:{stage}") or real[0](stage, *args)

    def b1_config(*args):
        return {**real[1](*args), **{k[3:]: v for k, v in overrides.items() if k.startswith("b1:")}}

    def b2_config(*args, **kwargs):
        return {**real[2](*args, **kwargs), **{k[3:]: v for k, v in overrides.items() if k.startswith("b2:")}}

    env = {k[4:]: v for k, v in overrides.items() if k.startswith("env:")}
    saved = {name: os.environ.get(name) for name in env}
    routing = {k[6:]: v for k, v in overrides.items() if k.startswith("utils:")}
    saved_routing = {name: getattr(utils, name) for name in routing}
    for name, value in routing.items():
        setattr(utils, name, value)
    slices = bwd.scratch_batch_slices
    fwd.launch_warps, bwd.b1_config, bwd_chunk.b2_config = launch_warps, b1_config, b2_config
    caps = {k[8:]: v for k, v in overrides.items() if k.startswith("maxnreg:")}
    if caps:
        fwd.launch_register_cap = lambda stage: {"maxnreg": caps[stage]} if stage in caps else {}
    if "f2:BV" in overrides:
        fwd.f2_block_v = lambda heads_total, dv, bk: min(overrides["f2:BV"], max(16, triton.next_power_of_2(dv)))
    if overrides.get("slices:old"):
        bwd.scratch_batch_slices = old_slices
    os.environ.update(env)
    try:
        yield
    finally:
        fwd.launch_warps, bwd.b1_config, bwd_chunk.b2_config, fwd.f2_block_v, fwd.launch_register_cap = real
        for name, value in saved_routing.items():
            setattr(utils, name, value)
        bwd.scratch_batch_slices = slices
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def make_case(shape, kind="hdla", seed=0, device="cuda", gates="mild"):
    """Inputs (bf16; mild gates, or ``every8``: -20 on every eighth channel, whose diagonal blocks take the
    levels) and a closure running the op's fwd+bwd, returning (y, *input grads)."""
    batch, seq_len, heads, d, bidir = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    dirs = (2,) if bidir else ()
    r_ab, scalar = KINDS[kind]
    q = rand(batch, seq_len, heads, d).bfloat16().requires_grad_()
    dy = rand(batch, seq_len, heads, d).bfloat16()
    g_shape = (*dirs, batch, seq_len, heads) + (() if scalar else (d,))
    g = -0.5 * rand(*g_shape).abs()
    if gates == "every8" and not scalar:
        g[..., ::8] = -20.0
    g.requires_grad_()
    if kind == "hdla":
        k = F.normalize(rand(batch, seq_len, heads, d), dim=-1).bfloat16().requires_grad_()
        v = rand(batch, seq_len, heads, d).bfloat16().requires_grad_()
        beta = (2 * torch.sigmoid(rand(*dirs, batch, seq_len, heads))).requires_grad_()
        inputs = (q, k, v, beta, g)
        op = chunk_hdla_bidirectional if bidir else chunk_hdla
    else:  # the delta rule's a = beta k, b = k (KDA: b = alpha k is folded into the decay here; timing only)
        k = F.normalize(rand(batch, seq_len, heads, 1, d), dim=-1).bfloat16().requires_grad_()
        v = rand(batch, seq_len, heads, 1, d).bfloat16().requires_grad_()
        a = (rand(batch, seq_len, heads, r_ab, d) / d ** 0.5).bfloat16().requires_grad_()
        b = F.normalize(rand(batch, seq_len, heads, r_ab, d), dim=-1).bfloat16().requires_grad_()
        inputs = (q, k, v, a, b, g)
        op = chunk_generalized_bidirectional if bidir else chunk_generalized

    def step():
        for x in inputs:
            x.grad = None
        y = op(*inputs, scale=d ** -0.5)[0]
        y.backward(dy)
        return (y.detach(), *(x.grad for x in inputs if x.grad is not None))

    return step


def per_kernel(step, calls=3) -> dict:
    """``{kernel: [device µs per call of step, launches per call]}`` (kernel_stages_bwd's profile), largest
    first, without the op-level rows (aten and custom ops, autograd nodes) that contain the kernels."""
    ops = ("aten::", "hdla_vision::", "Generated", "autograd")
    return {name: row for name, row in profile_launches(step, calls).items() if not name.startswith(ops)}


@contextmanager
def recorded_slices(record: list):
    """Appends the batch slices each backward call of B2 takes (``bwd.scratch_batch_slices``) to ``record``."""
    real = bwd.scratch_batch_slices

    def slices(*args, **kwargs):
        parts = real(*args, **kwargs)
        record.append([p.stop - p.start for p in parts])
        return parts

    bwd.scratch_batch_slices = slices
    try:
        yield
    finally:
        bwd.scratch_batch_slices = real


def run(shape_names, variant_names, rep_ms=200, save=lambda rows: None, gates="mild") -> list:
    """Every variant at every shape (``<shape>`` or ``<shape>:<kind>``), the defaults first; ``save(rows)``
    after each row (a time limit keeps what ran)."""
    rows = []
    for name in shape_names:
        shape, kind = (name.split(":") + ["hdla"])[:2]
        step = make_case(SHAPES[shape], kind, gates=gates)
        base = None
        for variant in variant_names:
            with launch_settings(VARIANTS[variant]):
                slices = []
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                try:
                    with recorded_slices(slices):
                        out = step()
                    torch.cuda.synchronize()
                except Exception as error:  # a setting that cannot compile or launch: recorded, not fatal
                    rows.append(dict(shape=name, variant=variant, error=f"{type(error).__name__}: {error}"[:300]))
                    print(rows[-1], flush=True)
                    continue
                row = dict(shape=name, variant=variant, gates=gates, overrides=VARIANTS[variant], b2_slices=slices,
                           peak_mib=round(torch.cuda.max_memory_allocated() / 2**20))
                row["finite"] = all(torch.isfinite(t).all().item() for t in out)
                if base is None:
                    base = out
                row["max_rel_vs_base"] = max(rel(o, b) for o, b in zip(out, base))
                row["fwd_bwd_ms"] = triton.testing.do_bench(step, warmup=50, rep=rep_ms, return_mode="median")
                row["kernels_us"] = per_kernel(step)
            rows.append(row)
            save(rows)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels_us"}), flush=True)
            print("   ", json.dumps(dict(list(row["kernels_us"].items())[:10])), flush=True)
    return rows


def allocator_counts() -> dict:
    """The caching allocator's cudaMalloc / cudaFree calls and retries so far (each may synchronise the host
    with the device: an eager step that meets them stops overlapping its launches with the GPU's work)."""
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def models_ab(models, resolutions, variants, rounds, compile_mode, rep_ms, save) -> list:
    """Training steps of whole models (``benchmarks.models.measure``, bf16 autocast, its batch sizes) under each
    variant in turn, ``rounds`` times (A B A B: the host's drift between machines and over minutes is larger
    than the change, so only cells of one process compare)."""
    from benchmarks.models import BATCH_SIZES, measure

    rows = []
    for res in resolutions:
        for name in models:
            for round_ in range(rounds):
                for variant in variants:
                    before = allocator_counts()
                    with launch_settings(VARIANTS[variant]):
                        row = measure(name, "train", res, BATCH_SIZES[res], torch.device("cuda"), 100, rep_ms,
                                      compile_mode)
                    after = allocator_counts()
                    rows.append(dict(row, variant=variant, round=round_,
                                     allocator={k: after[k] - before[k] for k in after}))
                    save(rows)
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def summary_lines(path: str, kernels=()) -> list:
    """One line per row of a JSON this benchmark wrote (``--out``): a model step (``--models-ab``: variant, round,
    resolution, ms, images/s, peak MiB) or an op's fwd+bwd (shape, variant, ms, ``max_rel_vs_base``, peak MiB, the sum
    of its kernels and the µs of each of ``kernels`` present); a row that failed as its error. A missing file: one
    line saying so."""
    if not os.path.exists(path):
        return [f"missing {path}"]
    lines = []
    for r in json.load(open(path))["rows"]:
        if "error" in r:
            lines.append(str(r))
        elif "step_ms" in r:
            lines.append(f"{r['variant']} {r['round']} {r['resolution']} {r['step_ms']:.2f} ms "
                         f"{r['images_per_s']:.1f} img/s {r['peak_mem_mib']:.0f} MiB")
        else:
            per_kernel = r["kernels_us"]
            picked = {name: round(per_kernel[name][0], 1) for name in kernels if name in per_kernel}
            lines.append(f"{r['shape']} {r['variant']} {r['fwd_bwd_ms']:.3f} ms rel {r['max_rel_vs_base']:.1e} "
                         f"{r['peak_mib']} MiB kernel sum {sum(v[0] for v in per_kernel.values()):.1f} us {picked}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["b1024"], choices=[f"{s}:{k}" if k != "hdla" else s
                                                                           for s in SHAPES for k in KINDS],
                        help="<shape> (HDLA) or <shape>:<kind>, kind one of " + ", ".join(KINDS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--gates", default="mild", choices=("mild", "every8"))
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "launch_configs.json"))
    parser.add_argument("--list", action="store_true", help="print the variants and exit")
    parser.add_argument("--models-ab", nargs="+", default=None, metavar="MODEL",
                        help="time these models' training steps under each variant instead (benchmarks.models)")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024, 2048], help="with --models-ab")
    parser.add_argument("--rounds", type=int, default=2, help="with --models-ab: A B rounds")
    parser.add_argument("--compile", default="eager", help="with --models-ab: benchmarks.models' compile mode")
    parser.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                        help="print a line per row of these result JSONs (no GPU needed) and exit")
    parser.add_argument("--summary-kernels", default="",
                        help="with --summarize: comma list of kernels whose µs each line shows")
    args = parser.parse_args(argv)
    if args.list:
        for name, overrides in VARIANTS.items():
            print(name, overrides)
        return
    if args.summarize:
        kernels = [k for k in args.summary_kernels.split(",") if k]
        for path in args.summarize:
            print("\n".join(summary_lines(path, kernels)))
        return
    variants = ["base"] + [v for v in args.variants if v != "base"]
    head = provenance(torch.cuda.get_device_name())

    def save(rows):
        with open(args.out, "w") as f:
            json.dump(dict(head, rows=rows), f, indent=1)

    if args.models_ab:
        models_ab(args.models_ab, args.resolutions, args.variants, args.rounds, args.compile, args.rep_ms, save)
        return
    run(args.shapes, variants, args.rep_ms, save, args.gates)


if __name__ == "__main__":
    main()
