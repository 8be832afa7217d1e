"""Run records on the main process: TensorBoard scalars, JSON lines per epoch, a PNG plot."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"


class RunRecorder:
    """Writes ``metrics.jsonl`` and TensorBoard event files under ``output_dir``.

    Every scalar is logged against the optimizer step (``step/*`` every few steps, ``epoch/*``
    at the step that ends the epoch), so a resumed run continues the same axis. On resume
    from a checkpoint taken at step ``G`` (in epoch ``E``):

    - TensorBoard keeps every point up to ``G`` and drops those after it (written by the
      interrupted run after its last checkpoint; the resumed run writes them again), through
      ``purge_step=G + 1``;
    - ``metrics.jsonl`` is appended to: lines of epochs ``>= E`` (logged after the
      checkpoint) are cut off the end first, the earlier lines are left as they are.

    ``flush`` is called before every checkpoint, so what a checkpoint covers is on disk.
    """

    def __init__(self, output_dir: str | Path, enabled: bool, resume_epoch: Optional[int] = None,
                 resume_step: Optional[int] = None):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file = self.output_dir / METRICS_FILE
        if resume_epoch is None:
            self.metrics_file.write_text("")
        else:
            drop_rows_from(self.metrics_file, resume_epoch)
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=purge)

    def log_step(self, step: int, values: dict) -> None:
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(f"step/{key}", value, step)

    def log_epoch(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.metrics_file, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if isinstance(value, (int, float)) and key != "global_step":
                self.writer.add_scalar(f"epoch/{key}", value, row["global_step"])
        self.writer.flush()

    def flush(self) -> None:
        """Put every logged point on disk (called before each checkpoint)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self, plot: bool = True) -> Optional[Path]:
        """Close TensorBoard and draw the curves; returns the PNG path (main process)."""
        if not self.enabled:
            return None
        self.writer.close()
        return plot_curves(self.metrics_file, self.output_dir / PLOT_FILE) if plot else None


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
