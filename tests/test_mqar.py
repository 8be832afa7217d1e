"""MQAR generator properties (Zoology's definition) and a few-step smoke run of benchmarks/mqar.py."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hdla_vision.lm.mqar import multiquery_ar

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("vocab,length,pairs", [(8192, 256, 32), (100, 64, 16), (300, 128, 4)])
def test_generator_properties(vocab, length, pairs):
    inputs, labels = multiquery_ar(vocab, 50, length, pairs, seed=3)
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
    spec = importlib.util.spec_from_file_location("mqar_benchmark", ROOT / "benchmarks" / "mqar.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_paper_sweeps():
    bench = load_benchmark()
    assert len(bench.paper_lr_sweep(256)) == 4 and bench.paper_lr_sweep(256)[0] == pytest.approx(1e-4)
    assert bench.paper_lr_sweep(512)[-1] == pytest.approx(1e-3)
    assert bench.paper_lr_sweep(2048) == [1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2]


def test_benchmark_batch_and_pairs_follow_each_length():
    bench = load_benchmark()
    args = bench.parse_args(["--lengths", "1024", "256", "--out-dir", "unused"])
    assert args.lengths == [256, 1024]
    assert [bench.batch_size_for(args, n) for n in args.lengths] == [64, 16]  # Zoology: 16384 tokens a batch
    assert [bench.kv_pairs_for(args, n) for n in args.lengths] == [16, 64]  # Zoology: L / 16 pairs
    args = bench.parse_args(["--lengths", "1024", "256", "--batch-size", "8", "32", "--num-kv-pairs", "40", "10",
                             "--out-dir", "unused"])
    assert (bench.batch_size_for(args, 256), bench.kv_pairs_for(args, 256)) == (32, 10)
    assert (bench.batch_size_for(args, 1024), bench.kv_pairs_for(args, 1024)) == (8, 40)
    assert bench.batch_size_for(bench.parse_args(["--lengths", "512", "256", "--batch-size", "4"]), 512) == 4
    with pytest.raises(ValueError, match="batch-size"):
        bench.parse_args(["--lengths", "256", "512", "--batch-size", "1", "2", "3"])


def test_benchmark_smoke_run(tmp_path, capsys):
    bench = load_benchmark()
    best = bench.main(["--lengths", "16", "--vocab-size", "64", "--d-model", "16", "--num-heads", "2",
                       "--head-dim", "8", "--intermediate-size", "32", "--steps", "2", "--batch-size", "4",
                       "--test-examples", "8", "--eval-batch-size", "8", "--lrs", "1e-3", "--kv-divisor", "4",
                       "--device", "cpu", "--out-dir", str(tmp_path)])
    assert set(best) == {("hdla", 16, 4), ("gated_deltanet", 16, 4), ("gated_deltaproduct_2", 16, 4)}
    runs = json.loads((tmp_path / "mqar_runs.json").read_text())["runs"]
    assert len(runs) == 3 and all(r["steps"] == 2 and 0.0 <= r["accuracy"] <= 1.0 for r in runs)
    assert "| hdla | 16 | 4 |" in (tmp_path / "mqar_results.md").read_text()
    assert (tmp_path / "mqar_accuracy.png").stat().st_size > 0
    assert "3 runs" in capsys.readouterr().out
    merged = bench.main(["--merge-from", str(tmp_path), str(tmp_path), "--out-dir", str(tmp_path / "merged")])
    assert set(merged) == set(best)
    assert "merged from" in (tmp_path / "merged" / "mqar_results.md").read_text()
