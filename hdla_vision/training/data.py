"""Datasets, transforms, samplers and loaders built from timm's data factories.

Sharding: every process computes the same global sample order for an epoch (seeded by
``seed + epoch``), the loader groups it into per-process batches, and Accelerate's
``prepare`` hands batch ``j`` to process ``j % num_processes``. Every sample carries its
own augmentation seed, so the images a batch contains depend only on (seed, epoch,
position in the epoch), not on worker count or on where a resumed run restarted.
"""
from __future__ import annotations

import contextlib
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from PIL import Image
from timm.data import Mixup, create_dataset, create_transform, resolve_data_config
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, Sampler

from hdla_vision.training.augment import use_exact_posterize
from hdla_vision.training.config import Config
from hdla_vision.training.interrupt import ignore_interrupts
from hdla_vision.training.quickstart import ensure_quickstart_dataset

_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm"}
QUICKSTART = "quickstart"


def resolve_data_root(config: Config, data_dir: Optional[str] = None) -> Optional[Path]:
    """The dataset root for ``data_dir`` (or ``config.data.data_dir``); ``quickstart`` generates it."""
    data_dir = data_dir or config.data.data_dir
    if data_dir == QUICKSTART:
        return ensure_quickstart_dataset(
            train_per_class=config.data.quickstart_train_per_class,
            val_per_class=config.data.quickstart_val_per_class,
            image_size=config.data.img_size,
            seed=config.train.seed,
        )
    if data_dir is None:
        if _is_folder_dataset(config.data.dataset):
            raise ValueError("no data directory: pass --data-dir or set data.data_dir (or 'quickstart')")
        return None
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"data directory '{root}' does not exist or is not a directory")
    if _is_folder_dataset(config.data.dataset):
        for split in (config.data.train_split, config.data.val_split):
            check_image_folder(root / split)
    return root


def _is_folder_dataset(name: str) -> bool:
    return name in ("", "folder") or name.startswith("folder/")


def check_image_folder(split_dir: Path) -> None:
    """Require the ImageFolder layout: ``split_dir/<class>/<image files>``."""
    if not split_dir.is_dir():
        raise ValueError(
            f"data directory is malformed: '{split_dir}' is missing "
            "(expected ImageFolder layout <data-dir>/train/<class>/*.jpg and <data-dir>/val/<class>/*.jpg)"
        )
    class_dirs = [d for d in sorted(split_dir.iterdir()) if d.is_dir()]
    if not class_dirs:
        raise ValueError(f"data directory is malformed: '{split_dir}' has no class sub-directories")
    empty = [d.name for d in class_dirs if not any(f.suffix.lower() in _IMAGE_SUFFIXES for f in d.rglob("*"))]
    if empty:
        raise ValueError(f"data directory is malformed: class folders without images in '{split_dir}': {empty[:5]}")


class SeededSamples(Dataset):
    """Wrap a timm dataset: item ``(index, seed)`` -> ``(image [3,H,W], target, index)``.

    The python, numpy and torch RNGs are seeded with ``seed`` while the sample is loaded and
    augmented, then restored, so augmentation is reproducible per sample. An integer key
    loads without reseeding (evaluation). A file that cannot be read raises ``ValueError``
    naming the file, instead of timm's default of silently substituting the next sample.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        if hasattr(dataset, "_max_retries"):
            dataset._max_retries = 1

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        index, seed = key if isinstance(key, tuple) else (key, None)
        with _seeded_rngs(seed):
            try:
                image, target = self.dataset[index][:2]
            except (RuntimeError, OSError) as err:
                raise ValueError(self._unreadable_message(index, err)) from err
        return image, target, index

    def _unreadable_message(self, index: int, err: Exception) -> str:
        if not hasattr(self.dataset, "filename"):
            return f"cannot read sample {index}: {err}"
        path = self.dataset.filename(index, absolute=True)
        try:
            Image.open(path).convert("RGB")
            reason = str(err)
        except Exception as decode_error:  # reproduce the decoder's own message
            reason = f"{type(decode_error).__name__}: {decode_error}"
        return f"cannot read image '{path}' (sample {index}): {reason}"


@contextlib.contextmanager
def _seeded_rngs(seed: Optional[int]):
    if seed is None:
        yield
        return
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


class EpochOrder(Sampler):
    """The global order of one epoch as ``(index, augmentation seed)`` pairs.

    The order is the same on every process; its length is a multiple of
    ``batch_per_process * num_processes`` so Accelerate's batch sharding gives every process
    the same number of full batches. With ``repeated_aug`` the order is timm's
    ``RepeatAugSampler`` (DeiT): the per-process streams are interleaved batch by batch so
    that, after sharding, process ``r`` sees exactly what RepeatAugSampler gives rank ``r``
    (each repeat of a sample on a different process).

    The epoch is chosen with ``use_epoch`` (deliberately not ``set_epoch``: Accelerate
    calls ``set_epoch`` with its own iteration counter, which restarts after a resume).
    """

    def __init__(self, num_samples: int, batch_per_process: int, num_processes: int, seed: int,
                 repeated_aug: bool = False, num_repeats: int = 3):
        self.num_samples = num_samples
        self.batch_per_process = batch_per_process
        self.num_processes = num_processes
        self.seed = seed
        self.repeated_aug = repeated_aug
        self.num_repeats = num_repeats
        self.epoch = 0
        if len(self) == 0:
            raise ValueError(
                f"the training set ({num_samples} images) is smaller than one global batch "
                f"({batch_per_process} per process x {num_processes} processes): lower train.global_batch_size"
            )

    @staticmethod
    def samples_per_epoch(num_samples: int, num_processes: int, repeated_aug: bool = False,
                          num_repeats: int = 3) -> int:
        """How many samples one epoch hands out over all processes (before rounding to whole batches)."""
        if not repeated_aug:
            return num_samples
        per_rank = len(RepeatAugSampler(range(num_samples), num_replicas=num_processes, rank=0,
                                        num_repeats=num_repeats))
        return per_rank * num_processes

    def use_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _indices(self) -> list[int]:
        if not self.repeated_aug:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            return torch.randperm(self.num_samples, generator=generator).tolist()
        streams = []
        for rank in range(self.num_processes):
            sampler = RepeatAugSampler(range(self.num_samples), num_replicas=self.num_processes, rank=rank,
                                       num_repeats=self.num_repeats)
            sampler.set_epoch(self.seed * 1_000_003 + self.epoch)
            streams.append(list(sampler))
        b = self.batch_per_process
        batches = len(streams[0]) // b
        return [i for k in range(batches) for stream in streams for i in stream[k * b:(k + 1) * b]]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        indices = self._indices()[: len(self)]
        generator = torch.Generator().manual_seed(self.seed * 2_000_003 + self.epoch + 1)
        seeds = torch.randint(0, 2**62, (len(indices),), generator=generator).tolist()
        return iter(zip(indices, seeds))

    def process_indices(self, process_index: int, batches: int) -> list[int]:
        """The sample indices of the first ``batches`` batches process ``process_index`` trains on.

        Accelerate hands global batch ``j`` of this order to process ``j % num_processes``.
        """
        order = [index for index, _ in self]
        b, n = self.batch_per_process, self.num_processes
        return [i for k in range(batches) for i in order[(k * n + process_index) * b:(k * n + process_index + 1) * b]]

    def __len__(self) -> int:
        global_batch = self.batch_per_process * self.num_processes
        total = self.samples_per_epoch(self.num_samples, self.num_processes, self.repeated_aug, self.num_repeats)
        return total // global_batch * global_batch


def batch_per_process(config: Config, num_processes: int) -> int:
    """``global_batch_size / (num_processes * grad_accum_steps)``; must divide exactly."""
    t = config.train
    divisor = num_processes * t.grad_accum_steps
    if t.global_batch_size % divisor:
        raise ValueError(f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
                         f"num_processes x train.grad_accum_steps = {num_processes} x {t.grad_accum_steps}")
    return t.global_batch_size // divisor


def cap_global_batch(config: Config, num_samples: int, num_processes: int) -> None:
    """Lower ``train.global_batch_size`` to what one epoch of the training set can fill, with a warning.

    The capped batch is the largest multiple of ``num_processes * grad_accum_steps`` (times 2
    with mixup / cutmix, which pair images within a batch) not above the epoch's sample count.
    """
    t, d = config.train, config.data
    available = EpochOrder.samples_per_epoch(num_samples, num_processes, d.repeated_aug, d.num_repeats)
    unit = num_processes * t.grad_accum_steps * (2 if d.mixup > 0 or d.cutmix > 0 else 1)
    capped = available // unit * unit
    if t.global_batch_size <= available or capped == 0:
        return
    warnings.warn(f"train.global_batch_size {t.global_batch_size} is larger than the training set "
                  f"({available} images per epoch): using {capped}, one optimizer step per epoch "
                  f"(the peak lr scales with it)", stacklevel=2)
    t.global_batch_size = capped


@dataclass
class DataBundle:
    batch_per_process: int
    train_loader: DataLoader
    val_loader: DataLoader
    train_order: EpochOrder
    mixup: Optional[Mixup]
    num_classes: int
    class_names: Optional[list]


def data_settings(config: Config, model: torch.nn.Module) -> dict:
    """Mean, std, eval crop_pct and interpolation from the model's pretrained_cfg, config overrides applied."""
    args = {"input_size": (3, config.data.img_size, config.data.img_size)}
    for key in ("crop_pct", "mean", "std"):
        value = getattr(config.data, key)
        if value is not None:
            args[key] = tuple(value) if isinstance(value, list) else value
    return resolve_data_config(args, model=model)


def build_transforms(config: Config, settings: dict):
    """(train transform, eval transform) from timm's transform factory.

    The train transform's posterize ops are swapped for ``augment.exact_posterize``, which
    gives Pillow 12's result for 0 bits on every Pillow (Pillow 13 raises instead).
    """
    d = config.data
    train = create_transform(
        d.img_size, is_training=True, scale=tuple(d.scale), hflip=d.hflip,
        color_jitter=d.color_jitter if d.color_jitter > 0 else None, auto_augment=d.auto_augment,
        interpolation=d.interpolation, mean=settings["mean"], std=settings["std"],
        re_prob=d.reprob, re_mode="pixel", re_count=1,
    )
    use_exact_posterize(train)
    evaluation = create_transform(
        d.img_size, is_training=False, interpolation=settings["interpolation"],
        mean=settings["mean"], std=settings["std"], crop_pct=settings["crop_pct"],
    )
    return train, evaluation


def _create_split(config: Config, root: Optional[Path], split: str, is_training: bool, transform):
    if _is_folder_dataset(config.data.dataset):  # the split folder itself (validated by resolve_data_root)
        source = dict(root=str(root / split), split=split, search_split=False)
    else:  # e.g. hfds/<name> or torch/<name>: timm resolves the split
        source = dict(root=str(root) if root else None, split=split)
    try:
        dataset = create_dataset(config.data.dataset, is_training=is_training, transform=transform, **source)
    except (FileNotFoundError, RuntimeError, ValueError, AssertionError) as err:
        raise ValueError(f"cannot open dataset '{config.data.dataset or 'folder'}' split '{split}' "
                         f"under '{root}': {err}") from err
    if len(dataset) == 0:
        raise ValueError(f"dataset split '{split}' under '{root}' is empty")
    return dataset


def _class_names(dataset) -> Optional[list]:
    class_to_idx = getattr(getattr(dataset, "reader", None), "class_to_idx", None)
    return sorted(class_to_idx, key=class_to_idx.get) if class_to_idx else None


def build_mixup(config: Config) -> Optional[Mixup]:
    d = config.data
    if d.mixup <= 0 and d.cutmix <= 0:
        return None
    return Mixup(mixup_alpha=d.mixup, cutmix_alpha=d.cutmix, prob=d.mixup_prob, switch_prob=d.mixup_switch_prob,
                 mode="batch", label_smoothing=d.label_smoothing, num_classes=d.num_classes)


def build_data(config: Config, root: Optional[Path], model: torch.nn.Module, num_processes: int) -> DataBundle:
    """Training and validation loaders (not yet passed through ``accelerator.prepare``).

    A ``train.global_batch_size`` larger than the training set is capped (``cap_global_batch``).
    """
    train_tf, eval_tf = build_transforms(config, data_settings(config, model))
    train_set = _create_split(config, root, config.data.train_split, True, train_tf)
    val_set = _create_split(config, root, config.data.val_split, False, eval_tf)
    cap_global_batch(config, len(train_set), num_processes)
    per_process = batch_per_process(config, num_processes)
    names = _class_names(train_set)
    if names is not None:
        if len(names) != config.data.num_classes:
            raise ValueError(f"data.num_classes is {config.data.num_classes} but '{root}' has {len(names)} "
                             f"classes in '{config.data.train_split}'")
        val_names = _class_names(val_set)
        if val_names is not None and val_names != names:
            raise ValueError(f"class folders differ between '{config.data.train_split}' and "
                             f"'{config.data.val_split}' under '{root}'")
    order = EpochOrder(len(train_set), per_process, num_processes, config.train.seed,
                       config.data.repeated_aug, config.data.num_repeats)
    workers = config.data.num_workers
    common = dict(num_workers=workers, pin_memory=config.data.pin_memory and torch.cuda.is_available(),
                  persistent_workers=workers > 0, worker_init_fn=ignore_interrupts if workers > 0 else None)
    train_loader = DataLoader(SeededSamples(train_set), batch_size=per_process, sampler=order,
                              drop_last=True, generator=torch.Generator().manual_seed(config.train.seed), **common)
    val_loader = DataLoader(SeededSamples(val_set), batch_size=per_process, shuffle=False,
                            generator=torch.Generator().manual_seed(config.train.seed), **common)
    return DataBundle(per_process, train_loader, val_loader, order, build_mixup(config), config.data.num_classes,
                      names)
