"""Regenerate the tables of ``benchmarks/README.md`` from the committed JSONs in ``benchmarks/results``.

The README marks each generated table with a pair of comments naming its source::

    <!-- table: kernels_h100.json -->
    ...generated, never edited by hand...
    <!-- end table -->

The source picks the renderer by its file-name prefix (``kernels``, ``fla_seed``, ``models``, ``loglinear``,
``train_throughput``, ``kernel_stages_aot``) or folder (``aot/``: ``kernel_stages --part aot``);
``index`` is the list of every result JSON with its device, date and commit. Every table starts
with the line naming its file, device, date and commit, so a number is never shown without the
run it came from.

    python -m tools.benchmark_tables           # rewrite benchmarks/README.md
    python -m tools.benchmark_tables --check   # exit 1 if the README is not what the JSONs give
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
BLOCK = re.compile(r"(<!-- table: (?P<source>[\w.\-/]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.DOTALL)


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def commit_of(result: dict) -> str:
    """``commit``, or for a JSON merged from runs at several commits (``commits``: {part: commit}) each
    commit with its parts."""
    if "commit" in result:
        return str(result["commit"])
    parts: dict[str, list[str]] = {}
    for part, commit in result.get("commits", {}).items():
        parts.setdefault(commit, []).append(part)
    return "; ".join(f"{commit} ({', '.join(names)})" for commit, names in parts.items()) or "not recorded"


def provenance(name: str, result: dict) -> str:
    """The line above a table: which file, device, date and commit its numbers come from."""
    return f"`results/{name}`: {result.get('device', '?')}, {result.get('date', '?')}, commit {commit_of(result)}"


def markdown(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(value) -> str:
    return "" if value is None else f"{value:.3f}"


def render_kernels(name: str) -> str:
    """Forward and forward+backward median ms per shape and op (``benchmarks.kernels``)."""
    result = load(name)
    graphs = any("fwd_bwd_graph" in timing for timing in result["timings_ms"].values())
    rows = []
    for key, timing in result["timings_ms"].items():
        shape, op = key.split("/", 1)
        tflops = result.get("tflops", {}).get(shape, {}) if op == "ours" else {}
        graph_cells = [ms(timing.get("fwd_graph")), ms(timing.get("fwd_bwd_graph"))] if graphs else []
        rows.append([shape, op, ms(timing.get("fwd")), ms(timing.get("fwd_bwd")), *graph_cells,
                     f"{tflops['fwd']:.1f} / {tflops['fwd_bwd']:.1f}" if tflops else ""])
    graph_heads = ["fwd ms, CUDA graph", "fwd+bwd ms, CUDA graph"] if graphs else []
    table = markdown(["shape", "op", "fwd ms", "fwd+bwd ms", *graph_heads, "ours TFLOP/s fwd / fwd+bwd"], rows)
    return f"{provenance(name, result)}, {result.get('dtype', '')}\n\n{table}\n"


def timed(value: float | str | None) -> str:
    """A time in ms, or why there is none (fla's refusal, recorded as "raised: ..."), shortened for a cell."""
    return ms(value) if not isinstance(value, str) else value.split(" on Hopper")[0][:60]


def render_fla_seed(name: str) -> str:
    """Ours against fla's kernel per seed mixer and use (``benchmarks.fla_seed``); runs that timed our delta-rule
    route (``--sides ... ours_delta``) get its columns, and runs without fla none of fla's."""
    result = load(name)
    timings = result["timings_ms"]
    sides = [side for side in ("ours", "ours_delta", "fla") if any(side in t for t in timings.values())]
    rows = []
    for key, timing in timings.items():
        use, mixer = key.split("/", 1)
        row = [mixer, use]
        for side in sides:
            entry = timing.get(side, {})
            row += [timed(entry.get("fwd")), timed(entry.get("fwd_bwd"))]
        for ours in ("ours", "ours_delta"):
            if ours in sides and "fla" in sides:
                ratio = timing.get(f"{ours}_over_fla_fwd_bwd")
                row.append(f"{ratio:.2f}" if ratio is not None else "")
        rows.append(row)
    label = {"ours": "ours", "ours_delta": "ours (delta rule)", "fla": "fla"}
    header = ["mixer", "use"] + [f"{label[side]} {mode} ms" for side in sides for mode in ("fwd", "fwd+bwd")]
    header += [f"{label[ours]} / fla (fwd+bwd)" for ours in ("ours", "ours_delta") if ours in sides and "fla" in sides]
    return f"{provenance(name, result)}\n\n{markdown(header, rows)}\n"


def render_models(name: str) -> str:
    """Step time, throughput and peak memory per model, mode and resolution (``benchmarks.models``); runs
    with compiled cells (rows with a ``compile`` setting) get that column and the compile ratios."""
    result = load(name)
    if any("compile" in r for r in result["rows"]):
        return render_compiled_models(name, result)
    rows = [[r["model"], r["mode"], r["resolution"], r["batch"], ms(r["step_ms"]), f"{r['images_per_s']:.1f}",
             f"{r['peak_mem_mib']:.0f}"] for r in result["rows"]]
    table = markdown(["model", "mode", "px", "batch", "step ms", "img/s", "peak MiB"], rows)
    ratios = markdown(["mode", "px", "speed ratio", "memory ratio"],
                      [[r["mode"], r["resolution"], r["speed_ratio"], r["memory_ratio"]]
                       for r in result.get("ratios", [])])
    engine = f"\n{engine_table(result['engine'])}\n" if result.get("engine") else ""
    return f"{provenance(name, result)}, {result.get('autocast', '')} autocast\n\n{table}\n\n{ratios}\n{engine}"


def render_compiled_models(name: str, result: dict) -> str:
    """:func:`render_models` for a run with eager and compiled cells (``benchmarks.models --compile``)."""
    def cell(r: dict) -> list:
        if "error" in r:
            return [r["error"], "", ""]
        return [ms(r["step_ms"]), f"{r['images_per_s']:.1f}", f"{r['peak_mem_mib']:.0f}"]

    rows = [[r["model"], r["mode"], r["compile"], r["resolution"], r["batch"], *cell(r),
             f"{r['graphs']}/{r['graph_breaks']}" if "graphs" in r else ""] for r in result["rows"]]
    table = markdown(["model", "mode", "compile", "px", "batch", "step ms", "img/s", "peak MiB", "graphs/breaks"], rows)
    keys = ("speed_ratio", "memory_ratio", "compile_speedup", "compile_memory")
    ratios = markdown(["model", "mode", "compile", "px", "img/s / deit", "memory / deit", "img/s / eager",
                       "memory / eager"],
                      [[r["model"], r["mode"], r["compile"], r["resolution"], *(r.get(k, "") for k in keys)]
                       for r in result.get("ratios", [])])
    engine = f"\n{engine_table(result['engine'])}\n" if result.get("engine") else ""
    return f"{provenance(name, result)}, {result.get('autocast', '')} autocast\n\n{table}\n\n{ratios}\n{engine}"


def engine_table(rows: list[dict]) -> str:
    """The training engine's own step per model (``benchmarks.models --engine``), with its compile setting
    where the run recorded one."""
    compiled = any("compile" in r for r in rows)
    header = ["model (engine step)", *(["compile"] if compiled else []), "px", "batch", "precision", "step ms", "img/s",
              "peak GiB"]
    return markdown(header, [[r["model"], *([r.get("compile", "eager")] if compiled else []), r["img_size"], r["batch"],
                              r["precision"], ms(r["step_ms"]), f"{r['img_per_s']:.1f}", f"{r['peak_gib']:.1f}"]
                             for r in rows])


def render_train_throughput(name: str) -> str:
    """The engine step of the script that ``benchmarks.models --engine`` replaced (same rows)."""
    result = load(name)
    return f"{provenance(name, result)}\n\n{engine_table(result['rows'])}\n"


def ours_table(rows: dict) -> str:
    """Ours per shape: fwd+bwd of the linear and the log-linear op; where the run timed the forward without
    gradients by F2's chains (``loglinear_chains_fwd``), both forwards beside it (the doubling, the chains)."""
    chains = any("loglinear_chains_fwd" in r for r in rows.values())
    header = ["shape", "B, T, H, D", "linear f+b ms", "log-linear f+b ms", "log-linear / linear"]
    if chains:
        header += ["linear fwd ms", "log-linear fwd ms (doubling)", "log-linear fwd ms (chains)", "chains / linear fwd"]

    def row(shape, r):
        cells = [shape, ", ".join(map(str, r["bthd"])), ms(r["linear"]["fwd_bwd"]), ms(r["loglinear"]["fwd_bwd"]),
                 f"{r['ratio_fwd_bwd']:.2f}"]
        if chains:
            cells += [ms(r["linear"].get("fwd")), ms(r["loglinear"].get("fwd")), ms(r.get("loglinear_chains_fwd")),
                      f"{r['ratio_fwd_chains']:.2f}" if "ratio_fwd_chains" in r else "-"]
        return cells

    return markdown(header, [row(shape, r) for shape, r in rows.items()])


def paths_table(paths: dict) -> str:
    """The paths part of ``benchmarks.loglinear``: fwd+bwd of the linear op and of each log-linear path per shape,
    and each path over the linear op (the compiled chunk form where the run has it)."""
    names = [("chunk_form", "chunk form"), ("levels", "levels"), ("chunk_form_compiled", "compiled chunk form")]
    names = [(key, label) for key, label in names if any(key in r for r in paths.values())]
    header = (["shape", "B, T, H, D", "linear f+b ms"] + [f"{label} f+b ms" for _, label in names]
              + [f"{label} / linear" for _, label in names])
    rows = [[shape, ", ".join(map(str, r["bthd"])), ms(r["linear"]["fwd_bwd"])]
            + [ms(r[key]["fwd_bwd"]) if key in r else "-" for key, _ in names]
            + [f"{r[key + '_over_linear']:.2f}" if key in r else "-" for key, _ in names]
            for shape, r in paths.items()]
    return markdown(header, rows)


def render_loglinear(name: str) -> str:
    """Log-linear against linear: ours per shape, the log-linear paper's Mamba-2 benchmark, and the
    bf16 checks (``benchmarks.loglinear``)."""
    result = load(name)
    ours = ours_table(result.get("ours", {}))
    paper = result.get("fla_paper", {})
    ops = list(next(iter(paper.values()), {}))
    fla = markdown(["T"] + [f"{op} f+b ms" for op in ops],
                   [[seq.lstrip("T")] + [ms(row[op].get("fwd_bwd")) if "fwd_bwd" in row[op] else "failed"
                                         for op in ops] for seq, row in paper.items()])
    checks = markdown(["check", "largest relative error (output, gradients)"],
                      [[case, f"{max(errs.values()):.1e}"] for case, errs in result.get("check", {}).items()])
    paths = paths_table(result.get("paths", {}))
    parts = [table for part, table in (("ours", ours), ("fla_paper", fla), ("check", checks), ("paths", paths))
             if result.get(part)]
    return f"{provenance(name, result)}, {result.get('dtype', '')}\n\n" + "\n\n".join(parts) + "\n"


def render_kernel_stages_aot(name: str) -> str:
    """Compiled forward kernels per kernel over every mixer and case, and each mixer's work per stage at
    the LM shape (``benchmarks.kernel_stages --part aot``: compiled for the H100, nothing launched)."""
    result = load(name)
    kernels: dict[str, list[dict]] = {}
    for row in result["rows"]:
        kernels.setdefault(row["kernel"], []).append(row)
    compiled = markdown(["kernel", "compilations", "max registers", "spilling", "max shared KB", "wgmma"],
                        [[kernel, len(rows), max(r["regs"] for r in rows), sum(r["spill"] > 0 for r in rows),
                          max(r["smem_kb"] for r in rows), sum(bool(r["wgmma"]) for r in rows)]
                         for kernel, rows in kernels.items()])
    costs = result.get("lm_costs", {})
    stages = list(next(iter(costs.values()), {}))
    work = markdown(["mixer at lm"] + [f"{stage} GFLOP / MB" for stage in stages],
                    [[mixer] + [f"{cost[stage]['gflop']:.1f} / {cost[stage]['mb']:.0f}" for stage in stages]
                     for mixer, cost in costs.items()])
    return f"{provenance(name, result)}\n\n{compiled}\n\n{work}\n"


def render_delta_rule(name: str) -> str:
    """The delta rule against today's HDLA op and fla's KDA, forward and forward+backward per shape and op
    (``benchmarks.delta_rule``; a failed variant as "failed"), and each precision's error against float64."""
    result = load(name)
    cell = lambda value: ms(value) if isinstance(value, (int, float)) else "failed"  # noqa: E731
    rows = []
    for shape, fwd in result["fwd_ms"].items():
        fwd_bwd = result.get("fwd_bwd_ms", {}).get(shape, {})
        rows += [[shape, ", ".join(map(str, fwd["bthd"])), op, cell(fwd[op]), cell(fwd_bwd.get(op))]
                 for op in fwd if op != "bthd"]
    timing = markdown(["shape", "B, T, H, D", "op", "fwd ms", "fwd+bwd ms"], rows)
    errors = markdown(["shape / precision", "HDLA through the delta rule: largest relative error against float64 "
                       "(output, gradients)"],
                      [[p, f"{err:.1e}" if isinstance(err, float) else err] for p, err in result.get("parity", {}).items()])
    return f"{provenance(name, result)}, {result.get('dtype', '')}\n\n{timing}\n\n{errors}\n"


DELTA_KERNELS = {"_prepare_kernel": "P", "_state_kernel": "S", "_output_kernel": "O", "_dout_kernel": "dO",
                 "_state_bwd_kernel": "dS", "_chunk_bwd_kernel": "dC"}


def render_delta_kernels(name: str) -> str:
    """The delta rule at KDA's shape per launch setting (``benchmarks.delta_rule_kernels``): fwd+bwd ms and µs per
    kernel, and fla's chunk_kda (its total and its three costliest kernels) where the run timed it."""
    result = load(name)
    rows = []
    for shape, runs in result["shapes"].items():
        for variant, run in runs.items():
            if variant == "bthd":
                continue
            if "failed" in run:
                rows.append([shape, variant, "failed", "", run["failed"][:60], "", ""])
                continue
            us = run["kernel_us"]
            if variant == "fla_kda":
                top = sorted(us.items(), key=lambda kv: -kv[1])[:3]
                detail = ", ".join(f"{k[:32]} {v:.0f}" for k, v in top)
            else:
                rate = run.get("kernel_tflops", {})
                detail = ", ".join(f"{label} {us[kernel]:.0f}" + (f" ({rate[kernel]:.0f} TF/s)" if kernel in rate else "")
                                   for kernel, label in DELTA_KERNELS.items() if kernel in us)
            rows.append([shape, variant, ms(run["fwd_bwd_ms"]), f"{sum(us.values()):.0f}", detail,
                         run.get("peak_mib", ""), run.get("kept_mib", "")])
    table = markdown(["shape", "variant", "fwd+bwd ms", "kernels µs", "µs per kernel", "peak MiB",
                      "kept for the backward MiB"], rows)
    gate = f", g {result['g']}" if "g" in result else ""
    return f"{provenance(name, result)}, {result.get('dtype', '')}, precision {result.get('precision', '')}{gate}\n\n{table}\n"


def render_index(_: str) -> str:
    """Every result JSON with its device, date and commit."""
    rows = []
    for path in sorted(RESULTS.rglob("*.json")):
        result = json.loads(path.read_text())
        if isinstance(result, dict) and "device" in result:
            rows.append([f"`{path.relative_to(RESULTS)}`", result["device"], result.get("date", ""),
                         commit_of(result)])
    return markdown(["file", "device", "date", "commit"], rows) + "\n"


RENDERERS: dict[str, Callable[[str], str]] = {
    "index": render_index, "kernels": render_kernels, "fla_seed": render_fla_seed, "models": render_models,
    "loglinear": render_loglinear, "train_throughput": render_train_throughput,
    "kernel_stages_aot": render_kernel_stages_aot, "aot": render_kernel_stages_aot,
    "delta_kernels": render_delta_kernels, "delta_rule": render_delta_rule,  # delta_kernels_*/delta_rule_kernels_*
}


def render(source: str) -> str:
    """The table for a README block's ``source`` (a result file name, or ``index``): the renderer its path or,
    in a folder named after the call (``op_floor_h200/kernels.json``), its file name starts with."""
    for prefix, renderer in RENDERERS.items():
        if source == prefix or source.startswith((prefix + "_", prefix + "/")) or \
                source.rsplit("/", 1)[-1].startswith((prefix + "_", prefix + ".")):
            return renderer(source)
    raise ValueError(f"benchmarks/README.md: no table renderer for '{source}' (known: {sorted(RENDERERS)})")


def regenerate(text: str) -> str:
    """``text`` with the body of every table block replaced by what its source renders."""
    if not BLOCK.search(text):
        raise ValueError("benchmarks/README.md has no '<!-- table: ... -->' blocks")
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("source")) + m.group(4), text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 if the README is stale")
    args = parser.parse_args(argv)
    current = README.read_text()
    fresh = regenerate(current)
    if args.check:
        if fresh != current:
            print("benchmarks/README.md is stale: run python -m tools.benchmark_tables", file=sys.stderr)
            return 1
        return 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
