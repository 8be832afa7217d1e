"""Train or fine-tune an image classifier (DeiT recipe, timm + Accelerate).

    python train_imagenet.py --config configs/quickstart.yaml
    accelerate launch train_imagenet.py --config configs/hdla_tiny.yaml --data-dir /data/imagenet
    accelerate launch --num_processes 2 train_imagenet.py --config configs/hdla_tiny.yaml \
        --data-dir /data/imagenet train.grad_accum_steps=4
    python train_imagenet.py --config configs/hdla_tiny.yaml --data-dir /data/imagenet \
        --eval-only --checkpoint runs/hdla_tiny/best.safetensors

``section.key=value`` arguments anywhere on the command line override the config (values are
parsed as YAML; ``no`` / ``off`` stay words, e.g. ``train.mixed_precision=no``).

Ctrl-C saves a checkpoint at the next step boundary, prints the command that resumes from it
and exits with status 130; a second Ctrl-C stops at once.
"""
import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path

# Nothing heavy is imported here: ``--help`` and config errors answer before torch, timm and
# Accelerate are loaded (``import hdla_vision`` imports them to register the timm models).
_SCHEMA_MODULE = "_hdla_vision_config_schema"
INTERRUPTED = 130  # the shell's status for a process stopped by SIGINT


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--data-dir", default=None,
                        help="dataset root with train/ and val/ (ImageFolder), or 'quickstart'")
    parser.add_argument("--output-dir", default=None, help="default: runs/<config name>")
    parser.add_argument("--resume", default=None,
                        help="checkpoint directory, a run directory, or 'auto' (latest in --output-dir)")
    parser.add_argument("--eval-only", action="store_true", help="only evaluate --checkpoint on the val split")
    parser.add_argument("--checkpoint", default=None, help="weights (.safetensors or run dir) for --eval-only")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_intermixed_args(argv)  # overrides may come before, between or after the options


def config_schema():
    """``hdla_vision/training/config.py`` (yaml and dataclasses only), loaded without its package.

    Importing it as ``hdla_vision.training.config`` would first run ``hdla_vision/__init__.py``,
    which imports torch and timm; this copy only checks a config before training starts.
    """
    if _SCHEMA_MODULE in sys.modules:
        return sys.modules[_SCHEMA_MODULE]
    package = importlib.util.find_spec("hdla_vision")  # finds the package without importing it
    path = Path(package.submodule_search_locations[0]) / "training" / "config.py"
    spec = importlib.util.spec_from_file_location(_SCHEMA_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_SCHEMA_MODULE] = module  # typing.get_type_hints resolves annotations through it
    spec.loader.exec_module(module)
    return module


def check_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError for a bad config, override or option combination, before any heavy import."""
    config_schema().load_config(args.config, args.overrides)
    if args.eval_only and not args.checkpoint:
        raise ValueError("--eval-only needs --checkpoint")


def run(args: argparse.Namespace) -> None:
    """Import the training stack and train (or evaluate)."""
    import hdla_vision  # noqa: F401  (registers hdla models with timm)
    from hdla_vision.training import evaluate_checkpoint, load_config, train

    config = load_config(args.config, args.overrides)
    output_dir = Path(args.output_dir or Path("runs") / Path(args.config).stem)
    if args.eval_only:
        evaluate_checkpoint(config, args.checkpoint, args.data_dir, output_dir)
    else:
        train(config, output_dir, resume=args.resume, data_dir=args.data_dir)


def resume_command(argv: list[str], checkpoint, program: str) -> str:
    """``program argv`` with any ``--resume`` option replaced by ``--resume checkpoint``, as a shell line."""
    kept, skip = [], False
    for token in argv:
        name = token.split("=", 1)[0]
        if skip:
            skip = False
        elif len(name) >= 3 and "--resume".startswith(name):  # --resume X, --resume=X, or an abbreviation
            skip = "=" not in token
        else:
            kept.append(token)
    return f"{program} {shlex.join([*kept, '--resume', str(checkpoint)])}"


def launch_program(argv_given: bool) -> str:
    """How this script was started, as a shell prefix: the interpreter and its options up to the script."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"accelerate launch [the same launch options] {shlex.quote(sys.argv[0])}"
    if argv_given or not getattr(sys, "orig_argv", None):
        return "python train_imagenet.py"
    return shlex.join(sys.orig_argv[: len(sys.orig_argv) - len(sys.argv) + 1])


def interrupted_line(stop: KeyboardInterrupt, args: argparse.Namespace, argv: list[str], program: str) -> str:
    """The one line printed after Ctrl-C: which checkpoint resumes the run, and the command to do it."""
    checkpoint = getattr(stop, "checkpoint", None)
    if checkpoint is not None:
        where = (f"epoch {stop.epoch + 1}, batch {stop.batches_done}" if stop.batches_done
                 else f"end of epoch {stop.epoch}")
        return (f"interrupted: saved {checkpoint} at step {stop.global_step} ({where}); it resumes exactly with: "
                f"{resume_command(argv, checkpoint, program)}")
    latest = latest_checkpoint(args)
    if latest is None:
        return f"interrupted before any checkpoint was saved; start again with: {program} {shlex.join(argv)}"
    return (f"interrupted at once (nothing saved now); the latest checkpoint is {latest}, resume from it with: "
            f"{resume_command(argv, latest, program)}")


def latest_checkpoint(args: argparse.Namespace):
    """The newest ``checkpoints/step_*`` directory of the run's output directory, or None."""
    output_dir = Path(args.output_dir or Path("runs") / Path(args.config).stem)
    found = sorted(p for p in (output_dir / "checkpoints").glob("step_*") if p.is_dir())
    return found[-1] if found else None


def main(argv=None) -> int:
    argv_given = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        check_arguments(args)
        run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # TrainingInterrupted (first Ctrl-C) or a second Ctrl-C
        if os.environ.get("RANK", "0") == "0":
            print(interrupted_line(stop, args, argv, launch_program(argv_given)), file=sys.stderr, flush=True)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
