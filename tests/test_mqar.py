"""MQAR generator properties (Zoology's definition), the fixed split, and the MQAR runner's runs
(hdla_vision/lm/mqar_runner.py): the presets' values, resume from a per-epoch checkpoint (also across device
calls, hdla_vision/lm/mqar_device.py), a smoke run of each preset, the report."""
import json
import math

import numpy as np
import pytest
import torch

from hdla_vision.lm import mqar_device, mqar_report, mqar_runner
from hdla_vision.lm.mqar import mqar_split, multiquery_ar


@pytest.mark.parametrize("random_filler", [False, True])
@pytest.mark.parametrize("vocab,length,pairs", [(8192, 256, 32), (100, 64, 16), (300, 128, 4)])
def test_generator_properties(vocab, length, pairs, random_filler):
    inputs, labels = multiquery_ar(vocab, 50, length, pairs, seed=3, random_non_queries=random_filler)
    assert inputs.shape == labels.shape == (50, length) and inputs.dtype == torch.long
    assert int(inputs.min()) >= 0 and int(inputs.max()) < vocab
    keys, values = inputs[:, 0:2 * pairs:2], inputs[:, 1:2 * pairs:2]
    assert bool((keys >= 1).all() and (keys < vocab // 2).all())
    assert bool((values >= vocab // 2).all() and (values < vocab).all())
    for row in range(50):
        assert len(set(keys[row].tolist())) == pairs, "keys must be unique within an example"
        assert len(set(values[row].tolist())) == pairs
        asked = (labels[row] != -100).nonzero().flatten()
        assert len(asked) == pairs, "every key is queried once"
        assert bool((asked >= 2 * pairs).all()), "queries come after the key-value pairs"
        assert bool((asked % 2 == 0).all())
        pair_of = dict(zip(keys[row].tolist(), values[row].tolist()))
        for pos in asked.tolist():
            query = inputs[row, pos].item()
            assert query in pair_of, "the query token is a key seen earlier"
            assert labels[row, pos].item() == pair_of[query], "the answer is that key's value"
            assert pair_of[query] in inputs[row, :pos].tolist(), "the answer was shown before the query"
    filler = labels == -100
    filler[:, :2 * pairs] = False
    tokens = inputs[filler]
    if random_filler:
        assert len(set(tokens.tolist())) > min(vocab, tokens.numel()) // 4, "random filler spreads over the vocabulary"
    else:
        assert bool((tokens == 0).all()), "token-0 filler"


def test_generator_is_deterministic_and_fills_noise():
    a = multiquery_ar(512, 8, 64, 8, seed=1)
    b = multiquery_ar(512, 8, 64, 8, seed=1)
    c = multiquery_ar(512, 8, 64, 8, seed=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    quiet, _ = multiquery_ar(512, 8, 64, 8, seed=1, random_non_queries=False)
    filler = (quiet == 0)
    assert bool(filler.any()) and bool((a[0][filler] != 0).any())


def test_power_law_favours_short_gaps():
    _, labels = multiquery_ar(8192, 400, 512, 8, seed=0)
    first_query = [(row != -100).nonzero().min().item() - 16 for row in labels]
    assert sorted(first_query)[len(first_query) // 2] < 40


@pytest.mark.parametrize("kwargs", [dict(input_seq_len=63), dict(num_kv_pairs=17), dict(vocab_size=32)])
def test_generator_rejects_bad_arguments(kwargs):
    args = dict(vocab_size=512, num_examples=2, input_seq_len=64, num_kv_pairs=8, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        multiquery_ar(**args)


def test_split_is_disjoint_and_reproducible():
    """A vocabulary with a few hundred distinct examples: without the de-duplication the sets overlap."""
    (train_x, train_y), (test_x, test_y) = mqar_split(10, 8, 2, seed=0, num_train=200, num_test=100)
    assert train_x.shape == (200, 8) and test_x.shape == (100, 8)

    def rows(x, y):
        return {tuple(r) for r in torch.cat([x, y], 1).tolist()}

    assert not rows(train_x, train_y) & rows(test_x, test_y), "train and test share an example"
    again = mqar_split(10, 8, 2, seed=0, num_train=200, num_test=100)
    assert torch.equal(again[0][0], train_x) and torch.equal(again[1][1], test_y)
    other = mqar_split(10, 8, 2, seed=1, num_train=200, num_test=100)
    assert not torch.equal(other[0][0], train_x)
    quiet = mqar_split(64, 16, 4, seed=0, num_train=20, num_test=10)[0][0]
    noisy = mqar_split(64, 16, 4, seed=0, num_train=20, num_test=10, random_non_queries=True)[0][0]
    assert int((quiet == 0).sum()) > int((noisy == 0).sum())
    with pytest.raises(ValueError, match="num_train"):
        mqar_split(10, 8, 2, seed=0, num_train=2000, num_test=100, max_draws=3)


def test_learning_rate_sweeps():
    bench = mqar_runner
    assert bench.lr_sweep("zoology", 2048) == pytest.approx([1e-4, 10 ** -(10 / 3), 10 ** -(8 / 3), 1e-2])
    assert bench.lr_sweep("paper", 256) == pytest.approx(bench.lr_sweep("zoology", 256))
    assert bench.lr_sweep("paper", 512) == pytest.approx([1e-5, 10 ** (-13 / 3), 10 ** (-11 / 3), 1e-3])
    assert bench.lr_sweep("paper", 2048) == [1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2]


def protocols(argv):
    args = mqar_runner.parse_args(argv + ["--state-dir", "unused", "--intermediate-size", "64"])
    return args, mqar_runner.planned_protocols(args)


def test_zoology_preset_is_the_issue_s_protocol():
    """Issue 13's numbers: batch 256/128/64/64 and 16/64/128/256 pairs at L = 256..2048, AdamW weight
    decay 0.1, embedding dropout 0.1, 64 epochs over 100,000 fixed examples, 3,000 test examples,
    token-0 filler, early stop above 99%, Zoology's four learning rates, seeds 0 and 1."""
    args, protos = protocols(["--mixers", "hdla"])
    assert args.preset == "zoology" and args.seeds == [0, 1] and args.mixers == ["hdla"]
    by_length = {p["length"]: p for p in protos}
    assert {n: p["batch_size"] for n, p in by_length.items()} == {256: 256, 512: 128, 1024: 64, 2048: 64}
    assert {n: p["num_kv_pairs"] for n, p in by_length.items()} == {256: 16, 512: 64, 1024: 128, 2048: 256}
    assert len(protos) == 4 * 4 * 2 and sorted({p["lr"] for p in protos}) == pytest.approx(np.logspace(-4, -2, 4))
    for p in protos:
        assert (p["weight_decay"], p["embedding_dropout"], p["early_stop"], p["filler"]) == (0.1, 0.1, 0.99, "zero")
        assert (p["data"], p["epochs"], p["num_train"], p["num_test"]) == ("fixed", 64, 100_000, 3_000)
        assert p["steps"] is None
    _, models = protocols([])
    configs = {p["mixer"]: p["model_config"] for p in models}
    assert set(configs) == {"hdla", "hdla_authors", "hdla_authors_conv", "gated_deltanet", "gated_deltaproduct_2"}
    assert configs["hdla_authors_conv"]["short_conv_size"] == 4 and configs["hdla_authors"]["short_conv_size"] == 0
    assert configs["gated_deltanet"]["head_dim_v"] == 2 * configs["gated_deltanet"]["head_dim"] == 128
    assert configs["gated_deltanet"]["mixer_kwargs"] == {"beta_range": 1.0}
    assert configs["gated_deltaproduct_2"]["head_dim_v"] == 128
    assert configs["gated_deltaproduct_2"]["mixer_kwargs"] == {"num_householder": 2, "beta_range": 2.0}


def test_legacy_preset_keeps_the_earlier_protocol():
    """Issue 5's protocol: 16,384-token batches, L/16 pairs, wd 0.01, no dropout, random filler,
    fresh batches for 3,000 steps, no early stop, the paper's sweeps, SwiGLU 512, baselines of then."""
    args, protos = protocols(["--preset", "legacy", "--lengths", "256", "512"])
    by_length = {p["length"]: p for p in protos}
    assert {n: (p["batch_size"], p["num_kv_pairs"]) for n, p in by_length.items()} == {256: (64, 16), 512: (32, 32)}
    for p in protos:
        assert (p["weight_decay"], p["embedding_dropout"], p["early_stop"], p["filler"]) == (0.01, 0.0, None, "random")
        assert (p["data"], p["steps"], p["num_test"], p["epochs"], p["num_train"]) == ("stream", 3000, 1000, None, None)
    assert sorted({p["lr"] for p in protos if p["length"] == 512}) == pytest.approx(np.logspace(-5, -3, 4))
    assert args.seeds == [0] and args.mixers == ["hdla", "gated_deltanet", "gated_deltaproduct_2"]
    defaults = mqar_runner.parse_args(["--preset", "legacy", "--state-dir", "unused"])
    assert defaults.intermediate_size == 512
    configs = {p["mixer"]: p["model_config"] for p in protos}
    assert configs["gated_deltanet"]["head_dim_v"] == 64
    assert configs["gated_deltaproduct_2"]["mixer_kwargs"] == {"num_householder": 2, "beta_range": 1.0}


@pytest.mark.parametrize("argv,match", [(["--steps", "10"], "--steps"),
                                        (["--preset", "legacy", "--epochs", "3"], "--epochs"),
                                        (["--preset", "legacy", "--mixers", "hdla_authors"], "--mixers"),
                                        (["--lengths", "300"], "--kv-pairs")])
def test_bad_arguments_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        mqar_runner.parse_args(argv + ["--state-dir", "unused"])


TINY = ["--tiny", "--device", "cpu", "--cpu-threads", "1"]


def curve_values(record):
    keys = ("epoch", "step", "lr", "train_loss", "test_loss", "test_accuracy", "steps")
    return [[c[k] for k in keys] for c in record["curve"]]


@pytest.mark.parametrize("preset,length_flag", [("zoology", ["--epochs", "3"]), ("legacy", ["--steps", "9"])])
def test_resume_gives_the_same_curve(tmp_path, preset, length_flag):
    """Three epochs (legacy: three blocks of 3 steps) at once, and one then a resume from the
    checkpoint (embedding dropout on for zoology: the RNG state must be restored too), give the same
    learning curve."""
    common = TINY + ["--preset", preset, "--mixers", "hdla", "--early-stop", "2"] + length_flag
    whole = mqar_runner.main(common + ["--state-dir", str(tmp_path / "a")])[0]
    cut = mqar_runner.main(common + ["--state-dir", str(tmp_path / "b"), "--stop-after-epochs", "1"])[0]
    assert cut["status"] == "paused" and cut["epochs_run"] == 1
    ckpt = next((tmp_path / "b").glob(f"{preset}_hdla_*/ckpt.pt"))
    assert torch.load(ckpt, weights_only=True)["curve"][0]["epoch"] == 1
    resumed = mqar_runner.main(common + ["--state-dir", str(tmp_path / "b")])[0]
    assert resumed["status"] == whole["status"] == "done" and resumed["epochs_run"] == 3
    assert resumed["stop_reason"] == ("epochs" if preset == "zoology" else "steps")
    assert curve_values(resumed) == curve_values(whole)
    assert [c["lr"] for c in whole["curve"]] == pytest.approx([3e-3, 3e-3 * 0.75, 3e-3 * 0.25])
    assert [c["step"] for c in whole["curve"]] == ([4, 8, 12] if preset == "zoology" else [3, 6, 9])
    assert not ckpt.exists() and (ckpt.parent / "DONE").exists()
    again = mqar_runner.main(common + ["--state-dir", str(tmp_path / "b")])[0]
    assert again["curve"] == resumed["curve"], "a finished run is not trained again"


def test_resume_refuses_another_protocol(tmp_path):
    common = TINY + ["--mixers", "hdla", "--epochs", "2", "--state-dir", str(tmp_path)]
    mqar_runner.main(common + ["--stop-after-epochs", "1"])
    folder = next(tmp_path.glob("zoology_hdla_*"))
    ckpt = torch.load(folder / "ckpt.pt", weights_only=True)
    ckpt["protocol"]["weight_decay"] = 0.01
    torch.save(ckpt, folder / "ckpt.pt")
    with pytest.raises(ValueError, match="weight_decay"):
        mqar_runner.main(common)


def test_presets_smoke_run_and_report(tmp_path):
    """Two tiny epochs of every model of both presets, then the report: the grid over the plan
    names the cells not run, the summary per model, the plot and the merged curves."""
    records = mqar_runner.main(TINY + ["--state-dir", str(tmp_path / "runs")])
    records += mqar_runner.main(TINY + ["--preset", "legacy", "--state-dir", str(tmp_path / "runs")])
    assert [r["protocol"]["mixer"] for r in records] == list(mqar_runner.MODELS["zoology"]) + list(
        mqar_runner.MODELS["legacy"])
    for r in records:
        assert r["status"] == "done" and r["epochs_run"] == 2 and r["params"] > 0 and r["ms_per_step"] > 0
        assert all(0 <= c["test_accuracy"] <= 1 and math.isfinite(c["test_loss"]) for c in r["curve"])
    queue = tmp_path / "queue.txt"
    mqar_runner.main(TINY + ["--seeds", "0", "1", "--write-queue", str(queue)])
    models = len(mqar_runner.MODELS["zoology"])
    assert len(queue.read_text().splitlines()) == 2 * models
    rows = mqar_report.main([str(tmp_path / "runs"), "--out-dir", str(tmp_path / "report"), "--queue", str(queue)])
    assert set(rows) == {("zoology", "zero", 16, m) for m in mqar_runner.MODELS["zoology"]} | {
        ("legacy", "random", 16, m) for m in mqar_runner.MODELS["legacy"]}
    table = (tmp_path / "report" / "mqar_results.md").read_text()
    assert "| zoology | zero | 16 | 4 | hdla_authors | 0.003 | " in table
    assert table.count("| not run |") == models
    assert f"Planned cells: {2 * models}; finished: {models}; unfinished: 0; not run: {models}." in table
    assert "| legacy | random | 16 | 4 | hdla (outside the plan) |" in table and "weight_decay: 0.01, 0.1" in table
    assert (tmp_path / "report" / "mqar_accuracy.png").stat().st_size > 0
    merged = json.loads((tmp_path / "report" / "mqar_runs.json").read_text())["runs"]
    assert sorted(r["run_id"] for r in merged) == sorted(r["run_id"] for r in records)


def cell_key(cell: dict) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in cell.items()))


def test_report_default_plan_is_the_zoology_table():
    cells = mqar_report.expected_cells()
    assert len(cells) == 4 * len(mqar_runner.MODELS["zoology"]) * 4 * 2
    queued = mqar_report.queue_cells(["tools/mqar_queue.txt"])
    assert sorted(map(cell_key, queued)) == sorted(map(cell_key, cells)), "tools/mqar_queue.txt is the default plan"
    assert {(c["length"], c["num_kv_pairs"]) for c in cells} == {(256, 16), (512, 64), (1024, 128), (2048, 256)}
    assert {c["seed"] for c in cells} == {0, 1} and {c["filler"] for c in cells} == {"zero"}


def test_queue_lines_name_their_runs(tmp_path):
    queue = tmp_path / "q.txt"
    mqar_runner.main(["--lengths", "256", "--seeds", "1", "--mixers", "gated_deltanet", "--intermediate-size", "64",
                      "--write-queue", str(queue), "--state-dir", str(tmp_path)])
    lines = queue.read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        run, *argv = line.split()
        assert "--intermediate-size 64" in line
        assert [mqar_runner.run_id(c) for c in mqar_report.planned_cells(argv)] == [run]


def test_unfinished_run_crosses_device_calls(tmp_path):
    """A run cut after one epoch on one machine, exported, collected here and restored on a fresh
    machine, ends with the curve of an uninterrupted run; finished runs come back as DONE."""
    base = TINY + ["--epochs", "3", "--early-stop", "2"]
    whole = mqar_runner.main(base + ["--mixers", "hdla", "gated_deltanet", "--state-dir", str(tmp_path / "whole")])
    first = tmp_path / "machine1"
    mqar_runner.main(base + ["--mixers", "gated_deltanet", "--state-dir", str(first)])
    mqar_runner.main(base + ["--mixers", "hdla", "--state-dir", str(first), "--stop-after-epochs", "1"])
    out, results, carry = tmp_path / "out", tmp_path / "results", tmp_path / "carry"
    exported = mqar_device.export(first, out, carry_mib=1, part_mib=0.05)
    assert exported["carried"] == [whole[0]["run_id"]] and len(list(out.glob("ckpt.tar.*"))) > 1
    collected = mqar_device.collect(out, results, carry)
    assert collected["updated"] == 2 and collected["parts"] == len(list(carry.glob("ckpt.tar.*")))
    assert "not run" in (results / "mqar_results.md").read_text()
    second = tmp_path / "machine2"
    assert mqar_device.restore(second, results, carry) == dict(finished=1, resumed=1)
    resumed = mqar_runner.main(base + ["--mixers", "hdla", "gated_deltanet", "--state-dir", str(second)])
    assert [curve_values(r) for r in resumed] == [curve_values(r) for r in whole]
    assert mqar_device.restore(second, results, carry) == dict(finished=0, resumed=0), "a DONE run takes no checkpoint"


def test_carried_checkpoint_survives_a_call_that_ran_nothing(tmp_path):
    """A run restored on a machine where it then never writes (it crashed at start) is carried on by
    that call's export: its record came with its checkpoint."""
    base = TINY + ["--epochs", "3", "--early-stop", "2", "--mixers", "hdla"]
    first = tmp_path / "machine1"
    [record] = mqar_runner.main(base + ["--state-dir", str(first), "--stop-after-epochs", "1"])
    out, results, carry = tmp_path / "out", tmp_path / "results", tmp_path / "carry"
    mqar_device.export(first, out, carry_mib=1, part_mib=0.05)
    mqar_device.collect(out, results, carry)
    second = tmp_path / "machine2"
    assert mqar_device.restore(second, results, carry) == dict(finished=0, resumed=1)
    again = mqar_device.export(second, tmp_path / "out2", carry_mib=1, part_mib=0.05)
    assert again["carried"] == [record["run_id"]]


def test_presets_are_faithful_and_balanced():
    """At the paper's sizes each zoology model lands within 1% of 1.65M parameters; the authors' HDLA
    has a bias-free low-rank decay with lambda ~ 0.5 at init and one norm over all heads."""
    bench = mqar_runner
    args = bench.parse_args(["--lengths", "256", "--state-dir", "unused"])
    for mixer in bench.MODELS["zoology"]:
        width = bench.balanced_intermediate_size(args, mixer)
        params = bench.count_params(bench.model_config(args, mixer, width))
        assert abs(params - 1.65e6) < 0.01 * 1.65e6, (mixer, params)
    model = bench.build_model(bench.model_config(args, "hdla_authors", 64), seed=0, device="cpu")
    mixer = model.model.layers[0].mixer
    decay = mixer.directions[0]["decay"].logits
    assert decay.down.bias is None and decay.up.bias is None and mixer.norm.weight.numel() == 2 * 64
    with torch.no_grad():
        lam = torch.sigmoid(decay(torch.randn(4, 32, 128)))
    assert abs(float(lam.mean()) - 0.5) < 0.02 and float((lam - 0.5).abs().max()) < 0.1
    assert not hasattr(mixer, "conv")


def test_carry_prefers_runs_that_left_chance(tmp_path):
    """With room for one checkpoint, a run that is learning is carried before one with more training
    done that is still at chance; between runs at chance, the one with more training done."""
    def unfinished(name, steps, best, size):
        folder = tmp_path / name
        folder.mkdir()
        record = dict(protocol=dict(batch_size=256, length=256), curve=[dict(step=steps)], epochs_run=steps // 391,
                      best_accuracy=best, status="paused")
        (folder / "run.json").write_text(json.dumps(record))
        (folder / "ckpt.pt").write_bytes(b"\0" * size)

    unfinished("at_chance_long", 3910, 0.0004, 1000)
    unfinished("learning_short", 782, 0.30, 1000)
    assert mqar_device.pick_carried(tmp_path, 1500) == [("learning_short", 2)]
    assert mqar_device.pick_carried(tmp_path, 2000) == [("learning_short", 2), ("at_chance_long", 10)]
    unfinished("at_chance_short", 391, None, 1000)
    (tmp_path / "learning_short" / "DONE").write_text("early_stop\n")
    assert mqar_device.pick_carried(tmp_path, 1500) == [("at_chance_long", 10)]


@pytest.mark.parametrize("mixer", ["hdla", "gated_deltanet"])
def test_training_query_logits_need_no_sync_and_match_the_boolean_index(mixer):
    """The training step's query rows by a static-shape gather (no host sync) give the same loss and the same
    (logit row, target) pairs as the boolean index, also where an example holds fewer queries than the count
    (its extra rows carry -100 and cross-entropy ignores them)."""
    args = mqar_runner.parse_args(TINY)
    mqar_runner.apply_preset(args)
    model = mqar_runner.build_model(mqar_runner.model_config(args, mixer, 16), 0, "cpu").eval()
    inputs, labels = multiquery_ar(args.vocab_size, 3, 32, 4, seed=5, random_non_queries=False)
    labels[1, (labels[1] != -100).nonzero()[0, 0]] = -100  # example 1: three queries, not four
    with torch.no_grad():
        ref_logits, ref_targets = mqar_runner.query_logits(model, inputs, labels, 0.0)
        logits, targets = mqar_runner.query_logits(model, inputs, labels, 0.0, queries=4)
    assert logits.shape[0] == 12 and int((targets == -100).sum()) == 1
    kept = targets != -100
    assert torch.equal(targets[kept], ref_targets)
    assert torch.allclose(logits[kept], ref_logits, atol=1e-5, rtol=1e-5)
    assert torch.allclose(torch.nn.functional.cross_entropy(logits, targets),
                          torch.nn.functional.cross_entropy(ref_logits, ref_targets), atol=1e-6)
    assert mqar_runner.query_positions(labels, 4)[1, :3].tolist() == (labels[1] != -100).nonzero().flatten().tolist()
