"""MQAR's training step on a GPU, eager against one CUDA graph (``hdla_vision.lm.mqar_step``).

    python -m benchmarks.mqar_step                                  # zoology models, L = 256..2048, JSON to $OUT
    python -m benchmarks.mqar_step --mixers hdla --lengths 256 --steps 50

For each model of ``--preset`` (built as ``benchmarks.mqar`` builds it, SwiGLU balanced to 1.65M
parameters) and each length (its Zoology batch size and key-value pairs): the same ``--steps`` training
steps from the same initialisation and batches (token-0 filler, embedding dropout off so that both modes
compute the same function), eager and graphed, each on a fresh model and optimizer. Recorded per cell:
ms/step (synchronised wall time over the steps after ``--warmup``, the graph's capture among the warm-up),
peak memory, the loss of every step in both modes and their largest relative difference (bf16 autocast:
the two differ by rounding only), and the GPU kernel time of one eager step from the profiler, which
says how much of the eager step the host's launches take (``--top N``: its N slowest kernels);
``--compile-step``: also the graphed step with the loss through ``torch.compile`` (the runner's ``--compile``).
"""
import argparse
import json
import os
import time

import torch

from hdla_vision.lm.mqar import multiquery_ar
from hdla_vision.lm.mqar_runner import (build_model, model_config, parse_args, planned_protocols, query_logits,
                                        set_chunk_backend)
from hdla_vision.lm.mqar_step import cross_entropy_loss, make_optimizer, make_step
from benchmarks.timing import device_us, profile_steps
from tools.provenance import provenance


def batches(proto: dict, steps: int, device: str):
    """``steps`` fixed batches of the run's shape (Zoology's generator, token-0 filler)."""
    out = []
    for i in range(steps):
        x, y = multiquery_ar(proto["vocab_size"], proto["batch_size"], proto["length"], proto["num_kv_pairs"],
                             seed=10_000 + i, random_non_queries=False)
        out.append((x.to(device), y.to(device)))
    return out


def train_steps(args, proto: dict, data, warmup: int, graphed: bool, compile: bool = False) -> dict:
    """Losses and timing of ``len(data)`` steps from a fresh model (seed 0) in one mode."""
    config = model_config(args, proto["mixer"], proto["model_config"].get("intermediate_size"))
    model = build_model(config, 0, "cuda").train()
    opt = make_optimizer(model, proto["lr"], proto["weight_decay"], graphed)
    step = make_step(cross_entropy_loss(query_logits, model, 0.0, proto["num_kv_pairs"], compile), opt, "cuda", graphed)
    torch.cuda.reset_peak_memory_stats()
    losses, start = [], None
    for i, (x, y) in enumerate(data):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        losses.append(step(x, y).clone())
    torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - start) / (len(data) - warmup)
    return dict(ms_per_step=round(ms, 3), losses=[float(v) for v in losses], mode=step.mode,
                capture_failed=step.failed,
                peak_mib=round(torch.cuda.max_memory_allocated() / 2 ** 20, 1), model=model, step=step, data=data)


def kernel_profile(run: dict, top: int) -> dict:
    """GPU kernel time (ms) of one eager step (after one more as warm-up) from the profiler's CUDA events, and its
    ``top`` kernels by time (name, calls, ms)."""
    x, y = run["data"][0]
    prof = profile_steps(lambda: run["step"](x, y), 1)
    events = sorted((e for e in prof.key_averages() if device_us(e) > 0), key=device_us, reverse=True)
    return dict(kernel_ms=round(sum(map(device_us, events)) / 1000, 3),
                top=[dict(name=e.key[:120], calls=e.count, ms=round(device_us(e) / 1000, 3)) for e in events[:top]])


def max_rel_diff(losses, reference) -> float:
    """The largest relative difference between two runs' losses, step by step."""
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))


def cell(args, proto: dict, steps: int, warmup: int, top: int, compile: bool) -> dict:
    data = batches(proto, steps, "cuda")
    eager = train_steps(args, proto, data, warmup, graphed=False)
    graph = train_steps(args, proto, data, warmup, graphed=True)
    compiled = train_steps(args, proto, data, warmup, graphed=True, compile=True) if compile else None
    diff = max_rel_diff(graph["losses"], eager["losses"])
    row = dict(mixer=proto["mixer"], length=proto["length"], batch_size=proto["batch_size"],
               num_kv_pairs=proto["num_kv_pairs"], params=proto["params"],
               eager_ms=eager["ms_per_step"], graph_ms=graph["ms_per_step"],
               speedup=round(eager["ms_per_step"] / graph["ms_per_step"], 2), graph_mode=graph["mode"],
               capture_failed=graph["capture_failed"], eager_peak_mib=eager["peak_mib"], graph_peak_mib=graph["peak_mib"],
               loss_max_rel_diff=diff, eager_losses=eager["losses"], graph_losses=graph["losses"],
               **{f"eager_{k}": v for k, v in kernel_profile(eager, top).items()})
    if compiled is not None:
        row.update(compiled_graph_ms=compiled["ms_per_step"], compiled_mode=compiled["mode"],
                   compiled_peak_mib=compiled["peak_mib"], compiled_losses=compiled["losses"],
                   compiled_loss_max_rel_diff=max_rel_diff(compiled["losses"], eager["losses"]))
        print(f"{'':>22} compiled + graph {row['compiled_graph_ms']:8.2f} ms  ({row['compiled_mode']}, "
              f"loss diff {row['compiled_loss_max_rel_diff']:.1e})", flush=True)
    print(f"{row['mixer']:>22} L={row['length']:<5} eager {row['eager_ms']:8.2f} ms (kernels {row['eager_kernel_ms']:.2f})"
          f"  graph {row['graph_ms']:8.2f} ms  x{row['speedup']:.2f}  loss diff {diff:.1e}"
          f"{'  CAPTURE FAILED' if row['capture_failed'] else ''}", flush=True)
    for kernel in row["eager_top"]:
        print(f"      {kernel['ms']:8.3f} ms {kernel['calls']:4d}x  {kernel['name']}", flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--top", type=int, default=0, help="also list the eager step's TOP kernels by GPU time")
    p.add_argument("--compile-step", action="store_true",
                   help="also the graphed step with the loss through torch.compile (the runner's --compile)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mqar_step.json"))
    args, rest = p.parse_known_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    mqar = parse_args(rest + ["--seeds", "0", "--lrs", "1e-3"])
    mqar.device = "cuda"
    set_chunk_backend(mqar.chunk_backend)
    rows = [cell(mqar, proto, args.steps, args.warmup, args.top, args.compile_step) for proto in planned_protocols(mqar)]
    result = dict(**provenance(torch.cuda.get_device_name()), benchmark="mqar_step", steps=args.steps,
                  warmup=args.warmup, torch=torch.__version__, rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
