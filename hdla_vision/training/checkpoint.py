"""Training checkpoints: Accelerate's state plus EMA weights and the loop position, written atomically.

A checkpoint directory ``<output>/checkpoints/step_XXXXXXXX`` holds what
``accelerator.save_state`` writes (model.safetensors, optimizer.bin, scaler.pt, one
random_states_<rank>.pkl per process, and one custom_checkpoint_<i>.pkl per object registered
with ``accelerator.register_for_checkpointing``: the ``TrainerState`` (epoch, batches consumed
in that epoch, optimizer steps, best accuracy) and, with model EMA, the EMA weights) and
``manifest.json`` (run identity, the registered objects' names and the SHA-256 of every file).
Everything is written into a hidden temporary directory that is renamed into place once
complete, so a directory named ``step_*`` is always whole; loading re-checks every file's hash
before Accelerate reads anything, so a corrupted or altered file is never unpickled (Accelerate
reads the optimizer and RNG files with ``weights_only=True``, and the custom states with
``weights_only=False``: the hash check is what guards those).

A multi-host run needs the output directory on a filesystem all hosts share.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import load as accelerate_load

CHECKPOINT_PREFIX = "step_"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state"  # the names of the registered objects, in registration order
EMA = "ema"


@dataclass
class TrainerState:
    """Where the loop stands: resume continues from exactly here."""
    epoch: int = 0  # the epoch in progress (or next to start)
    batches_done: int = 0  # per-process batches of ``epoch`` already consumed
    global_step: int = 0  # optimizer steps taken
    best_top1: float = -1.0
    best_epoch: int = -1
    best_source: str = ""
    epoch_loss_sum: float = 0.0  # the main process's summed training loss so far in ``epoch``
    epoch_loss_sums: list = field(default_factory=list)  # every process's (this file is written by the main one)
    epoch_loss_batches: int = 0
    epoch_images: int = 0  # images this process trained on so far in ``epoch``
    epoch_seconds: float = 0.0  # training time spent so far in ``epoch`` (before an interruption)

    def state_dict(self) -> dict:
        """For ``accelerator.register_for_checkpointing``: plain numbers, strings and lists."""
        return asdict(self)

    def load_state_dict(self, values: dict) -> None:
        """Restore every field (all must be present: a state of another layout raises)."""
        names = {f.name for f in fields(self)}
        if set(values) != names:
            raise ValueError(f"trainer state has fields {sorted(values)}, expected {sorted(names)}")
        for name in names:
            setattr(self, name, values[name])

    def start_next_epoch(self) -> None:
        """Move to the start of the next epoch (after its evaluation and exports)."""
        self.epoch, self.batches_done = self.epoch + 1, 0
        self.epoch_loss_sum, self.epoch_loss_sums, self.epoch_loss_batches = 0.0, [], 0
        self.epoch_images, self.epoch_seconds = 0, 0.0


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def register_objects(accelerator: Accelerator, state: TrainerState,
                     ema_model: Optional[torch.nn.Module]) -> list[str]:
    """Register the loop state (and the EMA model) for Accelerate's checkpointing; return their names."""
    objects = {TRAINER_STATE: state, **({EMA: ema_model} if ema_model is not None else {})}
    accelerator.register_for_checkpointing(*objects.values())
    return list(objects)


def save_checkpoint(accelerator: Accelerator, output_dir: str | Path, state: TrainerState, registered: list[str],
                    identity: dict, keep: int) -> Path:
    """Save everything needed to resume; all processes must call it. Returns the checkpoint dir.

    ``state`` and the other ``registered`` objects are saved by ``accelerator.save_state``.
    """
    root = checkpoint_root(output_dir)
    final = root / f"{CHECKPOINT_PREFIX}{state.global_step:08d}"
    staging = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_manifest(staging, registered, identity)
        if final.exists():  # the same step saved twice (e.g. step and epoch end coincide)
            shutil.rmtree(final)
        os.replace(staging, final)
        _prune(root, keep)
    accelerator.wait_for_everyone()
    return final


def _write_manifest(staging: Path, registered: list[str], identity: dict) -> None:
    files = {p.name: _sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
    manifest = {"identity": identity, "registered": registered, "files": files}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _prune(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
    return sorted(found, key=lambda p: p.name)


def find_resume_dir(resume: str, output_dir: str | Path) -> Optional[Path]:
    """``'auto'``: the newest checkpoint of ``output_dir`` (None if there is none); else the given path."""
    if resume == "auto":
        found = list_checkpoints(checkpoint_root(output_dir))
        return found[-1] if found else None
    path = Path(resume)
    if path.is_dir() and not (path / MANIFEST).exists() and list_checkpoints(checkpoint_root(path)):
        return list_checkpoints(checkpoint_root(path))[-1]  # a run directory was given
    if not path.is_dir():
        raise ValueError(f"--resume: checkpoint directory '{path}' does not exist")
    return path


def verify_checkpoint(path: Path, identity: dict) -> dict:
    """Check the manifest, every file's SHA-256 and the run identity; return the manifest."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise ValueError(f"checkpoint '{path}' has no {MANIFEST}: it is incomplete or not a training checkpoint")
    try:
        manifest = json.loads(manifest_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"checkpoint '{path}': {MANIFEST} is corrupt: {err}") from err
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"checkpoint '{path}' is incomplete: '{name}' is missing")
        if _sha256(file) != expected:
            raise ValueError(f"checkpoint '{path}' is corrupt: '{name}' does not match its recorded SHA-256")
    for key, value in identity.items():
        saved = manifest["identity"].get(key)
        if saved != value:
            raise ValueError(f"checkpoint '{path}' does not match this run: {key} was {saved!r}, now {value!r}")
    return manifest


def load_checkpoint(accelerator: Accelerator, path: Path, registered: list[str], identity: dict) -> None:
    """Restore model, optimizer, scaler, RNG states and the ``registered`` objects (in place) from ``path``."""
    manifest = verify_checkpoint(path, identity)
    saved = manifest.get("registered", [])
    if EMA in registered and EMA not in saved:
        raise ValueError(f"checkpoint '{path}' has no EMA weights but this run uses model EMA (train.ema)")
    if saved != registered:
        raise ValueError(f"checkpoint '{path}' holds the states {saved}, this run registers {registered}")
    rng_file = path / f"random_states_{accelerator.process_index}.pkl"
    if not rng_file.is_file():
        raise ValueError(f"checkpoint '{path}' has no RNG state for process {accelerator.process_index}")
    try:
        accelerator.load_state(str(path), load_kwargs={"weights_only": True})
    except RuntimeError as err:
        raise ValueError(f"checkpoint '{path}' does not match the model or optimizer: {err}") from err
    _check_rng_restored(rng_file)


def _check_rng_restored(rng_file: Path) -> None:
    """Accelerate only logs when it cannot restore RNG states; exact resume needs them."""
    saved = accelerate_load(rng_file)
    if not torch.equal(saved["torch_manual_seed"], torch.get_rng_state()):
        raise ValueError(f"RNG state in '{rng_file}' could not be restored")
