"""Shared pieces of the training tests: a tiny generated dataset and a tiny config."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from accelerate.state import AcceleratorState, GradientState

import hdla_vision  # noqa: F401  (registers the timm models)
from hdla_vision.training import checkpoint as ckpt
from hdla_vision.training import runner
from hdla_vision.training.config import config_from_dict
from hdla_vision.training.quickstart import CLASS_NAMES, ensure_quickstart_dataset

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = {"name": "deit_tiny_patch16_224",
              "kwargs": {"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2},
              "drop_path_rate": 0.1}


def reset_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons; each in-process run builds its own Accelerator."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def train_killed_after_step(config, out_dir: Path, step: int, monkeypatch) -> None:
    """``runner.train(config, out_dir)`` killed (KeyboardInterrupt) right after the checkpoint of global
    step ``step`` is written, as a killed process would stop; checkpoint saving is restored after."""
    real_save = ckpt.save_checkpoint

    def save_then_die(accelerator, output_dir, state, *args, **kwargs):
        path = real_save(accelerator, output_dir, state, *args, **kwargs)
        if state.global_step == step:
            raise KeyboardInterrupt(f"simulated kill after step {step}")
        return path

    monkeypatch.setattr(ckpt, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        runner.train(config, out_dir)
    monkeypatch.setattr(ckpt, "save_checkpoint", real_save)


def tiny_dataset(cache: Path) -> Path:
    """10 classes, 6 training and 2 validation images per class, 32x32 pixels."""
    return ensure_quickstart_dataset(cache, train_per_class=6, val_per_class=2, image_size=32)


def subset_dataset(source: Path, target: Path, classes: int) -> Path:
    """An ImageFolder copy of ``source`` with only its first ``classes`` classes."""
    for split in ("train", "val"):
        for name in CLASS_NAMES[:classes]:
            shutil.copytree(source / split / name, target / split / name)
    return target


def tiny_config_dict(data_dir: Path, **section_overrides) -> dict:
    """A 2-layer, width-32 ViT on 32-pixel images; batches of 8, 2 epochs, every augmentation on."""
    values = {
        "model": dict(TINY_MODEL),
        "data": {"data_dir": str(data_dir), "num_classes": 10, "img_size": 32, "num_workers": 0,
                 "auto_augment": "rand-m9-mstd0.5-inc1", "reprob": 0.25, "mixup": 0.8, "cutmix": 1.0,
                 "label_smoothing": 0.1},
        "optim": {"base_lr": 4e-3, "clip_grad": 1.0},
        "sched": {"epochs": 2, "warmup_epochs": 1},
        "train": {"global_batch_size": 8, "mixed_precision": "no", "ema": True, "ema_decay": 0.9,
                  "log_every_steps": 2, "progress_bar": False, "consistency_checks": True},
    }
    for section, updates in section_overrides.items():
        values[section] = {**values.get(section, {}), **updates}
    return values


def tiny_config(data_dir: Path, **section_overrides):
    return config_from_dict(tiny_config_dict(data_dir, **section_overrides))


def cli_module():
    """``train_imagenet.py`` imported as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_imagenet", REPO / "train_imagenet.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def write_config(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path
