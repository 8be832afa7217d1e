"""MQAR at the Log-Linear Attention paper's Table 2 setting (``--preset loglinear_table2``,
hdla_vision/lm/mqar_loglinear.py): the preset's values, the Zoology model at every width, the data
mixture, Zoology's per-example accuracy, a smoke run with resume, and the Table-2 report."""
import math
import types

import numpy as np
import pytest
import torch

from hdla_vision.lm import mqar_loglinear as table2
from hdla_vision.lm import mqar_report, mqar_runner
from hdla_vision.lm.zoology_lm import BaseConv, ZoologyLM

PRESET = ["--preset", table2.PRESET]


def preset_args(*argv):
    return mqar_runner.parse_args(PRESET + list(argv) + ["--state-dir", "unused"])


def test_preset_values_and_queue_order():
    """Zoology's Based-era sweep at the paper's widths: 4 models x 3 widths x 4 rates x 5 seeds,
    32 epochs, batch 256, AdamW 0.1, dropout 0.1, early stop above 99%, random filler; the queue
    runs the smallest width first, then by seed, linear models before log-linear ones."""
    args = preset_args()
    assert (args.epochs, args.batch_size, args.weight_decay, args.embedding_dropout, args.early_stop) == (
        32, [256], 0.1, 0.1, 0.99)
    assert (args.filler, args.vocab_size, args.seeds, args.dims, args.lengths) == (
        "random", 8192, [0, 1, 2, 3, 4], [16, 32, 64], [256])
    runs = mqar_runner.plan(args)
    assert len(runs) == 4 * 3 * 4 * 5
    assert sorted({lr for _, _, lr, _, _ in runs}) == pytest.approx([1e-3, 10 ** -2.5, 1e-2, 10 ** -1.5])
    assert [d for *_, d in runs] == sorted(d for *_, d in runs), "smallest width first"
    first = runs[:16]
    assert {(m, s) for m, _, _, s, _ in first} == {(m, 0) for m in table2.MODELS}
    assert [m for m, *_ in first[::4]] == ["gated_deltanet", "loglinear_gated_deltanet", "hdla", "loglinear_hdla"]


@pytest.mark.parametrize("argv,match", [(["--lengths", "512"], "--lengths"), (["--kv-pairs", "16"], "--kv-pairs"),
                                        (["--d-model", "32"], "--d-model"), (["--dims", "33"], "--dims"),
                                        (["--batch-size", "8", "16"], "--batch-size")])
def test_bad_arguments_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        preset_args(*argv)


@pytest.mark.parametrize("mixer", list(table2.MODELS))
@pytest.mark.parametrize("dim", [16, 32, 64])
def test_each_model_builds_at_each_width(mixer, dim):
    """Zoology's model: BaseConv then the mixer, no MLP, tied head; one head at 16 and two above,
    key dim = width / heads, value dim doubled for Gated DeltaNet; the log-linear ones have 9 levels.
    The parameter count in the protocol is the built model's."""
    args = preset_args("--mixers", mixer, "--dims", str(dim), "--seeds", "0", "--lrs", "1e-3")
    proto = mqar_runner.planned_protocols(args)[0]
    model = mqar_runner.build_model(mqar_runner.model_config(args, mixer, None, dim), 0, "cpu")
    assert isinstance(model, ZoologyLM) and len(model.layers) == 2
    assert isinstance(model.layers[0].sequence_mixer, BaseConv)
    layer = model.layers[1].sequence_mixer
    heads = 1 if dim == 16 else 2
    expand = 2 if "gated_deltanet" in mixer else 1
    assert (layer.mixer_name, layer.num_heads, layer.head_dim, layer.head_dim_v) == (
        mixer, heads, dim // heads, expand * dim // heads)
    assert layer.log_linear == mixer.startswith("loglinear_")
    assert not layer.log_linear or layer.num_levels == 9
    assert not any("mlp" in name for name, _ in model.named_modules())
    assert model.lm_head.weight is model.embed_tokens.weight
    assert proto["params"] == sum(p.numel() for p in model.parameters()) > 8192 * dim
    assert proto["model_config"]["layers"] == ["base_conv", mixer] and proto["d_model"] == dim
    logits = model(torch.randint(8192, (2, 16)))
    assert logits.shape == (2, 16, 8192) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("mixer", ["gated_deltanet", "loglinear_hdla"])
def test_zoology_model_is_causal(mixer):
    """Changing the token at position 9 leaves every earlier output unchanged (the BaseConv's
    padding is cut on the right), and changes a later one."""
    args = mqar_runner.parse_args(PRESET + ["--tiny", "--mixers", mixer, "--state-dir", "unused"])
    model = mqar_runner.build_model(mqar_runner.model_config(args, mixer, None, 16), 0, "cpu").eval()
    tokens = torch.randint(64, (1, 24))
    changed = tokens.clone()
    changed[0, 9] = (tokens[0, 9] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_mixture_has_the_pair_counts_it_claims(tmp_path):
    """Zoology's segments: 4 to 64 pairs, lengths 64 to 256 (training) and the test segments without
    the length-generalisation ones; every example of a segment has its length and exactly its number
    of queries, each answered by a value shown before; the epoch's batches go segment by segment in
    the same order every epoch."""
    assert [s[1] for s in table2.TRAIN_SEGMENTS] == [4, 8, 16, 32, 64]
    assert max(s[0] for s in table2.TRAIN_SEGMENTS + table2.TEST_SEGMENTS) == 256
    assert [s[1] for s in table2.TEST_SEGMENTS] == [4, 8, 16, 32, 64]
    assert sum(s[2] for s in table2.TRAIN_SEGMENTS) == 180_000 and {s[2] for s in table2.TEST_SEGMENTS} == {1000}
    small = dict(train=[[length, pairs, 3] for length, pairs, _ in table2.TRAIN_SEGMENTS],
                 test=[[length, pairs, 2] for length, pairs, _ in table2.TEST_SEGMENTS])
    args = types.SimpleNamespace(data_dir=str(tmp_path), vocab_size=8192)
    proto = dict(segments=small, seed=3, filler="random", lr=1e-2, epochs=4, batch_size=2)
    train, test = mqar_runner.load_mixture(args, proto)
    for part, spec in ((train, small["train"]), (test, small["test"])):
        for (x, y), (length, pairs, n) in zip(part, spec):
            assert x.shape == y.shape == (n, length)
            assert ((y != -100).sum(1) == pairs).all()
            for row in range(n):
                for pos in (y[row] != -100).nonzero().flatten().tolist():
                    assert int(y[row, pos]) in x[row, :pos + 1].tolist()
    again = mqar_runner.load_mixture(args, proto)
    assert torch.equal(again[0][2][0], train[2][0]), "cached and reproducible"
    other = mqar_runner.load_mixture(args, dict(proto, seed=4))
    assert not torch.equal(other[0][2][0], train[2][0])
    epoch0 = [(x.shape[1], len(x)) for _, x, _ in mqar_runner.mixture_batches(proto, train, 0)]
    assert epoch0 == [(64, 2), (64, 1), (128, 2), (128, 1)] + [(256, 2), (256, 1)] * 3
    lrs = [lr for lr, *_ in mqar_runner.mixture_batches(proto, train, 1)]
    assert lrs == pytest.approx([1e-2 * 0.5 * (1 + math.cos(math.pi / 4))] * 10)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(mqar_runner.mixture_batches(proto, train, 0),
                                                       mqar_runner.mixture_batches(proto, train, 3)))


def test_accuracy_is_zoology_s_per_example_mean():
    """Example 0: 1 of 4 queries right, example 1: its one query right -> [0.25, 1.0] (mean 0.625,
    where the share of all queries would be 0.4)."""
    right = torch.tensor([True, False, False, False, True])
    rows = torch.tensor([0, 0, 0, 0, 1])
    assert mqar_runner.example_accuracy(right, rows, 2).tolist() == [0.25, 1.0]
    with pytest.raises(ValueError, match="query"):
        mqar_runner.example_accuracy(right, rows, 3)


TINY = PRESET + ["--tiny", "--device", "cpu", "--cpu-threads", "1"]


def test_smoke_run_resume_and_report(tmp_path):
    """One tiny epoch of each model, the per-pair-count accuracies recorded; Gated DeltaNet cut after
    one of two epochs and resumed gives the uninterrupted curve; the report of those runs against a
    queue names the cells not run."""
    records = mqar_runner.main(TINY + ["--epochs", "1", "--state-dir", str(tmp_path / "runs")])
    assert [r["protocol"]["mixer"] for r in records] == list(table2.MODELS)
    for r in records:
        assert r["status"] == "done" and r["epochs_run"] == 1 and r["params"] > 0
        point = r["curve"][0]
        assert set(point["test_accuracy_by_pairs"]) == {"2", "4", "8"} and point["steps"] == 2 + 1 + 1
        assert 0 <= point["test_accuracy"] <= 1 and math.isfinite(point["test_loss"])
        assert np.mean(list(point["test_accuracy_by_pairs"].values())) == pytest.approx(point["test_accuracy"])
    common = TINY + ["--mixers", "gated_deltanet", "--epochs", "2", "--early-stop", "2"]
    whole = mqar_runner.main(common + ["--state-dir", str(tmp_path / "a")])[0]
    mqar_runner.main(common + ["--state-dir", str(tmp_path / "b"), "--stop-after-epochs", "1"])
    resumed = mqar_runner.main(common + ["--state-dir", str(tmp_path / "b")])[0]
    keys = ("train_loss", "test_loss", "test_accuracy", "lr", "step")
    assert [[c[k] for k in keys] for c in resumed["curve"]] == [[c[k] for k in keys] for c in whole["curve"]]
    queue = tmp_path / "queue.txt"
    mqar_runner.main(TINY + ["--seeds", "0", "1", "--write-queue", str(queue), "--state-dir", str(tmp_path)])
    assert len(queue.read_text().splitlines()) == 8
    mqar_report.main([str(tmp_path / "runs"), "--out-dir", str(tmp_path / "report"), "--queue", str(queue)])
    text = (tmp_path / "report" / "mqar_results.md").read_text()
    assert "Planned runs: 8; finished: 4; unfinished: 0; not run: 4." in text
    assert text.count("| not run |") == 4 and "[1/2 runs done]" in text


def fake_record(mixer, dim, lr, seed, accuracy, status="done"):
    """A run record as the runner writes it (only the fields the report reads)."""
    proto = dict(preset=table2.PRESET, mixer=mixer, d_model=dim, lr=lr, seed=seed, filler="random",
                 length=256, num_kv_pairs=None, data="mixture", steps=None)
    return dict(run_id=table2.run_id(proto), protocol=proto, params=1000 * dim, status=status,
                stop_reason="early_stop" if accuracy > 0.99 else ("epochs" if status == "done" else None),
                best_accuracy=accuracy, epochs_run=3, epochs_planned=32)


def test_table2_from_fake_records(tmp_path):
    """Best lr by seed mean, then mean (sample std) over its seeds; a cell with some runs says how many
    of its planned runs are done; a cell without runs says "not run"; runs outside the plan are kept
    out of the table."""
    queue = tmp_path / "q.txt"
    mqar_runner.main(PRESET + ["--mixers", "gated_deltanet", "loglinear_gated_deltanet", "--dims", "16", "32",
                               "--seeds", "0", "1", "2", "--lrs", "1e-3", "1e-2", "--write-queue", str(queue),
                               "--state-dir", str(tmp_path)])
    records = [fake_record("gated_deltanet", 16, 1e-3, s, a) for s, a in enumerate([0.39, 0.40, 0.41])]
    records += [fake_record("gated_deltanet", 16, 1e-2, s, a) for s, a in enumerate([0.50, 0.10, 0.0])]
    records += [fake_record("gated_deltanet", 32, 1e-2, s, a) for s, a in enumerate([0.995, 0.999, 0.993])]
    records += [fake_record("gated_deltanet", 32, 1e-3, s, 0.5) for s in range(3)]
    records += [fake_record("loglinear_gated_deltanet", 16, 1e-2, 0, 0.30),
                fake_record("loglinear_gated_deltanet", 16, 1e-2, 1, 0.50, status="paused"),
                fake_record("loglinear_gated_deltanet", 16, 3e-2, 2, 0.90)]  # outside the plan
    summary = mqar_report.write_report(records, tmp_path / "out", [str(queue)], runs_json=False)
    cell = summary[("gated_deltanet", 16)]
    assert cell["lr"] == 1e-3 and cell["mean"] == pytest.approx(0.40) and cell["std"] == pytest.approx(0.01)
    assert summary[("gated_deltanet", 32)]["std"] == pytest.approx(np.std([0.995, 0.999, 0.993], ddof=1))
    assert summary[("loglinear_gated_deltanet", 16)]["mean"] == pytest.approx(0.40)
    text = (tmp_path / "out" / "mqar_results.md").read_text()
    assert "| gated_deltanet | 40.00 (1.00) | 99.57 (0.31) |" in text
    assert "| loglinear_gated_deltanet | 40.00 (14.14) [1/6 runs done, 1 unfinished] | not run |" in text
    assert "loglinear_gated_deltanet (outside the plan) | 16 | 0.03 |" in text
    assert "Planned runs: 24; finished: 13; unfinished: 1; not run: 10." in text
    empty = mqar_report.write_report([], tmp_path / "empty", [str(queue)], runs_json=False)
    assert all(c["runs"] == 0 for c in empty.values()) and len(empty) == 4
    text = (tmp_path / "empty" / "mqar_results.md").read_text()
    assert "| gated_deltanet | not run | not run |\n| loglinear_gated_deltanet | not run | not run |" in text
    assert "Planned runs: 24; finished: 0; unfinished: 0; not run: 24." in text
