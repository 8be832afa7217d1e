"""Results tables and plot of the MQAR runs of ``python -m benchmarks.mqar`` (their ``run.json`` files).

Two tables:
  * the grid: every cell (length x model x learning rate x seed) of the planned sweep, with its
    best test accuracy, the epochs it ran and how it stopped; a cell that never ran says
    ``not run``, one cut by a time limit says ``unfinished``; a count of the cells not run follows.
    The plan is the default sweep of ``--preset zoology`` (lengths 256..2048, four models, Zoology's
    four learning rates, seeds 0 and 1: 128 cells), or the runs listed in ``--queue`` files
    (``python -m benchmarks.mqar --write-queue``); runs outside the plan get rows of their own;
  * the summary per (preset, filler, length, model): each run's score is its best test accuracy over
    its epochs (with the early stop above 99% the last epoch is the best one for a solved run); the
    seeds' mean is taken at each learning rate and the best learning rate is reported, with each
    seed's score beside it, the runs counted and the unfinished and missing ones named.

    python -m benchmarks.mqar_report .mqar [more folders or run.json files] --out-dir DIR [--queue FILE ...]

writes ``DIR/mqar_results.md`` (both tables and the protocol), ``DIR/mqar_accuracy.png`` (best
accuracy against length per model: the seed mean as a line, each seed as a point) and, unless
``--no-runs-json``, ``DIR/mqar_runs.json`` (every run with its learning curve).

The runs and plan of ``--preset loglinear_table2`` get that preset's report instead
(:func:`hdla_vision.lm.mqar_loglinear.write_table2`: the Log-Linear Attention paper's Table 2 layout,
the details per cell and every planned run; no plot), also before any run (every cell "not run").
"""
import argparse
import json
import shlex
from pathlib import Path

from hdla_vision.lm import mqar_loglinear, mqar_runner


def load_runs(paths) -> list:
    """Every run.json under the given folders (recursively, also ``<run id>.json`` files beside a
    ``runs`` folder's name), or the given files; the runs of a merged ``mqar_runs.json`` too. A run
    id seen twice keeps the finished record, else the one with more epochs."""
    records = {}
    for path in map(Path, paths):
        files = sorted(path.rglob("*.json")) if path.is_dir() else [path]
        for file in files:
            data = json.loads(file.read_text())
            for record in data["runs"] if "runs" in data else [data]:
                if "run_id" in record and "protocol" in record:
                    old = records.get(record["run_id"])
                    if old is None or rank(record) > rank(old):
                        records[record["run_id"]] = record
    return sorted(records.values(), key=lambda r: r["run_id"])


def rank(record: dict):
    return record["status"] == "done", record["epochs_run"]


# -- the planned cells --------------------------------------------------------------------------
def cell(preset, mixer, length, num_kv, lr, seed, filler, data, steps, d_model=None) -> dict:
    """The protocol fields that name one cell (enough for ``mqar_runner.run_id``)."""
    return dict(preset=preset, mixer=mixer, length=length, num_kv_pairs=num_kv, lr=lr, seed=seed, filler=filler,
                data=data, steps=steps, d_model=d_model)


def planned_cells(argv: list) -> list:
    """The cells that ``python -m benchmarks.mqar <argv>`` would run (no model is built)."""
    args = mqar_runner.parse_args(list(argv) + ["--state-dir", "unused"])
    return [cell(args.preset, mixer, length, mqar_runner.per_length(args, "kv_pairs", length), lr, seed, args.filler,
                 args.data, args.steps, d_model)
            for mixer, length, lr, seed, d_model in mqar_runner.plan(args)]


def queue_cells(paths) -> list:
    """The cells of queue files (lines '<run id> <arguments>')."""
    cells = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                cells += planned_cells(shlex.split(line)[1:])
    return cells


def expected_cells(queues=None, records=()) -> list:
    """The queues' cells; without queues, the default sweep of ``--preset loglinear_table2`` when
    every record is of that preset, else that of ``--preset zoology`` (lengths 256..2048, its four
    models, Zoology's four learning rates, seeds 0 and 1)."""
    if queues:
        return queue_cells(queues)
    if records and {r["protocol"]["preset"] for r in records} == {mqar_loglinear.PRESET}:
        return planned_cells(["--preset", mqar_loglinear.PRESET])
    return planned_cells(["--preset", "zoology"])


def record_cell(record: dict) -> dict:
    p = record["protocol"]
    return cell(p["preset"], p["mixer"], p["length"], p["num_kv_pairs"], p["lr"], p["seed"], p["filler"], p["data"],
                p.get("steps"), p.get("d_model"))


# -- tables -------------------------------------------------------------------------------------
def grid_table(records: list, cells: list) -> str:
    """One row per (preset, filler, length, model, lr), one column per seed: the planned cells, and
    the runs outside the plan in rows of their own (marked)."""
    by_id = {r["run_id"]: r for r in records}
    planned_ids = {mqar_runner.run_id(c) for c in cells}
    extra = [record_cell(r) for r in records if r["run_id"] not in planned_ids]
    rows, planned_rows = {}, set()
    for c, planned in [(c, True) for c in cells] + [(c, False) for c in extra]:
        key = (c["preset"], c["filler"], c["length"], c["num_kv_pairs"], c["mixer"], c["lr"])
        rows.setdefault(key, {})[c["seed"]] = by_id.get(mqar_runner.run_id(c))
        if planned:
            planned_rows.add(key)
    seeds = sorted({c["seed"] for c in cells + extra})
    lines = ["| preset | filler | L | kv pairs | model | lr | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(seeds)]
    for key in sorted(rows, key=lambda k: (k[0], k[1], k[2], k[4], k[5])):
        texts = [mqar_loglinear.run_text(rows[key][s]) if s in rows[key] else "-" for s in seeds]
        marker = "" if key in planned_rows else " (outside the plan)"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]}{marker} | {key[5]:.3g} | "
                     + " | ".join(texts) + " |")
    return "\n".join(lines)


def missing_summary(records: list, cells: list) -> str:
    """How many planned cells were not run and which (counted per preset, filler, length, model)."""
    done = {r["run_id"] for r in records}
    unfinished = {r["run_id"] for r in records if r["status"] != "done"}
    missing, cut = {}, {}
    for c in cells:
        key = (c["preset"], c["filler"], c["length"], c["mixer"])
        rid = mqar_runner.run_id(c)
        if rid not in done:
            missing.setdefault(key, []).append(f"lr {c['lr']:.3g} s{c['seed']}")
        elif rid in unfinished:
            cut.setdefault(key, []).append(f"lr {c['lr']:.3g} s{c['seed']}")
    total_missing = sum(map(len, missing.values()))
    lines = [f"Planned cells: {len(cells)}; finished: {len(cells) - total_missing - sum(map(len, cut.values()))}; "
             f"unfinished: {sum(map(len, cut.values()))}; not run: {total_missing}."]
    for title, table in (("Not run", missing), ("Unfinished (cut by a time limit, to be resumed)", cut)):
        for key in sorted(table):
            lines.append(f"- {title}: {key[0]} {key[1]} filler, L = {key[2]}, {key[3]}: {', '.join(table[key])}")
    return "\n".join(lines)


def summarize(records: list, cells=()) -> dict:
    """``{(preset, filler, length, model): row}`` with the best learning rate by seed-mean accuracy."""
    by_lr = {}
    for r in records:
        p = r["protocol"]
        by_lr.setdefault((p["preset"], p["filler"], p["length"], p["mixer"]), {}).setdefault(p["lr"], []).append(r)
    ran = {r["run_id"] for r in records}
    not_run = {}
    for c in cells:
        if mqar_runner.run_id(c) not in ran:
            key = (c["preset"], c["filler"], c["length"], c["mixer"])
            not_run[key] = not_run.get(key, 0) + 1
    rows = {}
    for key, lrs in by_lr.items():
        lr, runs = max(lrs.items(), key=lambda item: sum(x["best_accuracy"] or 0 for x in item[1]) / len(item[1]))
        runs = sorted(runs, key=lambda x: x["protocol"]["seed"])
        every = [x for rs in lrs.values() for x in rs]
        rows[key] = dict(
            preset=key[0], filler=key[1], length=key[2], mixer=key[3], num_kv_pairs=runs[0]["protocol"]["num_kv_pairs"],
            lr=lr, mean=sum(x["best_accuracy"] or 0 for x in runs) / len(runs),
            seeds={x["protocol"]["seed"]: x["best_accuracy"] or 0 for x in runs},
            epochs=[x["epochs_run"] for x in runs], stop=[x["stop_reason"] or x["status"] for x in runs],
            lrs_tried=sorted(lrs), runs=len(every), unfinished=sum(x["status"] != "done" for x in every),
            not_run=not_run.get(key, 0), params=runs[0]["params"], batch_size=runs[0]["protocol"]["batch_size"],
            ms_per_step=runs[0]["ms_per_step"], device=runs[0]["protocol"]["device"])
    return rows


def markdown_table(rows: dict) -> str:
    lines = ["| preset | filler | L | kv pairs | model | best acc. (seed mean) | per seed | best lr | lrs tried "
             "| epochs run (stop) | runs (unfinished) | cells not run | params | batch | ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(rows, key=lambda k: (k[0], k[1], k[2], k[3])):
        r = rows[key]
        seeds = ", ".join(f"s{s}: {100 * a:.2f}%" for s, a in r["seeds"].items())
        stops = ", ".join(f"{e} ({s})" for e, s in zip(r["epochs"], r["stop"]))
        lrs = ", ".join(f"{x:.2g}" for x in r["lrs_tried"])
        lines.append(f"| {r['preset']} | {r['filler']} | {r['length']} | {r['num_kv_pairs']} | {r['mixer']} "
                     f"| {100 * r['mean']:.2f}% | {seeds} | {r['lr']:.2g} | {lrs} | {stops} "
                     f"| {r['runs']} ({r['unfinished']}) | {r['not_run']} | {r['params'] / 1e6:.3f}M "
                     f"| {r['batch_size']} | {r['ms_per_step']} |")
    return "\n".join(lines)


def protocol_lines(records: list) -> str:
    """The protocol fields of the runs (each field's values over all runs), for the report's header."""
    fields = {}
    skip = ("model_config", "params", "lr", "seed", "length", "num_kv_pairs", "batch_size", "mixer")
    for r in records:
        for k, v in r["protocol"].items():
            if k not in skip:
                fields.setdefault(k, set()).add(json.dumps(v))
    return "\n".join(f"- {k}: {', '.join(sorted(v))}" for k, v in sorted(fields.items()))


def model_lines(records: list) -> str:
    """One line per (preset, model): its parameter count and model settings."""
    models = {(r["protocol"]["preset"], r["protocol"]["mixer"]): (r["params"], r["protocol"]["model_config"])
              for r in records}
    return "\n".join(f"- {preset}/{mixer}: {params / 1e6:.4f}M parameters, {json.dumps(config)}"
                     for (preset, mixer), (params, config) in sorted(models.items()))


def plot(rows: dict, path: Path) -> bool:
    """Best accuracy against length, one line per (preset, filler, model) (seed mean) with each
    seed's point; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for preset, filler, mixer in sorted({(k[0], k[1], k[3]) for k in rows}):
        points = sorted((k[2], r) for k, r in rows.items() if (k[0], k[1], k[3]) == (preset, filler, mixer))
        label = (mixer + ("" if preset == "zoology" else f" ({preset})")
                 + ("" if filler == "zero" else f" ({filler} filler)"))
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


def is_table2(cells: list, records: list) -> bool:
    """True when the plan (or, without one, the runs) is ``--preset loglinear_table2``'s."""
    presets = {c["preset"] for c in cells} | {r["protocol"]["preset"] for r in records}
    return presets == {mqar_loglinear.PRESET}


def write_report(records: list, out_dir: Path, queues=None, runs_json: bool = True) -> dict:
    """The output files; returns the summary rows. The runs and plan of ``--preset loglinear_table2``
    get its Table-2 report (:func:`mqar_loglinear.write_table2`, no plot; it also works before any
    run, every cell "not run")."""
    cells = expected_cells(queues, records)
    if is_table2(cells, records):
        rows = mqar_loglinear.write_table2(records, cells, out_dir)
        if runs_json and records:
            (out_dir / "mqar_runs.json").write_text(json.dumps(dict(runs=records), indent=1))
        return rows
    if not records:
        raise ValueError("no run.json found in the given paths")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(records, cells)
    text = (f"MQAR, {len(records)} runs.\n\n## Every cell of the plan\n\nBest test accuracy over the epochs of "
            f"each run, the epochs it ran (e) and how it stopped.\n\n{grid_table(records, cells)}\n\n"
            f"{missing_summary(records, cells)}\n\n## Best learning rate per model and length\n\nMean over seeds "
            f"at the best learning rate (per-seed values beside it).\n\n{markdown_table(rows)}\n\n"
            f"## Protocol\n\n{protocol_lines(records)}\n\n## Models\n\n{model_lines(records)}\n")
    (out_dir / "mqar_results.md").write_text(text)
    if runs_json:
        (out_dir / "mqar_runs.json").write_text(json.dumps(dict(runs=records), indent=1))
    if not plot(rows, out_dir / "mqar_accuracy.png"):
        print("matplotlib is not installed: no plot")
    print(missing_summary(records, cells).splitlines()[0])
    print(markdown_table(rows))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="folders holding run.json files (searched recursively), or files")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--queue", nargs="+", default=None, help="the planned runs (default: Zoology's default sweep)")
    p.add_argument("--no-runs-json", action="store_true", help="do not write mqar_runs.json")
    args = p.parse_args(argv)
    return write_report(load_runs(args.paths), Path(args.out_dir), args.queue, not args.no_runs_json)
