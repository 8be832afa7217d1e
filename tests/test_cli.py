"""The command line: YAML words, overrides anywhere, --resume auto, per-epoch and final reports."""
from __future__ import annotations

import hdla_vision  # noqa: F401  (registers the timm models)
import pytest

from hdla_vision.training.config import load_config
from tests.training_helpers import REPO, cli_module, tiny_config_dict, write_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singletons, per test

TINY_TINY = REPO / "configs" / "hdla_tiny.yaml"


@pytest.mark.parametrize("override, key, expected", [
    ("train.mixed_precision=no", "mixed_precision", "no"),
    ("train.mixed_precision=off", "mixed_precision", "no"),
    ("train.mixed_precision=false", "mixed_precision", "no"),
    ("train.mixed_precision=fp16", "mixed_precision", "fp16"),
    ("train.ema=off", "ema", False),
    ("train.ema=no", "ema", False),
    ("train.ema=yes", "ema", True),
    ("train.ema=on", "ema", True),
    ("train.ema=true", "ema", True),
])
def test_word_values_on_the_command_line(override, key, expected):
    assert getattr(load_config(TINY_TINY, [override]).train, key) == expected


def test_word_values_in_a_config_file(tmp_path):
    path = tmp_path / "words.yaml"
    path.write_text("train:\n  mixed_precision: no\n  ema: off\ndata:\n  auto_augment: off\n  repeated_aug: yes\n")
    config = load_config(path)
    assert (config.train.mixed_precision, config.train.ema) == ("no", False)
    assert config.data.auto_augment is None and config.data.repeated_aug is True
    assert load_config(TINY_TINY, ["data.auto_augment=none"]).data.auto_augment is None


@pytest.mark.parametrize("override, message", [
    ("train.mixed_precision=on", "config key 'train.mixed_precision' must be 'no', 'bf16' or 'fp16', got 'on'"),
    ("train.ema=maybe", "config key 'train.ema': expected bool, got str 'maybe'"),
    ("model.name=true", "config key 'model.name': expected str or null, got bool True"),
    ("train.seed=[1", "override 'train.seed=[1': the value is not valid YAML"),
])
def test_wrong_words_name_the_key(override, message):
    with pytest.raises(ValueError) as err:
        load_config(TINY_TINY, [override])
    assert message in str(err.value)


def test_overrides_anywhere_on_the_command_line():
    args = cli_module().parse_args(["a.b=1", "--config", "c.yaml", "--resume", "auto", "sched.epochs=1",
                                    "--data-dir", "x", "train.ema=off"])
    assert args.overrides == ["a.b=1", "sched.epochs=1", "train.ema=off"]
    assert (args.config, args.resume, args.data_dir) == ("c.yaml", "auto", "x")


def run(tmp_path, capsys, data_dir, *args: str) -> str:
    config = write_config(tmp_path / "config.yaml", tiny_config_dict(data_dir))
    code = cli_module().main(["--config", str(config), "--output-dir", str(tmp_path / "out"), *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_resume_auto_without_checkpoint_and_epoch_lines_with_ema(tmp_path, capsys, data_dir):
    out = run(tmp_path, capsys, data_dir, "--resume", "auto", "sched.epochs=1", "train.mixed_precision=no")
    assert f"--resume auto: no checkpoint in {tmp_path / 'out' / 'checkpoints'}, starting a new run" in out
    epoch = [line for line in out.splitlines() if line.startswith("epoch 1/1 |")]
    assert len(epoch) == 1
    assert "val raw top-1" in epoch[0] and "val EMA top-1" in epoch[0] and "best top-1" in epoch[0]
    assert "val top-1 (EMA)" in out and "val top-5 (EMA)" in out


def test_summary_without_ema_has_no_none(tmp_path, capsys, data_dir):
    out = run(tmp_path, capsys, data_dir, "sched.epochs=2", "train.ema=off", "train.eval_every_epochs=2")
    assert "None" not in out
    assert "epoch 1/2 |" in out and "no validation this epoch" in out
    assert "val raw top-1" in out.split("epoch 2/2 |")[1].splitlines()[0]
    assert "(EMA)" not in out and "val top-1 (raw)" in out


HEAVY = ("torch", "timm", "accelerate", "torchvision", "triton", "transformers", "tensorboard", "matplotlib",
         "numpy", "hdla_vision")

# ``python -c CLI_IMPORTS ARGS_JSON HEAVY_JSON`` runs train_imagenet.py as ``python train_imagenet.py
# ARGS`` would, then prints its exit code and which of the HEAVY packages ended up in sys.modules.
CLI_IMPORTS = """
import json, runpy, sys
args, heavy = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
sys.argv = ["train_imagenet.py", *args]
code = 0
try:
    runpy.run_path("train_imagenet.py", run_name="__main__")
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "heavy": sorted({m.split(".")[0] for m in sys.modules} & heavy)}))
"""


@pytest.mark.parametrize("args, code, stderr", [
    (["--help"], 0, ""),
    (["--config", "configs/quickstart.yaml", "train.ema=maybe"], 2,
     "error: config key 'train.ema': expected bool, got str 'maybe'"),
    (["--config", "configs/nope.yaml"], 2, "error: config file 'configs/nope.yaml' does not exist"),
    (["--config", "configs/quickstart.yaml", "--eval-only"], 2, "error: --eval-only needs --checkpoint"),
])
def test_help_and_config_errors_import_no_torch(args, code, stderr):
    """``--help`` and config errors answer before torch, timm or Accelerate is imported."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", CLI_IMPORTS, json.dumps(args), json.dumps(HEAVY)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"code": code, "heavy": []}, proc.stderr[-3000:]
    assert proc.stderr.strip() == stderr
    if args == ["--help"]:
        assert "section.key=value" in proc.stdout and "--resume" in proc.stdout
