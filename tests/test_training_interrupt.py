"""Records that survive a resume.

One uninterrupted reference run (in this process) against a run killed between logging an
epoch and checkpointing it, then resumed: it must give the reference's metrics, weights and
TensorBoard points, each step exactly once.
"""
from __future__ import annotations


import hdla_vision  # noqa: F401  (registers the timm models)
import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hdla_vision.training import checkpoint as ckpt
from hdla_vision.training import runner
from hdla_vision.training.config import config_from_dict
from hdla_vision.training.records import curve_series, read_metrics
from tests.training_helpers import (  # noqa: F401  (fixtures)
    data_dir, fresh_accelerate_state, reset_accelerate_state, tiny_config_dict)

TRAIN = {"checkpoint_every_steps": 4, "keep_checkpoints": 10, "log_every_steps": 1}
TIMING = ("epoch_seconds", "images_per_second")  # wall-clock values differ between any two runs


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """Two epochs of 7 steps, uninterrupted, every step logged."""
    reset_accelerate_state()
    out = tmp_path_factory.mktemp("reference")
    runner.train(config_from_dict(tiny_config_dict(data_dir, train=TRAIN)), out)
    return out


def scalars(run_dir, tag: str) -> list:
    """``(step, value)`` of every point TensorBoard shows for ``tag`` (purged points removed)."""
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def without_timing(rows: list) -> list:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def assert_same_run(run_dir, reference_dir) -> None:
    """Same metrics rows, weights and TensorBoard points as the reference, each step once."""
    assert without_timing(read_metrics(run_dir / "metrics.jsonl")) == \
        without_timing(read_metrics(reference_dir / "metrics.jsonl"))
    for name in ("model.safetensors", "model_ema.safetensors"):
        expected, got = load_file(str(reference_dir / name)), load_file(str(run_dir / name))
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6, msg=f"{name}:{key}")
    for tag in ("step/loss", "step/lr", "epoch/train_loss", "epoch/val_top1"):
        got, expected = scalars(run_dir, tag), scalars(reference_dir, tag)
        assert [s for s, _ in got] == [s for s, _ in expected], tag  # every step, once, in order
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], abs=1e-5), tag
    assert [s for s, _ in scalars(run_dir, "step/loss")] == list(range(1, 15))
    assert [s for s, _ in scalars(run_dir, "epoch/train_loss")] == [7, 14]
    assert [e for e, _ in curve_series(read_metrics(run_dir / "metrics.jsonl"))["train_loss"]] == [0, 1]
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_logs_survive_a_kill_between_logging_and_checkpointing(reference, data_dir, tmp_path, monkeypatch):
    """Killed after epoch 1's row and step-14 points were written, before its checkpoint: resume from step 12."""
    config = config_from_dict(tiny_config_dict(data_dir, train=TRAIN))
    real_save = ckpt.save_checkpoint

    def die_before_step_14(accelerator, output_dir, state, *args, **kwargs):
        if state.global_step == 14:
            raise KeyboardInterrupt("simulated kill before the step-14 checkpoint")
        return real_save(accelerator, output_dir, state, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", die_before_step_14)
    with pytest.raises(KeyboardInterrupt):
        runner.train(config, tmp_path)
    monkeypatch.setattr(ckpt, "save_checkpoint", real_save)
    assert ckpt.list_checkpoints(tmp_path / "checkpoints")[-1].name == "step_00000012"
    before = (tmp_path / "metrics.jsonl").read_bytes()
    assert [r["epoch"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]  # epoch 1 logged, not saved
    assert [s for s, _ in scalars(tmp_path, "step/loss")] == list(range(1, 15))

    reset_accelerate_state()
    runner.train(config, tmp_path, resume="auto")
    after = (tmp_path / "metrics.jsonl").read_bytes()
    first_line = before.split(b"\n", 1)[0] + b"\n"
    assert after.startswith(first_line)  # epoch 0's line is kept as it was; epoch 1's is written once
    assert_same_run(tmp_path, reference)
