"""Ctrl-C during training: checkpoint at the next step boundary and stop; a second Ctrl-C stops at once.

While ``train`` runs, the first SIGINT only sets a flag. The loop looks at it after each
optimizer step (all processes agree on it, so they stop at the same step), saves a checkpoint
there through the usual atomic checkpoint code and raises :class:`TrainingInterrupted`, which
names that checkpoint; resuming from it continues exactly (the same batches, RNG states and
records as an uninterrupted run). A stop requested in the last steps of an epoch, after its
last mid-epoch boundary, is taken at the epoch-end checkpoint, after the epoch's evaluation.

A second SIGINT raises ``KeyboardInterrupt`` at once. SIGINTs less than ``repeat_after``
seconds apart count as one: ``accelerate launch`` (torch elastic) forwards the terminal's
Ctrl-C to worker processes that already received it from the terminal.

DataLoader worker processes ignore SIGINT (:func:`ignore_interrupts`): the terminal sends it to
them too, and a worker that stops on it would break the batch in flight.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

STOP_MESSAGE = ("\nCtrl-C: saving a checkpoint at the next step boundary, then stopping "
                "(press Ctrl-C again to stop at once, without saving)\n")


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on request after saving ``checkpoint`` (from which it resumes exactly)."""

    def __init__(self, checkpoint: Path, epoch: int, batches_done: int, global_step: int):
        self.checkpoint = Path(checkpoint)
        self.epoch, self.batches_done, self.global_step = epoch, batches_done, global_step
        super().__init__(f"training stopped at step {global_step} (epoch {epoch + 1}, batch {batches_done}); "
                         f"checkpoint {self.checkpoint}")


class StopOnInterrupt:
    """Context manager: while active, SIGINT requests a stop instead of raising ``KeyboardInterrupt``.

    Outside the main thread (where Python cannot install signal handlers) it does nothing.
    """

    def __init__(self, announce: bool = True, repeat_after: float = 1.0):
        self.announce = announce
        self.repeat_after = repeat_after
        self.requested = False
        self._first_at: Optional[float] = None
        self._previous = None
        self._group = None

    def __enter__(self) -> "StopOnInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if not self.requested:
            self.requested, self._first_at = True, now
            if self.announce:
                os.write(2, STOP_MESSAGE.encode())  # not print(): the handler may interrupt a write to stderr
            return
        if now - self._first_at >= self.repeat_after:
            raise KeyboardInterrupt

    def agreed(self, accelerator) -> bool:
        """Whether any process was asked to stop; every process must call it at the same step.

        With several processes the flags are combined on the CPU (through a gloo group when the
        training backend is another one, e.g. NCCL), so asking every step never waits for the GPU.
        """
        if accelerator.num_processes == 1:
            return self.requested
        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group())
        return bool(flag.item())

    def _cpu_group(self):
        """None (the default group) if it runs on gloo, else a gloo group made once (a collective call)."""
        if dist.get_backend() == "gloo":
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group


def ignore_interrupts(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the worker leaves Ctrl-C to the training process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
