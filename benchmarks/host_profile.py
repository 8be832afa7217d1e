"""Where the host's time goes in one backbone block's fwd+bwd: cProfile of the Python side, and the host
time against the device time, and the calls that make it wait for the device.

    python -m benchmarks.host_profile --model hdla_tiny --res 2048 --batch 2

A step is :func:`benchmarks.block_profile.block_step` (the block's forward under bf16 autocast, ``sum()``,
backward). The host time of a step is its wall time with the GPU kept busy ahead of it (a sleep kernel queued
first, so that no launch waits for the device); the device time is the ``do_bench`` median of the
same step (the step is host-bound where its host time is the larger). ``set_sync_debug_mode`` lists the
calls that synchronise with the device, and cProfile's table (``--rows`` functions by own time) says which
Python functions the host time is spent in. Needs CUDA.
"""
import argparse
import cProfile
import io
import os
import pstats
import traceback
import warnings

import torch

from benchmarks.block_profile import FAMILIES, block_step, host_ms, time_ms


def sync_points(step) -> str:
    """The calls of one step that synchronise with the device (``torch.cuda.set_sync_debug_mode``), with
    the last frames of each one's stack."""
    torch.cuda.synchronize()
    caught = []

    def keep(message, category, filename, lineno, file=None, line=None):
        frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[-9:-1]]
        caught.append((str(message)[:120], frames))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = [f"synchronising calls in one step: {len(caught)}"]
    for message, frames in caught:
        lines.append(f"  {message}")
        lines.extend(f"    {frame}" for frame in frames)
    return "\n".join(lines)


def python_profile(step, steps: int = 5, rows: int = 40) -> str:
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    out.write("\n-- by cumulative time --\n")
    stats.sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="hdla_tiny")
    parser.add_argument("--res", type=int, default=224)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--family", default="chunk64", choices=FAMILIES)
    parser.add_argument("--rows", type=int, default=40)
    args = parser.parse_args(argv)
    os.environ["HDLA_VISION_KERNELS"] = args.family
    step = block_step(args.model, args.res, args.batch, torch.device("cuda"))
    step_ms = time_ms(step)
    print(f"{args.model} {args.res}px batch {args.batch} {args.family}: step {step_ms:.3f} ms (do_bench), "
          f"host {host_ms(step):.3f} ms per step", flush=True)
    print(sync_points(step), flush=True)
    print(python_profile(step, rows=args.rows), flush=True)


if __name__ == "__main__":
    main()
