"""Training throughput of a model under the engine's step (synthetic data, one GPU).

    python benchmarks/train_throughput.py --models hdla_tiny deit_tiny_patch16_224 --batch-size 256

Each step is exactly ``engine._train_step``: Accelerate bf16 autocast, AdamW from timm's
optimizer factory, gradient clipping, then an EMA update. Images are random tensors already
on the GPU, so the number measures model + optimizer, not data loading. Writes
``$OUT/train_throughput.json`` when ``$OUT`` is set and prints a table.
"""
import argparse
import json
import os
import time

import hdla_vision  # noqa: F401  (registers hdla models with timm)
import torch
from timm.optim import create_optimizer_v2
from timm.utils import ModelEmaV3

from hdla_vision.training.config import config_from_dict
from hdla_vision.training.engine import TrainParts, _train_step
from hdla_vision.training.models import create_model
from hdla_vision.training.runner import make_accelerator


def measure(name: str, batch: int, img_size: int, steps: int, warmup: int, precision: str) -> dict:
    config = config_from_dict({"model": {"name": name, "drop_path_rate": 0.1},
                               "data": {"img_size": img_size, "num_classes": 1000},
                               "train": {"mixed_precision": precision, "global_batch_size": batch}})
    accelerator = make_accelerator(config)
    model = create_model(config)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    ema = ModelEmaV3(accelerator.unwrap_model(model), decay=0.9999)
    parts = TrainParts(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=None,
                       criterion=torch.nn.CrossEntropyLoss(), train_loader=None, train_order=None, clip_grad=5.0)
    images = torch.randn(batch, 3, img_size, img_size, device=accelerator.device)
    targets = torch.randint(0, 1000, (batch,), device=accelerator.device)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            start = time.perf_counter()
        _train_step(parts, images, targets)
        ema.update(accelerator.unwrap_model(model))
    sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return {"model": name, "batch": batch, "img_size": img_size, "precision": precision,
            "img_per_s": batch * steps / seconds, "step_ms": 1000 * seconds / steps, "peak_gib": peak,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["hdla_tiny", "deit_tiny_patch16_224"])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--precision", default="bf16", choices=["no", "bf16", "fp16"])
    args = parser.parse_args()
    rows = []
    for name in args.models:
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(reset_partial_state=True)
        rows.append(measure(name, args.batch_size, args.img_size, args.steps, args.warmup, args.precision))
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "train_throughput.json"), "w") as handle:
            json.dump(rows, handle, indent=2)
    print(f"{'model':<26}{'batch':>6}{'px':>5}{'prec':>6}{'img/s':>10}{'ms/step':>9}{'peak GiB':>10}")
    for r in rows:
        print(f"{r['model']:<26}{r['batch']:>6}{r['img_size']:>5}{r['precision']:>6}{r['img_per_s']:>10.0f}"
              f"{r['step_ms']:>9.1f}{r['peak_gib']:>10.2f}")
    print(f"device: {rows[0]['device']}")


if __name__ == "__main__":
    main()
