"""Ctrl-C during training and records that survive a resume.

One uninterrupted reference run (in this process) against: a CLI run in a subprocess whose
process group gets SIGINT mid-training and is resumed with the command it prints, and a run
killed between logging an epoch and checkpointing it. Both resumed runs must give the
reference's metrics, weights and TensorBoard points, each step exactly once.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import hdla_vision  # noqa: F401  (registers the timm models)
import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hdla_vision.training import checkpoint as ckpt
from hdla_vision.training import runner
from hdla_vision.training.config import config_from_dict
from hdla_vision.training.interrupt import StopOnInterrupt
from hdla_vision.training.records import curve_series, read_metrics
from tests.training_helpers import REPO, cli_module, reset_accelerate_state, tiny_config_dict, write_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singletons, per test

TRAIN = {"checkpoint_every_steps": 4, "keep_checkpoints": 10, "log_every_steps": 1}
TIMING = ("epoch_seconds", "images_per_second")  # wall-clock values differ between any two runs
RESUME_MARK = "it resumes exactly with: "


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
    # floats to 1e-6: an evaluation in another process may sum in another order (seen: EMA val loss
    # off by 2e-8 in CI); counts, steps and accuracies stay exact
    got, want = (without_timing(read_metrics(d / "metrics.jsonl")) for d in (run_dir, reference_dir))
    assert len(got) == len(want)
    for row, ref in zip(got, want):
        assert row.keys() == ref.keys()
        assert {k: v for k, v in row.items() if not isinstance(v, float)} == \
            {k: v for k, v in ref.items() if not isinstance(v, float)}
        assert {k: v for k, v in row.items() if isinstance(v, float)} == \
            pytest.approx({k: v for k, v in ref.items() if isinstance(v, float)}, rel=1e-6)
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


def test_ctrl_c_checkpoints_prints_the_resume_command_and_resumes_exactly(reference, data_dir, tmp_path):
    """SIGINT to the CLI's process group (as a terminal's Ctrl-C, DataLoader worker included)."""
    config = write_config(tmp_path / "tiny.yaml", tiny_config_dict(data_dir, data={"num_workers": 1}, train=TRAIN))
    out = tmp_path / "run"
    command = [sys.executable, "train_imagenet.py", "--config", str(config), "--output-dir", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(tmp_path / "stderr.txt", "w") as err_file:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err_file, text=True,
                                start_new_session=True)
        for line in proc.stdout:  # printed just before the first step, with the Ctrl-C handler in place
            if "batches per process per epoch" in line:
                os.killpg(proc.pid, signal.SIGINT)
                break
        stdout, _ = proc.communicate(timeout=120)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "epoch 2/2" not in stdout, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if RESUME_MARK in line]
    assert len(lines) == 1 and lines[0].startswith("interrupted: saved "), stderr[-3000:]
    assert "(epoch 1, batch " in lines[0], "the stop should come mid-epoch (the signal came before the first step)"
    resume = shlex.split(lines[0].split(RESUME_MARK, 1)[1])
    checkpoint = resume[resume.index("--resume") + 1]
    assert resume == [*command, "--resume", checkpoint] and checkpoint.startswith(str(out / "checkpoints"))
    assert ckpt.list_checkpoints(out / "checkpoints")[-1].name == os.path.basename(checkpoint)

    resumed = subprocess.run(resume, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint}" in resumed.stdout
    assert_same_run(out, reference)


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


def test_a_second_ctrl_c_stops_at_once():
    """Real SIGINTs to this process: the first requests a stop, a repeat within the window is the same
    Ctrl-C, a later one raises KeyboardInterrupt; the previous handler is restored afterwards."""
    previous = signal.getsignal(signal.SIGINT)
    with StopOnInterrupt(announce=False, repeat_after=0.3) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.requested
        os.kill(os.getpid(), signal.SIGINT)  # forwarded duplicate (accelerate launch)
        time.sleep(0.05)
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
    assert signal.getsignal(signal.SIGINT) is previous


def test_dataloader_workers_leave_ctrl_c_to_the_training_process(data_dir):
    """A terminal's Ctrl-C reaches the loader's worker processes too: they must keep serving batches."""
    import multiprocessing

    from hdla_vision.training.data import build_data
    from hdla_vision.training.models import create_model

    config = config_from_dict(tiny_config_dict(data_dir, data={"num_workers": 1}))
    loader = build_data(config, data_dir, create_model(config), 1).train_loader
    before = {process.pid for process in multiprocessing.active_children()}
    batches = iter(loader)
    next(batches)
    workers = [process for process in multiprocessing.active_children() if process.pid not in before]
    assert len(workers) == 1
    for worker in workers:
        os.kill(worker.pid, signal.SIGINT)
    time.sleep(0.5)
    assert all(worker.is_alive() for worker in workers)
    assert len(list(batches)) == 6  # the rest of the epoch's 7 batches


def test_resume_command_replaces_any_resume_option(tmp_path):
    cli = cli_module()
    argv = ["--config", "c.yaml", "--resume", "auto", "sched.epochs=3", "--res=old", "--output-dir", "o d"]
    line = cli.resume_command(argv, "o d/checkpoints/step_00000012", "python train_imagenet.py")
    assert line == ("python train_imagenet.py --config c.yaml sched.epochs=3 --output-dir 'o d' "
                    "--resume 'o d/checkpoints/step_00000012'")
    args = cli.parse_args(["--config", "c.yaml", "--output-dir", str(tmp_path)])
    message = cli.interrupted_line(KeyboardInterrupt(), args, ["--config", "c.yaml"], "python t.py")
    assert message == "interrupted before any checkpoint was saved; start again with: python t.py --config c.yaml"
    for step in ("step_00000004", "step_00000008"):
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
    message = cli.interrupted_line(KeyboardInterrupt(), args, ["--config", "c.yaml"], "python t.py")
    assert message.endswith(f"the latest checkpoint is {tmp_path}/checkpoints/step_00000008, resume from it with: "
                            f"python t.py --config c.yaml --resume {tmp_path}/checkpoints/step_00000008")
