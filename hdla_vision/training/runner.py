"""Setup of a training run (accelerator, model, data, optimizer, schedule) and the epoch loop."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3

from hdla_vision.training import checkpoint as ckpt
from hdla_vision.training.config import CUDA_GRAPH_MODES, Config
from hdla_vision.training.data import build_data, resolve_data_root
from hdla_vision.training.engine import TrainParts, evaluate, train_one_epoch
from hdla_vision.training.interrupt import StopOnInterrupt, TrainingInterrupted
from hdla_vision.training.models import (create_model, export_metadata, export_weights, load_weights,
                                         resolve_model_config)
from hdla_vision.training.records import RunRecorder

_MAX_GATHERED_INDICES = 20_000_000


@dataclass
class Setup:
    accelerator: Accelerator
    parts: TrainParts
    val_loader: torch.utils.data.DataLoader
    batch_per_process: int
    peak_lr: float
    num_classes: int
    dataset_size: int


def make_accelerator(config: Config, output_dir: Optional[Path] = None) -> Accelerator:
    """The run's Accelerator; with ``output_dir``, logging to ``train.log_with``'s trackers there."""
    trackers = {}
    if output_dir is not None and config.train.log_with:
        trackers = dict(log_with=list(config.train.log_with),
                        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir)))
    return Accelerator(mixed_precision=config.train.mixed_precision,
                       gradient_accumulation_steps=config.train.grad_accum_steps,
                       step_scheduler_with_optimizer=False, **trackers)


def peak_learning_rate(config: Config) -> float:
    """The linear scaling rule: ``base_lr * global_batch_size / lr_base_size``."""
    return config.optim.base_lr * config.train.global_batch_size / config.optim.lr_base_size


def build_criterion(config: Config, mixup_active: bool) -> torch.nn.Module:
    if mixup_active:
        return SoftTargetCrossEntropy()  # Mixup already folds label smoothing into the soft targets
    if config.data.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=config.data.label_smoothing)
    return torch.nn.CrossEntropyLoss()


def setup(config: Config, data_dir: Optional[str] = None, output_dir: Optional[Path] = None) -> Setup:
    """Build everything a run needs; the same on every process (seeded by ``train.seed``).

    ``output_dir``: where a training run's trackers log (None for evaluation: no trackers).
    """
    if config.train.compile:
        check_compile_backend(config.train.compile_backend)
    accelerator = make_accelerator(config, output_dir)
    set_seed(config.train.seed)
    model = create_model(config)
    root = resolve_data_root(config, data_dir)
    data = build_data(config, root, model, accelerator.num_processes)  # may cap train.global_batch_size
    per_process = data.batch_per_process
    if data.mixup is not None and per_process % 2:
        raise ValueError(f"mixup/cutmix need an even batch per process, got {per_process}")
    peak_lr = peak_learning_rate(config)
    o = config.optim
    optimizer = create_optimizer_v2(model, o.opt, lr=peak_lr, weight_decay=o.weight_decay, betas=tuple(o.betas),
                                    eps=o.eps, layer_decay=o.layer_decay)
    updates_per_epoch = math.ceil(len(data.train_order) // (per_process * accelerator.num_processes)
                                  / config.train.grad_accum_steps)
    s = config.sched
    scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=s.epochs, warmup_epochs=s.warmup_epochs,
                                       warmup_lr=s.warmup_lr, min_lr=s.min_lr, step_on_epochs=False,
                                       updates_per_epoch=updates_per_epoch)
    model, optimizer, train_loader, val_loader = accelerator.prepare(
        model, optimizer, data.train_loader, data.val_loader)
    ema = None
    if config.train.ema:
        ema = ModelEmaV3(accelerator.unwrap_model(model), decay=config.train.ema_decay,
                         use_warmup=config.train.ema_warmup)
    parts = TrainParts(
        accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
        criterion=build_criterion(config, data.mixup is not None), train_loader=train_loader,
        train_order=data.train_order, mixup=data.mixup, ema=ema, clip_grad=o.clip_grad,
        log_every=config.train.log_every_steps, progress_bar=config.train.progress_bar,
        checkpoint_every=config.train.checkpoint_every_steps,
        record_indices=config.train.consistency_checks,
        compiled=(compile_for_training(model, config.train.compile_backend, config.train.compile_mode)
                  if config.train.compile else None),
        grads_in_place=grads_in_place(config),
    )
    if parts.grads_in_place:
        allocate_grads(model)
    return Setup(accelerator, parts, val_loader, per_process, peak_lr, data.num_classes,
                 data.train_order.num_samples)


def grads_in_place(config: Config) -> bool:
    """Whether the run keeps every ``.grad`` allocated across steps (``TrainParts.grads_in_place``): where the
    step replays CUDA graphs (``train.compile_mode`` reduce-overhead or max-autotune) and accumulates gradients.

    Under CUDA graph trees the backward's gradients are outputs of the recorded graph, in its memory pool.
    Autograd installs a gradient as ``.grad`` where ``.grad`` is None, so the next micro-step's replay would
    overwrite the gradient accumulated so far (pytorch/pytorch#169545). With ``.grad`` allocated outside the
    pool (:func:`allocate_grads`) and zeroed instead of freed after each optimizer step, autograd adds each
    micro-step's gradient into it."""
    t = config.train
    return t.compile and t.compile_mode in CUDA_GRAPH_MODES and t.grad_accum_steps > 1


def allocate_grads(model: torch.nn.Module) -> None:
    """A zero ``.grad`` for every trainable parameter that has none (outside any CUDA graph pool)."""
    for param in model.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)


def check_compile_backend(name: str) -> None:
    """``train.compile_backend`` must name a backend torch.compile knows (checked here, not in the config
    schema, which answers before torch is imported)."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(f"config key 'train.compile_backend' must be a torch.compile backend, got {name!r} "
                         f"(known: {', '.join(known)})")


def compile_for_training(model: torch.nn.Module, backend: str, mode: str = "default") -> torch.nn.Module:
    """``torch.compile(model, backend=backend, mode=mode)`` for the training step (``train.compile``).

    ``model`` is the module ``accelerator.prepare`` returned; the compiled module wraps it and shares
    its parameters, so the optimizer, the EMA, checkpoints (``accelerator.save_state`` saves the
    prepared module: no ``_orig_mod.`` prefixes) and exports are those of the eager run, and resuming
    restores them the same way. Evaluation runs ``model`` eagerly (one compiled graph, training mode).
    The first step compiles (about a minute for a tiny backbone with inductor on a GPU); a batch of
    another size compiles once more, with a dynamic batch dimension. Not ``fullgraph``: any timm
    model trains; our backbones compile to one graph (tests/test_compiled_models.py).

    ``mode`` (``train.compile_mode``, inductor only): "reduce-overhead" records the forward and the
    backward as CUDA graphs (torch's CUDA graph trees) and replays them, so the host no longer issues
    every kernel: what an eager step at high resolution waits on. The engine marks each training step's
    start (``torch.compiler.cudagraph_mark_step_begin``), so a step's graph outputs stay valid until the
    next step begins."""
    if backend != "inductor":
        return torch.compile(model, backend=backend)
    return torch.compile(model, backend=backend, mode=mode)


def run_identity(config: Config, setup_: Setup) -> dict:
    """What a checkpoint must share with the run that resumes it."""
    return {
        "model_name": config.model.name, "model_kwargs": config.model.kwargs,
        "num_classes": config.data.num_classes, "img_size": config.data.img_size,
        "num_processes": setup_.accelerator.num_processes, "global_batch_size": config.train.global_batch_size,
        "grad_accum_steps": config.train.grad_accum_steps, "seed": config.train.seed,
        "train_samples": setup_.dataset_size,
    }


@dataclass
class Run:
    """A run ready to train: its setup, loop state, records and checkpoint writer."""
    setup: Setup
    state: ckpt.TrainerState
    recorder: RunRecorder
    save: Callable[[ckpt.TrainerState], Path]
    output_dir: Path


def train(config: Config, output_dir: str | Path, resume: Optional[str] = None,
          data_dir: Optional[str] = None) -> dict:
    """Train for ``sched.epochs`` epochs (continuing a checkpoint if ``resume``); return the last epoch's row.

    Ctrl-C (SIGINT) checkpoints at the next step boundary and raises ``TrainingInterrupted``
    naming the checkpoint (see ``interrupt.py``); a second Ctrl-C raises ``KeyboardInterrupt``.
    """
    run = start_run(config, Path(output_dir), resume, data_dir)
    acc = run.setup.accelerator
    with StopOnInterrupt(announce=acc.is_main_process) as stop:
        run.setup.parts.should_stop = lambda: stop.agreed(acc)
        acc.print(run_line(config, run.setup))
        try:
            row = _train_epochs(config, run, stop)
        except TrainingInterrupted:  # every process agreed to stop: they leave together
            run.recorder.close(plot=False)
            acc.end_training()
            raise
        except BaseException:
            run.recorder.close(plot=False)  # what was logged stays on disk; the curves are drawn at the end
            raise
        row = _finish(run, row)
    acc.end_training()  # destroys the process groups: gloo's threads outliving them abort the process at exit
    return row


def start_run(config: Config, output_dir: Path, resume: Optional[str], data_dir: Optional[str]) -> Run:
    """Set up, load the checkpoint to resume (if any) and open the records."""
    s = setup(config, data_dir, output_dir)
    acc = s.accelerator
    identity = run_identity(config, s)
    state = ckpt.TrainerState()
    registered = ckpt.register_objects(acc, state, s.parts.ema.module if s.parts.ema is not None else None)
    resume_dir = ckpt.find_resume_dir(resume, output_dir) if resume else None
    if resume_dir is not None:
        ckpt.load_checkpoint(acc, resume_dir, registered, identity)  # fills ``state`` in place
        s.parts.scheduler.step_update(num_updates=state.global_step)
        acc.print(f"resumed from {resume_dir}: epoch {state.epoch}, batch {state.batches_done}, "
                  f"step {state.global_step}")
    elif resume:
        acc.print(f"--resume {resume}: no checkpoint in {ckpt.checkpoint_root(output_dir)}, starting a new run")
    if acc.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    resumed_at = (state.epoch, state.global_step) if resume_dir else (None, None)
    recorder = RunRecorder(acc, output_dir, *resumed_at)

    def save(st: ckpt.TrainerState) -> Path:
        if st is not state:
            raise ValueError("save: only the registered TrainerState is checkpointed")
        return ckpt.save_checkpoint(acc, output_dir, st, registered, identity, config.train.keep_checkpoints)

    s.parts.on_log, s.parts.on_checkpoint = recorder.log_step, save
    return Run(s, state, recorder, save, output_dir)


def run_line(config: Config, s: Setup) -> str:
    """The line printed before the first step: processes, batch sizes, peak lr, batches per epoch."""
    return (f"{config.model.name}: {s.accelerator.num_processes} process(es) x {s.batch_per_process} images "
            f"x {config.train.grad_accum_steps} accumulation = global batch {config.train.global_batch_size}, "
            f"peak lr {s.peak_lr:.3g}, {len(s.parts.train_loader)} batches per process per epoch")


def _train_epochs(config: Config, run: Run, stop: StopOnInterrupt) -> dict:
    """The epoch loop; a stop requested during an epoch with no later step boundary is taken at its end."""
    acc, state, row = run.setup.accelerator, run.state, {}
    for _ in range(state.epoch, config.sched.epochs):
        row = _run_epoch(config, run.setup, state, run.output_dir)
        run.recorder.log_epoch(row)
        acc.print(epoch_line(row, config.sched.epochs))
        path = run.save(state)
        if state.epoch < config.sched.epochs and stop.agreed(acc):
            raise TrainingInterrupted(path, state.epoch, state.batches_done, state.global_step)
    return row


def _finish(run: Run, row: dict) -> dict:
    """Checksums (``train.consistency_checks``), final.json, the curves and the summary."""
    acc = run.setup.accelerator
    if run.setup.parts.record_indices:
        row["param_checksum_per_process"] = _agreeing_checksums(acc, run.setup.parts.model)
    if acc.is_main_process:
        (run.output_dir / "final.json").write_text(json.dumps(row, indent=2))
    plot = run.recorder.close()
    _print_summary(acc, row, run.output_dir, plot)
    return row


def _run_epoch(config: Config, s: Setup, state: ckpt.TrainerState, output_dir: Path) -> dict:
    acc, parts = s.accelerator, s.parts
    epoch = state.epoch
    stats = train_one_epoch(parts, state)
    row = {
        "epoch": epoch, "global_step": state.global_step,
        "train_loss": acc.reduce(torch.tensor(stats.loss, device=acc.device), "mean").item(),
        "lr": max(g["lr"] for g in parts.optimizer.param_groups),
        "epoch_seconds": stats.seconds,
        "images_per_second": stats.images * acc.num_processes / max(stats.seconds, 1e-9),
    }
    row.update(_shard_statistics(acc, stats.images, stats.seen_indices))
    if (epoch + 1) % config.train.eval_every_epochs == 0 or epoch + 1 == config.sched.epochs:
        row.update(_evaluate_and_track_best(config, s, state, output_dir))
    state.start_next_epoch()
    _export(config, s, output_dir, "model.safetensors", acc.unwrap_model(parts.model), epoch=epoch)
    if parts.ema is not None:
        _export(config, s, output_dir, "model_ema.safetensors", parts.ema.module, epoch=epoch)
    return row


def _shard_statistics(acc: Accelerator, images: int, seen: list) -> dict:
    """Images per process and (if indices were recorded) how many distinct samples the processes saw together."""
    counts = acc.gather(torch.tensor([images], device=acc.device)).tolist()
    result = {"images_per_process": counts}
    if seen and len(seen) * acc.num_processes <= _MAX_GATHERED_INDICES:
        gathered = acc.gather(torch.tensor(seen, device=acc.device))
        result["distinct_samples"] = int(gathered.unique().numel())
    return result


def _evaluate_and_track_best(config: Config, s: Setup, state: ckpt.TrainerState, output_dir: Path) -> dict:
    acc, parts = s.accelerator, s.parts
    results = {"raw": evaluate(parts.model, s.val_loader, acc, s.num_classes)}
    if parts.ema is not None:
        results["ema"] = evaluate(parts.ema.module, s.val_loader, acc, s.num_classes)
    row = {}
    for source, metrics in results.items():
        prefix = "val" if source == "raw" else "val_ema"
        row.update({f"{prefix}_top1": metrics["top1"], f"{prefix}_top5": metrics["top5"],
                    f"{prefix}_loss": metrics["loss"]})
        if metrics["top1"] > state.best_top1:
            state.best_top1, state.best_epoch, state.best_source = metrics["top1"], state.epoch, source
            module = acc.unwrap_model(parts.model) if source == "raw" else parts.ema.module
            _export(config, s, output_dir, "best.safetensors", module, epoch=state.epoch, source=source,
                    top1=metrics["top1"])
    row.update({"best_top1": state.best_top1, "best_epoch": state.best_epoch, "best_source": state.best_source})
    return row


def _export(config: Config, s: Setup, output_dir: Path, name: str, module: torch.nn.Module, **extra) -> None:
    if s.accelerator.is_main_process:
        meta = export_metadata(config.model.name, config.data.num_classes, config.data.img_size,
                               config.model.kwargs, **extra)
        export_weights(module, output_dir / name, meta)


def _agreeing_checksums(acc: Accelerator, model: torch.nn.Module) -> list:
    """A position-weighted sum of all parameters on each process; they must be identical."""
    total = torch.zeros((), dtype=torch.float64, device=acc.device)
    for i, param in enumerate(acc.unwrap_model(model).parameters()):
        total += param.detach().double().sum() * (i + 1)
    sums = acc.gather(total[None]).tolist()
    if len(set(sums)) != 1:
        raise RuntimeError(f"processes ended with different parameters (checksums {sums})")
    return sums


def epoch_line(row: dict, epochs: int) -> str:
    """One line per epoch: train loss, validation of the raw and (if any) EMA weights, best so far."""
    parts = [f"epoch {row['epoch'] + 1}/{epochs}", f"train loss {row['train_loss']:.4f}"]
    for prefix, label in (("val", "raw"), ("val_ema", "EMA")):
        if row.get(f"{prefix}_top1") is not None:
            parts.append(f"val {label} top-1 {row[f'{prefix}_top1']:.2f} top-5 {row[f'{prefix}_top5']:.2f} "
                         f"loss {row[f'{prefix}_loss']:.4f}")
    if "val_top1" not in row:
        parts.append("no validation this epoch")
    elif row.get("best_epoch", -1) >= 0:
        parts.append(f"best top-1 {row['best_top1']:.2f} ({row['best_source']}, epoch {row['best_epoch'] + 1})")
    parts.append(f"{row['images_per_second']:.1f} img/s")
    return " | ".join(parts)


def summary_lines(row: dict, output_dir: Path, plot: Optional[Path]) -> list[str]:
    """The end-of-run summary; entries that do not apply (EMA off, no plot) are left out, never 'None'."""
    entries = [("epochs trained", row.get("epoch", -1) + 1), ("final train loss", row.get("train_loss")),
               ("val top-1 (raw)", row.get("val_top1")), ("val top-1 (EMA)", row.get("val_ema_top1")),
               ("val top-5 (raw)", row.get("val_top5")), ("val top-5 (EMA)", row.get("val_ema_top5")),
               ("best top-1", row.get("best_top1")), ("train img/s (last epoch)", row.get("images_per_second")),
               ("outputs", str(output_dir)), ("curves", str(plot) if plot is not None else None)]
    entries = [(k, v) for k, v in entries if v is not None]
    width = max(len(k) for k, _ in entries)
    return [f"{k:<{width}}  {f'{v:.4f}' if k == 'final train loss' else f'{v:.2f}' if isinstance(v, float) else v}"
            for k, v in entries]


def _print_summary(acc: Accelerator, row: dict, output_dir: Path, plot: Optional[Path]) -> None:
    if acc.is_main_process and row:
        print("\n".join(summary_lines(row, output_dir, plot)))


def evaluate_checkpoint(config: Config, checkpoint: str, data_dir: Optional[str] = None,
                        output_dir: Optional[str | Path] = None) -> dict:
    """Eval-only mode: load exported weights strictly and report validation top-1 / top-5.

    The model's name and kwargs come from the file's metadata where the config leaves them unset.
    """
    resolve_model_config(config, checkpoint)
    config.model.init_checkpoint = None
    s = setup(config, data_dir)
    acc = s.accelerator
    meta = load_weights(acc.unwrap_model(s.parts.model), checkpoint, expected_name=config.model.name,
                        model_kwargs=config.model.kwargs)
    metrics = evaluate(s.parts.model, s.val_loader, acc, s.num_classes)
    metrics["checkpoint"] = str(checkpoint)
    metrics["checkpoint_epoch"] = meta.get("epoch")
    if acc.is_main_process:
        print(json.dumps(metrics, indent=2))
        if output_dir is not None:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / "eval.json").write_text(json.dumps(metrics, indent=2))
    return metrics
