"""Where the host's time goes in one backbone block's fwd+bwd: cProfile of the Python side, and the host
time against the device time.

    python -m benchmarks.host_profile --model hdla_tiny --res 2048 --batch 2

A step is :func:`benchmarks.block_profile.block_step` (the block's forward under bf16 autocast, ``sum()``,
backward). The host time of a step is its wall time with the GPU kept busy far ahead (a long sleep kernel
queued first, so that no launch waits for the device); the device time is the ``do_bench`` median of the
same step. cProfile's table (``--rows`` functions by own time) then says which Python functions the
host time is spent in. Needs CUDA.
"""
import argparse
import cProfile
import io
import os
import pstats
import time

import torch

from benchmarks.block_profile import FAMILIES, block_step, time_ms


def host_ms(step, steps: int = 10) -> float:
    """Wall time per step while the GPU is busy with a long sleep queued before the steps: the host's
    own cost of issuing them (launches, Python, the dispatcher), with no wait on the device."""
    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of device time at ~2 GHz: the steps below queue behind it
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = (time.perf_counter() - start) / steps * 1e3
    torch.cuda.synchronize()
    return elapsed


def python_profile(step, steps: int = 5, rows: int = 40) -> str:
    torch.cuda._sleep(int(4e9))
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
    print(python_profile(step, rows=args.rows), flush=True)


if __name__ == "__main__":
    main()
