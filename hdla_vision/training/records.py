"""Run records on the main process: TensorBoard scalars, JSON lines per epoch, a PNG plot."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"


class RunRecorder:
    """Writes ``metrics.jsonl`` and TensorBoard event files under ``output_dir``.

    On resume, lines of epochs at or after the resumed epoch are dropped first, so a run
    interrupted between logging and checkpointing has no duplicate epochs.
    """

    def __init__(self, output_dir: str | Path, enabled: bool, resume_epoch: Optional[int] = None):
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
            self._truncate_from(resume_epoch)
        self.writer = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=resume_epoch)

    def _truncate_from(self, epoch: int) -> None:
        rows = read_metrics(self.metrics_file) if self.metrics_file.exists() else []
        kept = [r for r in rows if r.get("epoch", -1) < epoch]
        self.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in kept))

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
            if isinstance(value, (int, float)) and key != "epoch":
                self.writer.add_scalar(f"epoch/{key}", value, row["epoch"])
        self.writer.flush()

    def close(self) -> Optional[Path]:
        """Close TensorBoard and draw the curves; returns the PNG path (main process)."""
        if not self.enabled:
            return None
        self.writer.close()
        return plot_curves(self.metrics_file, self.output_dir / PLOT_FILE)


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(metrics_file: Path, png: Path) -> Optional[Path]:
    """Loss (train, val) and top-1 (raw, EMA) against epoch, one PNG with two panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_file)
    if not rows:
        return None
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, keys, title in ((loss_ax, ("train_loss", "val_loss", "val_ema_loss"), "loss"),
                            (acc_ax, ("val_top1", "val_ema_top1", "val_top5"), "accuracy (%)")):
        for key in keys:
            points = [(r["epoch"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=key)
        ax.set_xlabel("epoch")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
