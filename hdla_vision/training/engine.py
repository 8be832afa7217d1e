"""The train and evaluation loops (no setup here: see ``runner.py``)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import Accelerator
from timm.data import Mixup
from tqdm.auto import tqdm

from hdla_vision.training.checkpoint import TrainerState
from hdla_vision.training.interrupt import TrainingInterrupted


@dataclass
class TrainParts:
    """What one training step needs, already passed through ``accelerator.prepare``."""
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object  # timm scheduler, stepped per optimizer update with step_update
    criterion: torch.nn.Module
    train_loader: torch.utils.data.DataLoader
    train_order: object  # data.EpochOrder
    mixup: Optional[Mixup] = None
    ema: Optional[torch.nn.Module] = None  # timm.utils.ModelEmaV3
    clip_grad: Optional[float] = None
    log_every: int = 20
    progress_bar: bool = True
    checkpoint_every: int = 0  # optimizer steps between mid-epoch checkpoints (0: none)
    on_checkpoint: Optional[Callable[[TrainerState], Path]] = None  # saves, returns the checkpoint dir
    on_log: Optional[Callable[[int, dict], None]] = None
    should_stop: Optional[Callable[[], bool]] = None  # asked after each optimizer step (see interrupt.py)
    record_indices: bool = False  # keep every sample index trained on (train.consistency_checks)
    compiled: Optional[torch.nn.Module] = None  # torch.compile(model) (train.compile): the training step's forward;
    # it wraps ``model`` and shares its parameters, so checkpoints, exports and evaluation use ``model`` itself
    grads_in_place: bool = False  # .grad stays allocated across steps (zeroed, never set to None): micro-steps add
    # into it. Needed by CUDA graphs with accumulation, see runner.grads_in_place


@dataclass
class EpochStats:
    loss: float
    images: int  # images this process trained on
    seconds: float
    seen_indices: list = field(default_factory=list)  # dataset indices this process trained on


def train_one_epoch(parts: TrainParts, state: TrainerState) -> EpochStats:
    """Run the rest of epoch ``state.epoch``, starting after ``state.batches_done`` batches.

    Images are [B, 3, H, W] per process; a global optimizer step consumes
    ``num_processes * grad_accum_steps`` batches. After a mid-epoch resume the epoch's
    statistics (loss, images, time, sample indices) include the batches before the checkpoint.
    """
    acc = parts.accelerator
    parts.train_order.use_epoch(state.epoch)
    loader = parts.train_loader
    if state.batches_done:
        loader = acc.skip_first_batches(loader, state.batches_done)
    parts.model.train()
    total = len(parts.train_loader)
    bar = tqdm(total=total, initial=state.batches_done, desc=f"epoch {state.epoch}", dynamic_ncols=True,
               disable=not (parts.progress_bar and acc.is_main_process))
    progress = _EpochProgress.resume(state, parts.train_order, acc, parts.record_indices)
    window_start = time.perf_counter()
    window_images = 0
    for images_batch, targets, indices in loader:
        loss = _train_step(parts, images_batch, targets)
        progress.add(loss, images_batch.shape[0], indices)
        state.batches_done += 1
        window_images += images_batch.shape[0]
        bar.update(1)
        if not acc.sync_gradients:
            continue
        state.global_step += 1
        parts.scheduler.step_update(num_updates=state.global_step)
        if parts.ema is not None:
            parts.ema.update(acc.unwrap_model(parts.model), step=state.global_step)
        if state.global_step % parts.log_every == 0 or state.batches_done >= total:
            window_images = _log_progress(parts, bar, loss, window_images, window_start, state)
            window_start = time.perf_counter()
        saved = None
        if _checkpoint_due(parts, state, total):
            progress.store(state, parts.accelerator)
            saved = parts.on_checkpoint(state)
        if state.batches_done < total and parts.should_stop is not None and parts.should_stop():
            bar.close()
            _stop_here(parts, state, progress, saved)
    bar.close()
    return progress.finish(state.epoch)


@dataclass
class _EpochProgress:
    """This process's running totals for one epoch, continued from a mid-epoch checkpoint."""
    loss_sum: torch.Tensor  # float64 scalar on the device (no sync per step)
    loss_batches: int
    images: int
    seconds_before: float  # time spent in this epoch before the resumed checkpoint
    start: float
    seen: Optional[list]  # dataset indices trained on, if recorded

    @classmethod
    def resume(cls, state: TrainerState, train_order, acc: Accelerator, record_indices: bool) -> "_EpochProgress":
        """Totals as saved in ``state``; the sample indices already trained on are recomputed from the order."""
        seen = None
        if record_indices:
            seen = train_order.process_indices(acc.process_index, state.batches_done) if state.batches_done else []
        own = state.epoch_loss_sums[acc.process_index] if state.epoch_loss_sums else state.epoch_loss_sum
        loss_sum = torch.full((), own, device=acc.device, dtype=torch.float64)
        return cls(loss_sum, state.epoch_loss_batches, state.epoch_images, state.epoch_seconds,
                   time.perf_counter(), seen)

    def add(self, loss: torch.Tensor, images: int, indices: torch.Tensor) -> None:
        self.loss_sum += loss.detach().double()
        self.loss_batches += 1
        self.images += images
        if self.seen is not None:
            self.seen.extend(indices.tolist())

    def seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.start

    def store(self, state: TrainerState, acc: Accelerator) -> None:
        """Write the totals into ``state`` so that a checkpoint of it resumes them exactly (all processes call it)."""
        sums = acc.gather(self.loss_sum[None]).tolist() if acc.num_processes > 1 else [self.loss_sum.item()]
        state.epoch_loss_sums, state.epoch_loss_sum = sums, sums[0]
        state.epoch_loss_batches = self.loss_batches
        state.epoch_images, state.epoch_seconds = self.images, self.seconds()

    def finish(self, epoch: int) -> EpochStats:
        mean_loss = (self.loss_sum / max(self.loss_batches, 1)).item()
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"training loss is {mean_loss} in epoch {epoch}: lower optim.base_lr "
                                     "or set optim.clip_grad")
        return EpochStats(mean_loss, self.images, self.seconds(), self.seen or [])


def _stop_here(parts: TrainParts, state: TrainerState, progress: "_EpochProgress", saved) -> None:
    """Checkpoint this step boundary (unless just done) and raise ``TrainingInterrupted``."""
    if saved is None:
        progress.store(state, parts.accelerator)
        saved = parts.on_checkpoint(state)
    raise TrainingInterrupted(saved, state.epoch, state.batches_done, state.global_step)


def _checkpoint_due(parts: TrainParts, state: TrainerState, total_batches: int) -> bool:
    """Mid-epoch checkpoints only; the end of an epoch is checkpointed after evaluation."""
    return (parts.on_checkpoint is not None and parts.checkpoint_every > 0
            and state.global_step % parts.checkpoint_every == 0 and state.batches_done < total_batches)


def _train_step(parts: TrainParts, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    acc = parts.accelerator
    if parts.mixup is not None:
        images, targets = parts.mixup(images, targets)
    forward = parts.model
    if parts.compiled is not None:
        torch.compiler.cudagraph_mark_step_begin()  # a new step: CUDA graph outputs of the last one may be reused
        forward = parts.compiled
    with acc.accumulate(parts.model):
        loss = parts.criterion(forward(images), targets)
        acc.backward(loss)
        if acc.sync_gradients and parts.clip_grad:
            acc.clip_grad_norm_(parts.model.parameters(), parts.clip_grad)
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=not parts.grads_in_place)
    return loss


def _log_progress(parts: TrainParts, bar, loss: torch.Tensor, window_images: int, window_start: float,
                  state: TrainerState) -> int:
    acc = parts.accelerator
    lr = max(group["lr"] for group in parts.optimizer.param_groups)
    rate = window_images * acc.num_processes / max(time.perf_counter() - window_start, 1e-9)
    values = {"loss": loss.item(), "lr": lr, "img_per_s": rate}
    bar.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{lr:.2e}", img_s=f"{rate:.0f}")
    if parts.on_log is not None:
        parts.on_log(state.global_step, values)
    return 0


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, accelerator: Accelerator, num_classes: int) -> dict:
    """Top-1 / top-5 accuracy (%) and cross-entropy over the whole validation set.

    Predictions from all processes are gathered (duplicates from uneven sharding removed by
    ``gather_for_metrics``), so every process returns the same numbers.
    """
    was_training = model.training
    model.eval()
    k = min(5, num_classes)
    correct1 = correct5 = count = 0
    loss_sum = 0.0
    for images, targets, _ in loader:
        with accelerator.autocast():
            logits = model(images)
        logits = logits.float()
        losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        topk = logits.topk(k, dim=1).indices
        topk, targets, losses = accelerator.gather_for_metrics((topk, targets, losses))
        hits = topk.eq(targets[:, None])
        correct1 += hits[:, 0].sum().item()
        correct5 += hits.any(dim=1).sum().item()
        loss_sum += losses.sum().item()
        count += targets.numel()
    model.train(was_training)
    if count == 0:
        raise ValueError("the validation set produced no batches")
    return {"top1": 100.0 * correct1 / count, "top5": 100.0 * correct5 / count, "loss": loss_sum / count,
            "count": count}
