"""MQAR generator properties (Zoology's definition), the fixed split, and the MQAR runner's runs (hdla_vision/lm/mqar_runner.py)
(resume from a per-epoch checkpoint, a smoke run of each preset, the report)."""
import json
import math
from pathlib import Path

import pytest
import torch

from hdla_vision.lm import mqar_report, mqar_runner
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


def load_benchmark():
    return mqar_runner


def test_benchmark_paper_sweeps():
    bench = load_benchmark()
    assert len(bench.paper_lr_sweep(256)) == 4 and bench.paper_lr_sweep(256)[0] == pytest.approx(1e-4)
    assert bench.paper_lr_sweep(512)[-1] == pytest.approx(1e-3)
    assert bench.paper_lr_sweep(2048) == [1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2]


def test_split_is_disjoint_and_reproducible():
    """A vocabulary with a few hundred distinct examples: without the de-duplication the sets overlap."""
    (train_x, train_y), (test_x, test_y) = mqar_split(10, 8, 2, seed=0, num_train=200, num_test=100)
    assert train_x.shape == (200, 8) and test_x.shape == (100, 8)
    rows = lambda x, y: {tuple(r) for r in torch.cat([x, y], 1).tolist()}
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


TINY = ["--tiny", "--device", "cpu", "--cpu-threads", "1"]


def run_json(state: Path, preset="hdla"):
    return json.loads(next(state.glob(f"{preset}_L16_*/run.json")).read_text())


def test_resume_gives_the_same_curve(tmp_path):
    """Three epochs at once, and one epoch then a resume from the checkpoint (embedding dropout on:
    the RNG state must be restored too), give the same learning curve and weights."""
    bench = load_benchmark()
    common = TINY + ["--presets", "hdla", "--epochs", "3", "--early-stop", "2"]
    whole = bench.main(common + ["--state-dir", str(tmp_path / "a")])[0]
    cut = bench.main(common + ["--state-dir", str(tmp_path / "b"), "--stop-after-epochs", "1"])[0]
    assert cut["status"] == "paused" and cut["epochs_run"] == 1
    ckpt = next((tmp_path / "b").glob("hdla_*/ckpt.pt"))
    assert torch.load(ckpt, weights_only=True)["curve"][0]["epoch"] == 1
    resumed = bench.main(common + ["--state-dir", str(tmp_path / "b")])[0]
    assert resumed["status"] == whole["status"] == "done" and resumed["stop_reason"] == "epochs"
    keys = ("epoch", "lr", "train_loss", "test_loss", "test_accuracy", "steps")
    assert [[c[k] for k in keys] for c in resumed["curve"]] == [[c[k] for k in keys] for c in whole["curve"]]
    assert [c["lr"] for c in whole["curve"]] == pytest.approx([3e-3, 3e-3 * 0.75, 3e-3 * 0.25])
    assert not ckpt.exists() and (ckpt.parent / "DONE").exists()
    again = bench.main(common + ["--state-dir", str(tmp_path / "b")])[0]
    assert again["curve"] == resumed["curve"], "a finished run is not trained again"


def test_resume_refuses_another_protocol(tmp_path):
    bench = load_benchmark()
    common = TINY + ["--presets", "hdla", "--epochs", "2", "--state-dir", str(tmp_path)]
    bench.main(common + ["--stop-after-epochs", "1"])
    folder = next(tmp_path.glob("hdla_*"))
    ckpt = torch.load(folder / "ckpt.pt", weights_only=True)
    ckpt["protocol"]["weight_decay"] = 0.01
    torch.save(ckpt, folder / "ckpt.pt")
    with pytest.raises(ValueError, match="weight_decay"):
        bench.main(common)


def test_presets_smoke_run_and_report(tmp_path):
    """Two tiny epochs of every preset, then the report's table, plot and merged curves."""
    bench = load_benchmark()
    records = bench.main(TINY + ["--state-dir", str(tmp_path / "runs")])
    assert [r["protocol"]["preset"] for r in records] == list(bench.PRESETS)
    for r in records:
        assert r["status"] == "done" and r["epochs_run"] == 2 and r["params"] > 0 and r["ms_per_step"] > 0
        assert all(0 <= c["test_accuracy"] <= 1 and math.isfinite(c["test_loss"]) for c in r["curve"])
        assert r["protocol"]["weight_decay"] == 0.1 and r["protocol"]["filler"] == "zero"
    configs = {r["protocol"]["preset"]: r["protocol"]["model_config"] for r in records}
    assert configs["hdla_authors"]["short_conv_size"] == 0 and configs["hdla"]["short_conv_size"] == 4
    assert configs["gated_deltanet"]["head_dim_v"] == 2 * configs["gated_deltanet"]["head_dim"]
    assert configs["gated_deltaproduct_2"]["mixer_kwargs"] == {"num_householder": 2, "beta_range": 2.0}
    report = mqar_report
    rows = report.main([str(tmp_path / "runs"), "--out-dir", str(tmp_path / "report")])
    assert set(rows) == {(p, "zero", 16) for p in bench.PRESETS}
    table = (tmp_path / "report" / "mqar_results.md").read_text()
    assert "| hdla_authors | zero | 16 | 4 |" in table and "weight_decay: 0.1" in table
    assert (tmp_path / "report" / "mqar_accuracy.png").stat().st_size > 0
    merged = json.loads((tmp_path / "report" / "mqar_runs.json").read_text())["runs"]
    assert sorted(r["run_id"] for r in merged) == sorted(r["run_id"] for r in records)


def test_presets_are_faithful_and_balanced():
    """At the paper's sizes each preset lands within 1% of 1.65M parameters; the authors' HDLA has a
    bias-free low-rank decay with lambda ~ 0.5 at init and one norm over all heads."""
    bench = load_benchmark()
    args = bench.parse_args(["--lengths", "256", "--state-dir", "unused"])
    for preset in bench.PRESETS:
        width = bench.balanced_intermediate_size(args, preset)
        params = bench.count_params(bench.model_config(args, preset, width))
        assert abs(params - 1.65e6) < 0.01 * 1.65e6, (preset, params)
    model = bench.build_model(bench.model_config(args, "hdla_authors", 64), seed=0, device="cpu")
    mixer = model.model.layers[0].mixer
    decay = mixer.directions[0]["decay"].logits
    assert decay.down.bias is None and decay.up.bias is None and mixer.norm.weight.numel() == 2 * 64
    with torch.no_grad():
        lam = torch.sigmoid(decay(torch.randn(4, 32, 128)))
    assert abs(float(lam.mean()) - 0.5) < 0.02 and float((lam - 0.5).abs().max()) < 0.1
    assert not hasattr(mixer, "conv")
