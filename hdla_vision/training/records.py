"""Run records: Accelerate's trackers (TensorBoard by default), JSON lines per epoch, a PNG plot."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from accelerate import Accelerator

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"
TRACKER_PROJECT = "tensorboard"  # Accelerate's project name: TensorBoard writes to <output_dir>/tensorboard


class RunRecorder:
    """Logs through ``accelerator``'s trackers and writes ``metrics.jsonl`` under ``output_dir``.

    The trackers are those of ``Accelerator(log_with=..., project_dir=output_dir)``
    (``train.log_with``); they log on the main process only. Every scalar is logged against the
    optimizer step (``step/*`` every few steps, ``epoch/*`` at the step that ends the epoch), so a
    resumed run continues the same axis. On resume from a checkpoint taken at step ``G`` (in
    epoch ``E``):

    - TensorBoard keeps every point up to ``G`` and drops those after it (written by the
      interrupted run after its last checkpoint; the resumed run writes them again), through
      its writer's ``purge_step=G + 1``;
    - ``metrics.jsonl`` is appended to: lines of epochs ``>= E`` (logged after the
      checkpoint) are cut off the end first, the earlier lines are left as they are.

    Accelerate's TensorBoard tracker flushes after every ``log``, so what a checkpoint covers
    is on disk when it is written.
    """

    def __init__(self, accelerator: Accelerator, output_dir: str | Path, resume_epoch: Optional[int] = None,
                 resume_step: Optional[int] = None):
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.enabled = accelerator.is_main_process
        self.metrics_file = self.output_dir / METRICS_FILE
        if self.enabled:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if resume_epoch is None:
                self.metrics_file.write_text("")
            else:
                drop_rows_from(self.metrics_file, resume_epoch)
        purge = {} if resume_step is None else {"purge_step": resume_step + 1}
        accelerator.init_trackers(TRACKER_PROJECT, init_kwargs={"tensorboard": purge})

    def log_step(self, step: int, values: dict) -> None:
        self.accelerator.log({f"step/{key}": value for key, value in values.items()}, step=step)

    def log_epoch(self, row: dict) -> None:
        if self.enabled:
            with open(self.metrics_file, "a") as handle:
                handle.write(json.dumps(row) + "\n")
        scalars = {f"epoch/{key}": value for key, value in row.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "global_step"}
        self.accelerator.log(scalars, step=row["global_step"])

    def close(self, plot: bool = True) -> Optional[Path]:
        """Finish the trackers and draw the curves; returns the PNG path (main process)."""
        for tracker in self.accelerator.trackers:
            tracker.finish()
        self.accelerator.trackers = []  # end_training would finish them again
        if not self.enabled or not plot:
            return None
        return plot_curves(self.metrics_file, self.output_dir / PLOT_FILE)


def drop_rows_from(metrics_file: Path, epoch: int) -> None:
    """Cut the lines of epochs ``>= epoch`` off the end of ``metrics_file``; earlier bytes stay untouched."""
    if not metrics_file.exists():
        metrics_file.write_text("")
        return
    offset = 0
    with open(metrics_file, "rb") as handle:
        for line in handle:
            if line.strip() and not _row_before(line, epoch):
                break
            offset += len(line)
    if offset < metrics_file.stat().st_size:
        os.truncate(metrics_file, offset)


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _row_before(line: bytes, epoch: int) -> bool:
    """Whether a metrics line is a whole row of an epoch before ``epoch`` (a half-written last line is not)."""
    try:
        return json.loads(line).get("epoch", -1) < epoch
    except json.JSONDecodeError:
        return False


def curve_series(rows: list[dict]) -> dict:
    """``{key: [(epoch, value), ...]}`` of the plotted metrics, over every row of the run."""
    keys = ("train_loss", "val_loss", "val_ema_loss", "val_top1", "val_ema_top1", "val_top5")
    series = {key: [(r["epoch"], r[key]) for r in rows if r.get(key) is not None] for key in keys}
    return {key: points for key, points in series.items() if points}


def plot_curves(metrics_file: Path, png: Path) -> Optional[Path]:
    """Loss (train, val) and top-1 (raw, EMA) against epoch, one PNG with two panels, from the whole run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = curve_series(read_metrics(metrics_file))
    if not series:
        return None
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, keys, title in ((loss_ax, ("train_loss", "val_loss", "val_ema_loss"), "loss"),
                            (acc_ax, ("val_top1", "val_ema_top1", "val_top5"), "accuracy (%)")):
        for key in keys:
            if key in series:
                ax.plot(*zip(*series[key]), marker="o", label=key)
        ax.set_xlabel("epoch")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
