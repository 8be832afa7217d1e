"""Results table and plot of the MQAR runs of ``python -m benchmarks.mqar`` (their ``run.json`` files).

Per (preset, filler, length): each run's score is its best test accuracy over its epochs (with the
early stop above 99% the last epoch is the best one for a solved run); the seeds' mean is taken
at each learning rate and the best learning rate is reported, with each seed's score beside it.
Runs not finished (paused by a time limit) are counted and flagged, never silently mixed in.

    python -m benchmarks.mqar_report .mqar [more folders or run.json files] --out-dir DIR

writes ``DIR/mqar_results.md`` (the table and the protocol), ``DIR/mqar_accuracy.png`` (best
accuracy against length per preset: the seed mean as a line, each seed as a point) and
``DIR/mqar_runs.json`` (every run with its learning curve).
"""
import argparse
import json
from pathlib import Path


def load_runs(paths) -> list:
    """Every run.json under the given folders (recursively), or the given files; the runs of a
    merged ``mqar_runs.json`` too. A run id seen twice keeps the record with more epochs."""
    records = {}
    for path in map(Path, paths):
        files = sorted(path.rglob("run.json")) if path.is_dir() else [path]
        for file in files:
            data = json.loads(file.read_text())
            for record in data["runs"] if "runs" in data else [data]:
                old = records.get(record["run_id"])
                if old is None or record["epochs_run"] > old["epochs_run"]:
                    records[record["run_id"]] = record
    return sorted(records.values(), key=lambda r: r["run_id"])


def group_key(record: dict):
    p = record["protocol"]
    return p["preset"], p["filler"], p["length"]


def summarize(records: list) -> dict:
    """``{(preset, filler, length): row}`` with the best learning rate by seed-mean accuracy."""
    by_lr = {}
    for r in records:
        by_lr.setdefault(group_key(r), {}).setdefault(r["protocol"]["lr"], []).append(r)
    rows = {}
    for key, lrs in by_lr.items():
        lr, runs = max(lrs.items(), key=lambda item: sum(x["best_accuracy"] or 0 for x in item[1]) / len(item[1]))
        runs = sorted(runs, key=lambda x: x["protocol"]["seed"])
        every = [x for rs in lrs.values() for x in rs]
        rows[key] = dict(
            preset=key[0], filler=key[1], length=key[2], num_kv_pairs=runs[0]["protocol"]["num_kv_pairs"], lr=lr,
            mean=sum(x["best_accuracy"] or 0 for x in runs) / len(runs),
            seeds={x["protocol"]["seed"]: x["best_accuracy"] or 0 for x in runs},
            epochs=[x["epochs_run"] for x in runs], stop=[x["stop_reason"] or x["status"] for x in runs],
            lrs_tried=sorted(lrs), runs=len(every), unfinished=sum(x["status"] != "done" for x in every),
            params=runs[0]["params"], batch_size=runs[0]["protocol"]["batch_size"],
            ms_per_step=runs[0]["ms_per_step"], device=runs[0]["protocol"]["device"])
    return rows


def markdown_table(rows: dict) -> str:
    lines = ["| preset | filler | L | kv pairs | best acc. (seed mean) | per seed | best lr | lrs tried | epochs run "
             "(stop) | runs (unfinished) | params | batch | ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(rows, key=lambda k: (k[2], k[1], k[0])):
        r = rows[key]
        seeds = ", ".join(f"s{s}: {100 * a:.2f}%" for s, a in r["seeds"].items())
        stops = ", ".join(f"{e} ({s})" for e, s in zip(r["epochs"], r["stop"]))
        lrs = ", ".join(f"{x:.2g}" for x in r["lrs_tried"])
        lines.append(f"| {r['preset']} | {r['filler']} | {r['length']} | {r['num_kv_pairs']} | {100 * r['mean']:.2f}% "
                     f"| {seeds} | {r['lr']:.2g} | {lrs} | {stops} | {r['runs']} ({r['unfinished']}) "
                     f"| {r['params'] / 1e6:.3f}M | {r['batch_size']} | {r['ms_per_step']} |")
    return "\n".join(lines)


def protocol_lines(records: list) -> str:
    """The protocol fields shared by every run, and those that vary, for the report's header."""
    fields = {}
    for r in records:
        for k, v in r["protocol"].items():
            if k not in ("model_config", "params", "lr", "seed", "length", "num_kv_pairs", "batch_size", "preset"):
                fields.setdefault(k, set()).add(json.dumps(v))
    return "\n".join(f"- {k}: {', '.join(sorted(v))}" for k, v in sorted(fields.items()))


def model_lines(records: list) -> str:
    """One line per preset: its parameter count and model settings."""
    models = {r["protocol"]["preset"]: (r["params"], r["protocol"]["model_config"]) for r in records}
    return "\n".join(f"- {preset}: {params / 1e6:.4f}M parameters, {json.dumps(config)}"
                     for preset, (params, config) in sorted(models.items()))


def plot(rows: dict, path: Path) -> bool:
    """Best accuracy against length, one line per (preset, filler) (seed mean) with each seed's
    point; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for preset, filler in sorted({(k[0], k[1]) for k in rows}):
        points = sorted((k[2], r) for k, r in rows.items() if k[:2] == (preset, filler))
        label = preset if filler == "zero" else f"{preset} ({filler} filler)"
        line, = ax.plot([n for n, _ in points], [100 * r["mean"] for _, r in points], marker="o", label=label)
        for n, r in points:
            ax.scatter([n] * len(r["seeds"]), [100 * a for a in r["seeds"].values()], color=line.get_color(),
                       marker="x", s=18, alpha=0.7)
    lengths = sorted({k[2] for k in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set(xlabel="sequence length", ylabel="MQAR test accuracy (%)", ylim=(0, 101))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return True


def write_report(records: list, out_dir: Path) -> dict:
    """The three output files; returns the table rows."""
    if not records:
        raise ValueError("no run.json found in the given paths")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(records)
    text = (f"MQAR, {len(records)} runs: best test accuracy over epochs per run, mean over seeds at the best "
            f"learning rate (per-seed values beside it).\n\nProtocol:\n{protocol_lines(records)}\n\n"
            f"Models:\n{model_lines(records)}\n\n"
            f"{markdown_table(rows)}\n")
    (out_dir / "mqar_results.md").write_text(text)
    (out_dir / "mqar_runs.json").write_text(json.dumps(dict(runs=records), indent=1))
    if not plot(rows, out_dir / "mqar_accuracy.png"):
        print("matplotlib is not installed: no plot")
    print(markdown_table(rows))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="folders holding run.json files (searched recursively), or files")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    return write_report(load_runs(args.paths), Path(args.out_dir))
