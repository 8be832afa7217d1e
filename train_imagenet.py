"""Train or fine-tune an image classifier (DeiT recipe, timm + Accelerate).

    python train_imagenet.py --config configs/quickstart.yaml
    accelerate launch train_imagenet.py --config configs/hdla_tiny.yaml --data-dir /data/imagenet
    accelerate launch --num_processes 2 train_imagenet.py --config configs/hdla_tiny.yaml \
        --data-dir /data/imagenet train.grad_accum_steps=4
    python train_imagenet.py --config configs/hdla_tiny.yaml --data-dir /data/imagenet \
        --eval-only --checkpoint runs/hdla_tiny/best.safetensors

``section.key=value`` arguments anywhere on the command line override the config (values are
parsed as YAML; ``no`` / ``off`` stay words, e.g. ``train.mixed_precision=no``).
"""
import argparse
import sys
from pathlib import Path

import hdla_vision  # noqa: F401  (registers hdla models with timm)
from hdla_vision.training import evaluate_checkpoint, load_config, train


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


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        output_dir = Path(args.output_dir or Path("runs") / Path(args.config).stem)
        if args.eval_only:
            if not args.checkpoint:
                raise ValueError("--eval-only needs --checkpoint")
            evaluate_checkpoint(config, args.checkpoint, args.data_dir, output_dir)
        else:
            train(config, output_dir, resume=args.resume, data_dir=args.data_dir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
