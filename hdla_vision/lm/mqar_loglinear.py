"""MQAR at the Log-Linear Attention paper's Table 2 setting: ``python -m benchmarks.mqar --preset loglinear_table2``.

The paper (Guo et al., ``shared/papers/log_linear_attention.md`` §4.1, Table 2, appendix D lines
1033-1040) says: "we largely follow the setup described in Arora et al. (2024). Models are trained
and evaluated on 256-token sequences containing between 4 and 64 key-value pairs. We do not
evaluate on sequences longer than those used in training (i.e., no length generalization). [...]
For (Log-Linear) Gated DeltaNet, we use two attention heads by default, except for models with a
dimension of 16, where a single head is used. We tune the learning rate and, for Log-Linear models,
also tune the parameterization of lambda. We run each configuration with five seeds. Training was
early stopped when accuracy exceeded 99%." Table 2 gives "average accuracies and standard
deviations [...] over 5 seeds" at model dimensions 16, 32, 64. Everything else is Zoology's code as
Arora et al. (2024) ran it (HazyResearch/zoology; the configs of the Based paper,
``zoology/experiments/paper_configs/arxiv24_based_figure2/configs.py``, whose data, optimiser and
sweep the March-2025 configs for new architectures, ``zoology/experiments/030325_new_arch/configs.py``
with ``zoology/experiments/models_repo.py``, repeat unchanged; the code: ``zoology/data/utils.py``,
``zoology/data/associative_recall.py``, ``zoology/train.py``, ``zoology/config.py``,
``zoology/model.py``, ``zoology/mixers/gated_delta_net.py`` at commit b386338, 2025-03-05, the
version current when the paper was written). The choices, each with its source:

Data (``TRAIN_SEGMENTS``, ``TEST_SEGMENTS``):
  * training: Zoology's five segments, (sequence length, key-value pairs, examples) = (64, 4,
    100,000), (128, 8, 20,000), (256, 16, 20,000), (256, 32, 20,000), (256, 64, 20,000) (Based
    figure-2 config): 4 to 64 pairs, sequences up to 256 tokens. Each segment keeps its own length
    (Zoology pads nothing: a batch is cut from one segment);
  * test: Zoology's test segments without the length-generalisation ones (the paper: "no length
    generalization"): (64, 4), (64, 8), (64, 16), (128, 32), (256, 64), 1,000 examples each; the
    dropped ones are (512, 128) and (1024, 256). "256-token sequences" in the paper is read as the
    longest length of this mixture; reading it as every sequence at 256 tokens would need other
    segments than Zoology's, which the paper does not list;
  * vocabulary 8,192, power-law query gaps a = 0.01, random filler tokens (``MQARConfig``'s default
    ``random_non_queries=True``: the Based configs do not set it; ``--filler zero`` is the ablation);
  * every segment drawn with its own seed, train and test from different seeds, no de-duplication
    (Zoology's ``prepare_data``); here the seeds derive from the run seed (Zoology fixes the data
    seed at 123 for every run; the paper does not say what its five seeds vary: here they vary the
    data, the initialisation and the dropout masks together, as this benchmark's other presets);
  * order: Zoology's ``_SyntheticDataset`` lists the batches segment by segment and its DataLoader
    has ``shuffle=False``, so every epoch runs the same batches in the same order: the 391 batches
    of (64, 4), then 79 of each other segment (707 steps, last batch of each segment short).
Training (``zoology/train.py``, ``TrainConfig`` defaults, the Based config):
  * batch 256; 32 epochs (``max_epochs=32``); AdamW (torch defaults, weight decay 0.1 on every
    parameter, as Zoology passes ``model.parameters()``); cosine over the epochs stepped once per
    epoch (``CosineAnnealingLR(T_max=32, eta_min=0)``), no warm-up; no gradient clipping;
  * learning rates ``np.logspace(-3, -1.5, 4)`` (1e-3, 3.16e-3, 1e-2, 3.16e-2; the paper says only
    "tuned"); seeds 0-4 (the paper's five);
  * early stop when the test accuracy exceeds 0.99 (``early_stopping_metric="valid/accuracy"``,
    threshold 0.99, checked after each epoch's test);
  * accuracy (``compute_metrics``): per test example, the share of its queries answered right (argmax);
    the test accuracy is the mean over the 5,000 test examples (so each segment weighs 1/5), also
    kept per number of pairs (Zoology's ``slice_keys=["num_kv_pairs"]``);
  * precision: bf16 autocast on CUDA (Zoology runs fp32 but casts the Gated DeltaNet inputs to bf16).
Model (:mod:`hdla_vision.lm.zoology_lm`, Zoology's ``LanguageModel`` with our mixers):
  * width d_model = the table's dimension, 16 / 32 / 64; two layers: a ``BaseConv`` (kernel 3) then
    the mixer (Zoology's ``Hybrid`` alternates its two configs by layer); no MLP; embedding dropout 0.1;
    LayerNorm; tied embeddings;
  * heads (:func:`heads_for`): two, one at dimension 16 (the paper); key dim per head = d_model /
    heads (Zoology's Gated DeltaNet: ``head_dim = hidden_size // num_heads``), so 16 at every
    dimension but 64 (32);
  * Gated DeltaNet as Zoology's: value width twice the key width (``expand_v=2``), short conv 4 on
    q/k/v, beta in (0, 1). One departure: our mixers always have the SiLU output gate (fla's default
    ``use_gate=True``), which Zoology's config turns off (``use_gate=False``, marked "Tune");
  * HDLA: this benchmark's ``hdla`` layer as in ``--preset zoology`` (short conv 4, rank-16 decay with
    a bias, beta in (0, 2), value width = key width);
  * log-linear models: the same layer with ``log_linear=True`` (``loglinear_<name>``), lambda
    ``softplus(L (x W))`` with L = 1 and W without bias at init (the authors' ``lambda_mode="positive"``,
    their default), 9 levels (1 + log2 256: every level a sequence of 256 tokens can reach has its
    own weight; the authors size the head for 16K tokens, whose extra levels never occur here).
    The paper also tunes the lambda parameterisation; the authors' code offers "positive",
    "bounded" (``exp(-exp(L) softplus(x W))``) and a linear one. Only "positive" exists in our
    mixers, so the tuning is over learning rates only: a departure, stated in the report.

The report (:func:`write_table2`) gives, per model and dimension, the mean (sample standard
deviation, ddof = 1; the paper does not say which) over the seeds of each run's best test accuracy
over its epochs (with the early stop, the last epoch for a solved run), at the learning rate whose
seed mean is highest, as Table 2 does; cells without runs say "not run", incomplete ones say how
many of the planned runs they hold.
"""
import json
import math
from pathlib import Path

import numpy as np

PRESET = "loglinear_table2"
VOCAB_SIZE = 8192
# (sequence length, key-value pairs, examples)
TRAIN_SEGMENTS = ((64, 4, 100_000), (128, 8, 20_000), (256, 16, 20_000), (256, 32, 20_000), (256, 64, 20_000))
TEST_SEGMENTS = ((64, 4, 1_000), (64, 8, 1_000), (64, 16, 1_000), (128, 32, 1_000), (256, 64, 1_000))
DROPPED_TEST_SEGMENTS = ((512, 128, 1_000), (1024, 256, 1_000))  # Zoology's length generalisation
# --tiny: CPU smoke sizes of the same shape (two lengths, a segment per pair count)
TINY_TRAIN_SEGMENTS = ((16, 2, 32), (32, 4, 16), (32, 8, 16))
TINY_TEST_SEGMENTS = ((16, 2, 8), (16, 4, 8), (32, 8, 8))
DIMS = (16, 32, 64)
SEEDS = (0, 1, 2, 3, 4)
BASED_LRS = np.logspace(-3, -1.5, 4).tolist()
EPOCHS = 32
BATCH_SIZE = 256
NUM_LEVELS = 9  # levels 0..8: 1 + log2(256)

# Each model: ZoologyLMConfig settings; "value_expand" multiplies the key dim into the value dim.
MODELS = {
    "gated_deltanet": dict(mixer="gated_deltanet", short_conv_size=4, gate_act="silu", value_expand=2,
                           mixer_kwargs={"beta_range": 1.0}),
    "loglinear_gated_deltanet": dict(mixer="loglinear_gated_deltanet", short_conv_size=4, gate_act="silu",
                                     value_expand=2, mixer_kwargs={"beta_range": 1.0, "num_levels": NUM_LEVELS}),
    "hdla": dict(mixer="hdla", short_conv_size=4, gate_act="silu", value_expand=1, mixer_kwargs={}),
    "loglinear_hdla": dict(mixer="loglinear_hdla", short_conv_size=4, gate_act="silu", value_expand=1,
                           mixer_kwargs={"num_levels": NUM_LEVELS}),
}
# cost order of the queue within a dimension and seed: linear before log-linear, GDN before HDLA
MODEL_ORDER = tuple(MODELS)


def heads_for(dim: int) -> int:
    """Heads at model width ``dim``: two, one at 16 and below (the paper's appendix D)."""
    return 1 if dim <= 16 else 2


def head_sizes(dim: int, value_expand: int):
    """``(heads, key dim, value dim)`` per head at width ``dim`` (key dim = dim / heads, as Zoology)."""
    heads = heads_for(dim)
    if dim % heads:
        raise ValueError(f"--dims: a width of {dim} does not split into {heads} heads")
    return heads, dim // heads, value_expand * (dim // heads)


def segments_for(tiny: bool) -> dict:
    """The planned segments as lists (JSON-able): ``{"train": [[L, pairs, n], ...], "test": [...]}``."""
    train, test = (TINY_TRAIN_SEGMENTS, TINY_TEST_SEGMENTS) if tiny else (TRAIN_SEGMENTS, TEST_SEGMENTS)
    return dict(train=[list(s) for s in train], test=[list(s) for s in test])


def segment_seed(seed: int, part: int, index: int) -> int:
    """Generator seed of segment ``index`` of ``part`` (0: train, 1: test) for the run seed ``seed``."""
    return (seed * 1_000_003 + index) * 2 + part + 7_919


# -- the report ---------------------------------------------------------------------------------
def run_score(record: dict) -> float:
    return record["best_accuracy"] or 0.0


def sample_std(values) -> float:
    """Standard deviation with ddof = 1 (0 for one value)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def summarize_cell(records: list, planned: list) -> dict:
    """One (model, dimension) cell: the learning rate with the best seed mean and its seeds' scores.

    ``records``: the cell's run records; ``planned``: its planned cells (dicts with ``lr``, ``seed``)."""
    by_lr = {}
    for r in records:
        by_lr.setdefault(r["protocol"]["lr"], []).append(r)
    if not by_lr:
        return dict(runs=0, planned=len(planned))
    lr, runs = max(by_lr.items(), key=lambda item: sum(map(run_score, item[1])) / len(item[1]))
    runs = sorted(runs, key=lambda r: r["protocol"]["seed"])
    scores = [run_score(r) for r in runs]
    return dict(runs=len(records), planned=len(planned), lr=lr, mean=sum(scores) / len(scores),
                std=sample_std(scores), seeds={r["protocol"]["seed"]: run_score(r) for r in runs},
                unfinished=sum(r["status"] != "done" for r in records),
                solved=sum(r.get("stop_reason") == "early_stop" for r in runs),
                lr_means={lr_: sum(map(run_score, rs)) / len(rs) for lr_, rs in sorted(by_lr.items())},
                params=runs[0]["params"])


def cell_text(cell: dict) -> str:
    """``38.40 (1.00)``; ``not run``; an incomplete cell adds how many planned runs it holds."""
    if cell["runs"] == 0:
        return "not run"
    spread = f"{100 * cell['std']:.2f}" if len(cell["seeds"]) > 1 else "-"
    text = f"{100 * cell['mean']:.2f} ({spread})"
    if cell["runs"] < cell["planned"] or cell["unfinished"]:
        done = cell["runs"] - cell["unfinished"]
        text += f" [{done}/{cell['planned']} runs done" + (f", {cell['unfinished']} unfinished" if cell["unfinished"] else "") + "]"
    return text


def table2(records: list, cells: list) -> dict:
    """``{(model, dim): cell}`` over the planned cells' (model, dim) pairs, from the records of planned
    runs only (the grid lists the others)."""
    by_key = {}
    for c in cells:
        by_key.setdefault((c["mixer"], c["d_model"]), ([], []))[1].append(c)
    planned_ids = {run_id(c) for c in cells}
    for r in records:
        p = r["protocol"]
        if r["run_id"] in planned_ids:
            by_key[(p["mixer"], p["d_model"])][0].append(r)
    return {key: summarize_cell(runs, planned) for key, (runs, planned) in by_key.items()}


def model_order(name: str):
    return (MODEL_ORDER.index(name) if name in MODEL_ORDER else len(MODEL_ORDER), name)


def table2_markdown(summary: dict) -> str:
    """Table 2's layout: a row per model, a column per dimension, ``mean (std)`` in percent."""
    dims = sorted({dim for _, dim in summary})
    models = sorted({model for model, _ in summary}, key=model_order)
    lines = ["| model | " + " | ".join(f"d = {d}" for d in dims) + " |", "|---|" + "---|" * len(dims)]
    for model in models:
        texts = [cell_text(summary[(model, d)]) if (model, d) in summary else "-" for d in dims]
        lines.append(f"| {model} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def detail_markdown(summary: dict) -> str:
    """Per cell: the chosen learning rate, each seed's score, the seed mean at every learning rate."""
    lines = ["| model | d | params | best lr | seeds at the best lr | early stops | seed mean per lr |",
             "|---|---|---|---|---|---|---|"]
    for (model, dim), c in sorted(summary.items(), key=lambda kv: (model_order(kv[0][0]), kv[0][1])):
        if c["runs"] == 0:
            lines.append(f"| {model} | {dim} | - | - | not run | - | - |")
            continue
        seeds = ", ".join(f"s{s} {100 * v:.2f}" for s, v in c["seeds"].items())
        lrs = ", ".join(f"{lr:.3g}: {100 * v:.2f}" for lr, v in c["lr_means"].items())
        lines.append(f"| {model} | {dim} | {c['params']:,} | {c['lr']:.3g} | {seeds} | "
                     f"{c['solved']}/{len(c['seeds'])} | {lrs} |")
    return "\n".join(lines)


def run_id(cell: dict) -> str:
    """``loglinear_table2_<model>_d<dim>_lr<lr>_s<seed>_<filler>`` (a cell: a dict with those fields)."""
    return f"{PRESET}_{cell['mixer']}_d{cell['d_model']}_lr{cell['lr']:.3g}_s{cell['seed']}_{cell['filler']}"


def run_text(record) -> str:
    """A run's cell in a grid: best accuracy, epochs run, how it stopped; ``not run`` without a record
    (the one format of every MQAR report, :func:`hdla_vision.lm.mqar_report.cell_text` too)."""
    if record is None:
        return "not run"
    acc = f"{100 * run_score(record):.2f}%"
    if record["status"] != "done":
        return f"{acc} (e{record['epochs_run']}/{record['epochs_planned']}, unfinished)"
    stop = {"early_stop": "early stop", "epochs": "all epochs", "steps": "all steps"}[record["stop_reason"]]
    return f"{acc} (e{record['epochs_run']}, {stop})"


def grid_markdown(records: list, cells: list) -> str:
    """Every planned run: a row per (model, dim, lr), a column per seed; runs outside the plan added."""
    by_id = {r["run_id"]: r for r in records}
    rows = {}
    for c in cells:
        rows.setdefault((c["mixer"], c["d_model"], c["lr"], c["filler"]), {})[c["seed"]] = by_id.get(run_id(c))
    planned_ids = {run_id(c) for c in cells}
    for r in records:
        if r["run_id"] not in planned_ids:
            p = r["protocol"]
            rows.setdefault((p["mixer"] + " (outside the plan)", p["d_model"], p["lr"], p["filler"]), {})[p["seed"]] = r
    seeds = sorted({s for row in rows.values() for s in row})
    lines = ["| model | d | lr | filler | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|---|---|---|" + "---|" * len(seeds)]
    for key in sorted(rows, key=lambda k: (k[1], model_order(k[0]), k[2], k[3])):
        texts = [run_text(rows[key][s]) if s in rows[key] else "-" for s in seeds]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:.3g} | {key[3]} | " + " | ".join(texts) + " |")
    done = {r["run_id"] for r in records if r["status"] == "done"}
    started = {r["run_id"] for r in records}
    counts = (sum(run_id(c) in done for c in cells), sum(run_id(c) in started - done for c in cells),
              sum(run_id(c) not in started for c in cells))
    lines.append(f"\nPlanned runs: {len(cells)}; finished: {counts[0]}; unfinished: {counts[1]}; not run: {counts[2]}.")
    return "\n".join(lines)


def write_table2(records: list, cells: list, out_dir: Path) -> dict:
    """``out_dir/mqar_results.md``: Table 2, the details per cell, every planned run and the protocol.
    Works with no records (every cell "not run")."""
    summary = table2(records, cells)
    finished = sum(r["status"] == "done" for r in records)
    text = (f"# MQAR at the Log-Linear Attention paper's Table 2 setting (`--preset {PRESET}`)\n\n"
            f"{len(cells)} planned runs; {len(records)} with a record, {finished} finished. The protocol and "
            f"the source of every choice: `hdla_vision/lm/mqar_loglinear.py`'s docstring.\n\n"
            f"## Table 2\n\nTest accuracy (%): mean (sample std) over seeds at the learning rate with the best "
            f"seed mean; each run's score is its best test accuracy over its epochs (Zoology's accuracy: the "
            f"mean over test examples of the share of queries answered). The paper's lambda-parameterisation "
            f"tuning is not done (one parameterisation exists here).\n\n{table2_markdown(summary)}\n\n"
            f"The paper's Table 2 (for comparison): Gated DeltaNet 38.4 (1.0) / 79.0 (2.1) / >= 99, with "
            f"Log-Linear 40.0 (1.4) / 84.4 (1.2) / >= 99 at d = 16 / 32 / 64.\n\n"
            f"## Per cell\n\n{detail_markdown(summary)}\n\n## Every planned run\n\n{grid_markdown(records, cells)}\n")
    if records:
        protocol = {k: v for k, v in records[0]["protocol"].items()
                    if k not in ("mixer", "model_config", "params", "lr", "seed", "d_model", "device", "commit",
                                 "torch", "runs_per_gpu")}
        text += f"\n## Protocol (first record)\n\n```\n{json.dumps(protocol, indent=1)}\n```\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "mqar_results.md").write_text(text)
    print(table2_markdown(summary))
    return summary
