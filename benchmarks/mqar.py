"""MQAR recall benchmark (HDLA paper §4 / fig. 2, appendix D): HDLA vs Gated DeltaNet vs Gated DeltaProduct.

Protocol (HDLA paper appendix D, Zoology defaults where the paper is silent):
  * two-layer models of about 1.65M parameters: vocab 8192, d_model 128, 2 heads of dim 64,
    SwiGLU 512, tied embeddings, short conv 4 on q/k/v (Zoology pairs every mixer with a short conv);
  * learning-rate sweep per length: logspace(-4, -2, 4) at 256, logspace(-5, -3, 4) at 512,
    [1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2] at 1024 and 2048; the best accuracy over the sweep
    is reported (mean over seeds at each learning rate, then the best learning rate);
  * accuracy = fraction of queries whose argmax prediction is the right value, on a fixed test set;
  * the number of key-value pairs and the batch size are not given in the paper: Zoology's MQAR
    configurations pair L = 256 with 16 pairs and L = 1024 with 64 (default L / 16, ``--kv-divisor``)
    and shrink the batch as L grows (64 at 256, 32 at 512, 16 at 1024): default 16384 tokens per
    batch (``--batch-size`` overrides, one value or one per length).
Optimisation follows Zoology's trainer: AdamW with torch defaults (weight decay 0.01), cosine
decay to 0, no warm-up, no clipping (flags change these); training batches are drawn fresh every
step (seeded) instead of Zoology's fixed training set; bf16 autocast on CUDA. Results go to ``$OUT/mqar`` when ``OUT`` is set, else
``benchmarks/results``: ``mqar_runs.json`` (every run), ``mqar_results.md`` (table), ``mqar_accuracy.png``.

One run (H200, ~22 ms a step; 4000 steps stay on MQAR's plateau, 13000 solved L=256 for one mixer):
    python benchmarks/mqar.py --mixers hdla --lengths 256 --lrs 2.2e-3 --steps 13000
The sweep, one line per run, spread over GPUs (results: benchmarks/results/README.md):
    bash benchmarks/runs/mqar_queue.sh benchmarks/runs/mqar_queue_2.txt /tmp/mqar 3000 0 0 1 1
CPU smoke run:
    python benchmarks/mqar.py --tiny
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hdla_vision.lm import HDLAConfig, HDLAForCausalLM
from hdla_vision.lm import mixers as lm_mixers
from hdla_vision.lm.mqar import check_mqar_args, multiquery_ar

MIXER_SETTINGS = {
    "hdla": dict(mixer="hdla", mixer_kwargs={}),
    "gated_deltanet": dict(mixer="gated_deltanet", mixer_kwargs={}),
    "gated_deltaproduct_2": dict(mixer="gated_deltaproduct", mixer_kwargs={"num_householder": 2}),
}


def paper_lr_sweep(length: int):
    """HDLA paper appendix D; lengths it does not list use the 256 sweep."""
    if length >= 1024:
        return [1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2]
    if length == 512:
        return np.logspace(-5, -3, 4).tolist()
    return np.logspace(-4, -2, 4).tolist()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--mixers", nargs="+", default=list(MIXER_SETTINGS), choices=list(MIXER_SETTINGS))
    p.add_argument("--kv-divisor", type=int, default=16, help="num_kv_pairs = length // kv-divisor")
    p.add_argument("--num-kv-pairs", type=int, nargs="+", default=None, help="one per length (overrides divisor)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--short-conv-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3000, help="training steps per run")
    p.add_argument("--batch-size", type=int, nargs="+", default=None,
                   help="one value, or one per length (default: --batch-tokens // length)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per training batch without --batch-size")
    p.add_argument("--test-examples", type=int, default=1000)
    p.add_argument("--eval-batch-size", type=int, default=125)
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="one sweep for all lengths (default: paper's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--warmup-frac", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=0.0, help="max grad norm (0: off)")
    p.add_argument("--run-time-limit", type=float, default=None,
                   help="seconds of training per run; the step count is cut to fit (timed on the first steps)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="minutes for everything: each run gets an equal share of what is left (its steps are cut to "
                        "fit), and runs are skipped once it is spent")
    p.add_argument("--log-every", type=int, default=0, help="print the training loss every N steps (0: off)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cpu-threads", type=int, default=2,
                   help="torch CPU threads (batches are drawn on the CPU; more threads only contend when several "
                        "runs share a machine)")
    p.add_argument("--chunk-backend", default="auto", choices=lm_mixers.CHUNK_BACKENDS,
                   help="'torch': vectorised PyTorch chunk form also on CUDA (no Triton backward needed)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tiny", action="store_true", help="CPU smoke settings (overrides sizes, steps, sweep)")
    p.add_argument("--merge-from", nargs="+", default=None, metavar="DIR",
                   help="no training: merge the mqar_runs.json of earlier runs (e.g. one GPU command per length) "
                        "into one table and plot in --out-dir")
    args = p.parse_args(argv)
    if args.tiny:
        args.lengths, args.vocab_size, args.d_model, args.num_heads, args.head_dim = [16, 32], 64, 16, 2, 8
        args.intermediate_size, args.steps, args.batch_size, args.test_examples = 32, 3, [8], 16
        args.eval_batch_size, args.lrs, args.kv_divisor = 8, [1e-3, 1e-2], 4
    if args.batch_size is not None and len(args.batch_size) == 1:
        args.batch_size = args.batch_size * len(args.lengths)
    for name in ("num_kv_pairs", "batch_size"):
        given = getattr(args, name)
        if given is not None and len(given) != len(args.lengths):
            raise ValueError(f"--{name.replace('_', '-')} needs one value per length ({len(args.lengths)}), got {given}")
    order = sorted(range(len(args.lengths)), key=args.lengths.__getitem__)  # per-length lists follow the sort
    for name in ("lengths", "num_kv_pairs", "batch_size"):
        if getattr(args, name) is not None:
            setattr(args, name, [getattr(args, name)[i] for i in order])
    if args.out_dir is None:
        args.out_dir = os.path.join(os.environ["OUT"], "mqar") if os.environ.get("OUT") else "benchmarks/results"
    return args


def kv_pairs_for(args, length: int) -> int:
    if args.num_kv_pairs is not None:
        return args.num_kv_pairs[args.lengths.index(length)]
    return max(1, length // args.kv_divisor)


def batch_size_for(args, length: int) -> int:
    if args.batch_size is None:
        return max(1, args.batch_tokens // length)
    return args.batch_size[args.lengths.index(length)]


def build_model(args, mixer_name: str, seed: int) -> HDLAForCausalLM:
    torch.manual_seed(seed)
    config = HDLAConfig(
        vocab_size=args.vocab_size, hidden_size=args.d_model, num_hidden_layers=2, num_heads=args.num_heads,
        head_dim=args.head_dim, intermediate_size=args.intermediate_size, short_conv_size=args.short_conv_size,
        tie_word_embeddings=True, use_cache=False, **MIXER_SETTINGS[mixer_name],
    )
    return HDLAForCausalLM(config).to(args.device)


def query_logits(model: HDLAForCausalLM, inputs: torch.Tensor, labels: torch.Tensor):
    """Logits only at the query positions (the LM head over every position would dominate memory)."""
    hidden = model.model(input_ids=inputs).last_hidden_state
    asked = labels != -100
    return model.lm_head(hidden[asked]).float(), labels[asked]


def lr_at(step: int, total: int, peak: float, warmup_frac: float) -> float:
    warmup = int(warmup_frac * total)
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def autocast(args):
    enabled = args.device.startswith("cuda")
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=enabled) if enabled else torch.autocast("cpu", enabled=False)


TIMING_STEPS = 5


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def train_and_eval(args, mixer_name, length, num_kv, lr, seed, test_set, time_limit=None):
    """Train one model; with a time limit, the step count (and the lr schedule) shrinks to fit it,
    measured on the first few steps. The loss is read back only when logged, so the next batch
    is drawn on the CPU while the GPU still works on this one."""
    model = build_model(args, mixer_name, seed)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    batch_size = batch_size_for(args, length)
    start, loss, total = time.time(), None, args.steps
    model.train()
    step = 0
    while step < total:
        if step == 1:
            synchronize(args.device)
            after_first = time.time()  # the first step pays for compilation; time the next ones
        if step == 1 + TIMING_STEPS and time_limit is not None:
            synchronize(args.device)
            per_step = (time.time() - after_first) / TIMING_STEPS
            budget_left = time_limit - (time.time() - start)
            total = max(step + 1, min(args.steps, step + int(budget_left / per_step)))
        inputs, labels = multiquery_ar(args.vocab_size, batch_size, length, num_kv,
                                       seed=1_000_003 * (seed + 1) + step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, lr, args.warmup_frac)
        with autocast(args):
            logits, targets = query_logits(model, inputs.to(args.device, non_blocking=True),
                                           labels.to(args.device, non_blocking=True))
        loss = F.cross_entropy(logits, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        opt.step()
        step += 1
        if args.log_every and step % args.log_every == 0:
            print(f"    step {step}/{total} loss {loss.item():.3f}", flush=True)
    synchronize(args.device)
    train_s = time.time() - start
    accuracy = evaluate(args, model, test_set)
    return dict(mixer=mixer_name, length=length, num_kv_pairs=num_kv, lr=lr, seed=seed, steps=step,
                batch_size=batch_size, device=args.device,
                final_train_loss=float("nan") if loss is None else loss.item(), accuracy=accuracy, params=params,
                train_seconds=round(train_s, 1), ms_per_step=round(1000 * train_s / max(step, 1), 2))


@torch.no_grad()
def evaluate(args, model, test_set) -> float:
    model.eval()
    inputs, labels = test_set
    correct = total = 0
    for i in range(0, len(inputs), args.eval_batch_size):
        with autocast(args):
            logits, targets = query_logits(model, inputs[i:i + args.eval_batch_size].to(args.device),
                                           labels[i:i + args.eval_batch_size].to(args.device))
        correct += (logits.argmax(-1) == targets).sum().item()
        total += targets.numel()
    return correct / total


def plan(args):
    runs = []
    for length in args.lengths:
        sweep = args.lrs if args.lrs is not None else paper_lr_sweep(length)
        for mixer_name in args.mixers:
            for lr in sweep:
                for seed in args.seeds:
                    runs.append((mixer_name, length, kv_pairs_for(args, length), lr, seed))
    return runs


def summarize(records):
    """Best (over learning rates) seed-mean accuracy per (mixer, length, number of kv pairs)."""
    groups = {}
    for r in records:
        groups.setdefault((r["mixer"], r["length"], r["num_kv_pairs"], r["lr"]), []).append(r)
    best = {}
    for (mixer, length, num_kv, lr), rs in groups.items():
        mean = sum(r["accuracy"] for r in rs) / len(rs)
        key = (mixer, length, num_kv)
        if key not in best or mean > best[key]["accuracy"]:
            best[key] = dict(mixer=mixer, length=length, accuracy=mean, lr=lr, seeds=[r["seed"] for r in rs],
                             num_kv_pairs=rs[0]["num_kv_pairs"], steps=min(r["steps"] for r in rs),
                             batch_size=rs[0].get("batch_size", "?"), ms_per_step=rs[0].get("ms_per_step", "?"),
                             params=rs[0]["params"], lrs_tried=sorted({
                                 x["lr"] for x in records if (x["mixer"], x["length"], x["num_kv_pairs"]) == key}))
    return best


def markdown_table(args, best) -> str:
    lines = [
        "| mixer | length | kv pairs | best acc. | best lr | lrs tried | steps | batch | ms/step | seeds | params |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (mixer, length, _), b in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        lrs = ", ".join(f"{x:.1e}" for x in b["lrs_tried"])
        lines.append(f"| {mixer} | {length} | {b['num_kv_pairs']} | {100 * b['accuracy']:.2f}% | {b['lr']:.1e} | {lrs} "
                     f"| {b['steps']} | {b['batch_size']} | {b['ms_per_step']} | {','.join(map(str, b['seeds']))} | {b['params'] / 1e6:.3f}M |")
    return "\n".join(lines)


def plot(best, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (rerun with --merge-from where it is)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    # one line per mixer and ratio length / kv pairs (constant within one run of this script)
    for mixer, ratio in sorted({(m, length // kv) for m, length, kv in best}):
        points = sorted((length, b["accuracy"]) for (m, length, kv), b in best.items()
                        if m == mixer and length // kv == ratio)
        ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", label=f"{mixer} (kv = L/{ratio})")
    ax.set_xscale("log", base=2)
    lengths = sorted({length for _, length, _ in best})
    ax.set_xticks(lengths, [str(x) for x in lengths])
    ax.minorticks_off()
    ax.set_xlabel("sequence length")
    ax.set_ylabel("MQAR accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write_report(args, out_dir: Path, records, skipped, note: str = ""):
    best = summarize(records)
    table = markdown_table(args, best)
    header = (f"MQAR accuracy, best over the learning-rate sweep ({len(records)} runs, "
              f"{len(skipped)} skipped by the time budget){note}.\n\n")
    (out_dir / "mqar_results.md").write_text(header + table + "\n")
    if best:
        plot(best, out_dir / "mqar_accuracy.png")
    print()
    print(table)
    if skipped:
        print(f"skipped (time budget): {len(skipped)} runs, e.g. {skipped[:3]}")
    print(f"wrote {out_dir}/mqar_runs.json, mqar_results.md, mqar_accuracy.png")
    return best


MODEL_ARGS = ("vocab_size", "d_model", "num_heads", "head_dim", "intermediate_size", "short_conv_size")


def merge(args, out_dir: Path):
    """Combine runs of one model setting (several commands, e.g. one per length) into one report."""
    records, skipped, sources, model_args = [], [], [], None
    for folder in args.merge_from:
        data = json.loads((Path(folder) / "mqar_runs.json").read_text())
        these = {k: data["args"].get(k) for k in MODEL_ARGS}
        if model_args is not None and these != model_args:
            raise ValueError(f"--merge-from: {folder} used another model setting {these} than {model_args}")
        model_args = these
        records += data["runs"]
        skipped += data["skipped"]
        sources.append(f"{folder}: {data['args'].get('device')} steps<={data['args']['steps']} "
                       f"batch={data['args']['batch_size'] or 'tokens/' + str(data['args'].get('batch_tokens'))}")
    print("merged:", *sources, sep="\n  ")
    (out_dir / "mqar_runs.json").write_text(json.dumps(dict(sources=sources, runs=records, skipped=skipped), indent=1))
    return write_report(args, out_dir, records, skipped, note=", merged from " + "; ".join(sources))


def main(argv=None):
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.merge_from:
        return merge(args, out_dir)
    lm_mixers.set_chunk_backend(args.chunk_backend)
    torch.set_num_threads(args.cpu_threads)
    for length in args.lengths:
        check_mqar_args(args.vocab_size, length, kv_pairs_for(args, length))
    runs = plan(args)
    print("MQAR benchmark:", " ".join(sys.argv[1:] if argv is None else argv))
    print(f"  device={args.device} chunk_backend={args.chunk_backend} torch={torch.__version__}")
    print(f"  model: 2 layers, d_model={args.d_model}, heads={args.num_heads}x{args.head_dim}, "
          f"mlp={args.intermediate_size}, short_conv={args.short_conv_size}, vocab={args.vocab_size}")
    batches = [batch_size_for(args, length) for length in args.lengths]
    print(f"  train: steps={args.steps} batch={batches} AdamW wd={args.weight_decay} "
          f"warmup={args.warmup_frac} cosine clip={args.clip_grad}; test examples={args.test_examples}; seeds={args.seeds}")
    print(f"  {len(runs)} runs: " + "; ".join(
        f"L={length} kv={kv_pairs_for(args, length)} lrs={[f'{x:.1e}' for x in (args.lrs or paper_lr_sweep(length))]}"
        for length in args.lengths))
    records, skipped, t0 = [], [], time.time()
    test_sets = {}
    for mixer_name, length, num_kv, lr, seed in runs:
        if args.time_budget is not None and time.time() - t0 > 60 * args.time_budget:
            skipped.append(dict(mixer=mixer_name, length=length, lr=lr, seed=seed))
            continue
        if length not in test_sets:
            test_sets[length] = multiquery_ar(args.vocab_size, args.test_examples, length, num_kv, seed=12345)
        limit = args.run_time_limit
        if args.time_budget is not None:  # share what is left of the budget among the runs still to do
            left = 60 * args.time_budget - (time.time() - t0)
            share = 0.9 * left / (len(runs) - len(records) - len(skipped))
            limit = share if limit is None else min(limit, share)
        rec = train_and_eval(args, mixer_name, length, num_kv, lr, seed, test_sets[length], limit)
        records.append(rec)
        print(f"  {mixer_name:>22s} L={length:<5d} kv={num_kv:<4d} lr={lr:.1e} seed={seed} steps={rec['steps']:<5d} "
              f"loss={rec['final_train_loss']:.3f} acc={100 * rec['accuracy']:6.2f}% ({rec['train_seconds']}s)",
              flush=True)
        (out_dir / "mqar_runs.json").write_text(json.dumps(dict(args=vars(args), runs=records, skipped=skipped), indent=1))
    (out_dir / "mqar_runs.json").write_text(json.dumps(dict(args=vars(args), runs=records, skipped=skipped), indent=1))
    return write_report(args, out_dir, records, skipped, note=f", device {args.device}")


if __name__ == "__main__":
    main()
