"""docs/training.md: the CPU chain runs exactly as written, and every other train command parses."""
from __future__ import annotations

import json
import shlex
import shutil
import warnings

import hdla_vision  # noqa: F401  (registers the timm models)
import pytest

from hdla_vision.training.config import load_config
from hdla_vision.training.models import read_export_metadata
from tests.training_helpers import REPO, cli_module, reset_accelerate_state

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singletons, per test

DOC = REPO / "docs" / "training.md"
CHAIN_HEADING = "### The whole chain in a minute"


def code_commands(text: str) -> list[str]:
    """The commands of the indented code blocks in ``text``, continuation lines joined."""
    commands, current = [], ""
    for line in text.splitlines():
        if not line.startswith("    ") or not line.strip():
            current = ""
            continue
        current += line.strip()
        if current.endswith("\\"):
            current = current[:-1] + " "
        else:
            commands.append(current)
            current = ""
    return commands


def train_arguments(command: str) -> list[str]:
    """The arguments after ``train_imagenet.py`` (shell comments dropped)."""
    tokens = shlex.split(command, comments=True)
    return tokens[tokens.index("train_imagenet.py") + 1:]


def chain_commands() -> list[str]:
    text = DOC.read_text()
    section = text.split(CHAIN_HEADING, 1)[1].split("\n#", 1)[0]
    return code_commands(section)


def test_every_documented_train_command_parses():
    commands = [c for c in code_commands(DOC.read_text()) if "train_imagenet.py" in c]
    assert len(commands) >= 10
    for command in commands:
        args = cli_module().parse_args(train_arguments(command))
        load_config(REPO / args.config, args.overrides)


def test_the_documented_chain_runs_as_written(tmp_path, monkeypatch, capsys):
    """Train on the quickstart data, fine-tune the export with configs/finetune.yaml, evaluate it."""
    commands = chain_commands()
    assert len(commands) == 3 and all(shlex.split(c)[:2] == ["python", "train_imagenet.py"] for c in commands)
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HDLA_VISION_CACHE", str(tmp_path / "cache"))
    cli = cli_module()
    for command in commands:
        reset_accelerate_state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = cli.main(train_arguments(command))
        capped = [str(w.message) for w in caught if "is larger than the training set" in str(w.message)]
        assert capped == (["train.global_batch_size 512 is larger than the training set (100 images per epoch): "
                           "using 100, one optimizer step per epoch (the peak lr scales with it)"]
                          if "finetune.yaml" in command else [])
        output = capsys.readouterr()
        assert code == 0, output.err
        assert "None" not in output.out
    source = read_export_metadata(tmp_path / "runs" / "smoke" / "best.safetensors")
    tuned = read_export_metadata(tmp_path / "runs" / "smoke_finetune" / "best.safetensors")
    assert tuned["model_name"] == source["model_name"] == "hdla_tiny"
    assert json.loads(tuned["model_kwargs"]) == json.loads(source["model_kwargs"])
    assert (tuned["img_size"], source["img_size"]) == ("48", "32")
    final = json.loads((tmp_path / "runs" / "smoke_finetune" / "final.json").read_text())
    evaluation = json.loads((tmp_path / "runs" / "smoke_finetune" / "eval.json").read_text())
    assert evaluation["count"] == 50
    assert evaluation["top1"] == pytest.approx(max(final["val_top1"], final.get("val_ema_top1", -1)))
