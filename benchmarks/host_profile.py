"""Where the host's time goes in one backbone block's fwd+bwd: cProfile of the Python side, and the host
time against the device time, and the calls that make it wait for the device.

    python -m benchmarks.host_profile --model hdla_tiny --res 2048 --batch 2
    python -m benchmarks.host_profile --op hires     # chunk_hdla's fwd+bwd at a benchmarks.kernels shape

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
import time
import traceback
import warnings

import torch

from benchmarks.block_profile import FAMILIES, block_step, host_ms, time_ms
from benchmarks.timing import profile_steps


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


def op_steps(shape_name: str):
    """``(fwd_bwd, fwd)``: chunk_hdla's fwd+bwd and its forward alone on random bf16 inputs of
    ``benchmarks.kernels.SHAPES[shape_name]``."""
    from benchmarks.kernels import SHAPES, make_inputs, ours

    inputs = make_inputs(*SHAPES[shape_name], torch.bfloat16, torch.device("cuda"))
    grad = torch.randn_like(ours(*inputs))

    def fwd():
        return ours(*inputs)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), inputs, grad)

    return fwd_bwd, fwd


# Functions whose host time launch_share reports beside Triton's launch path: "module:name", patched in the
# module that looks the name up at call time.
TIMED_FUNCTIONS = ("kernels.generalized.bwd:generalized_backward", "kernels.generalized.bwd:chunk_vjp",
                   "kernels.generalized.bwd:scratch_bytes_per_block", "kernels.generalized.bwd:_check",
                   "kernels.generalized.bwd_chunk:allocate_scratch", "kernels.generalized.two_level:device_sm_count",
                   "kernels.generalized.fwd:generalized_forward", "kernels.custom_ops:run_hdla_backward")


def launch_share(step, steps: int = 20, functions=TIMED_FUNCTIONS) -> str:
    """How much of a step's host time Triton's launch path (``JITFunction.run``) and ``functions`` take:
    each wrapped with a wall-clock timer (no profiler), ``steps`` steps issued behind a queued sleep so
    that no launch waits for the device (keep steps x launches below the launch queue's ~1000 entries).
    Returns lines: host ms per step, then ms per step and calls per step of each timed function."""
    import importlib

    from triton.runtime.jit import JITFunction

    targets = [(JITFunction, "run", "triton JITFunction.run")]
    for spec in functions:
        module, name = spec.split(":")
        targets.append((importlib.import_module(module), name, spec))
    totals = {label: [0.0, 0] for _, _, label in targets}
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def timed(fn, label):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label][0] += time.perf_counter() - start
                totals[label][1] += 1
        return run

    step()
    torch.cuda.synchronize()
    for (owner, name, label), (_, _, fn) in zip(targets, originals):
        setattr(owner, name, timed(fn, label))
    try:
        torch.cuda._sleep(int(2e9))
        start = time.perf_counter()
        for _ in range(steps):
            step()
        host = time.perf_counter() - start
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    torch.cuda.synchronize()
    lines = [f"host {host / steps * 1e3:.3f} ms per step ({steps} steps)"]
    lines += [f"  {label:55s} {t / steps * 1e3:8.3f} ms {n / steps:6.1f} calls" for label, (t, n) in totals.items() if n]
    return "\n".join(lines)


def runtime_profile(step, steps: int = 5, rows: int = 30) -> str:
    """torch.profiler's CPU side of ``steps`` steps by self CPU time: the dispatcher's ops and the CUDA
    runtime calls (launches, cudaMalloc / cudaFree, synchronisations) that cProfile cannot see."""
    prof = profile_steps(step, steps, cpu=True)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=50)


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
    parser.add_argument("--op", default="", help="a benchmarks.kernels shape name: profile chunk_hdla's fwd+bwd "
                        "(bf16) there instead of a block")
    args = parser.parse_args(argv)
    os.environ["HDLA_VISION_KERNELS"] = args.family
    if args.op:
        (step, forward), what = op_steps(args.op), f"chunk_hdla {args.op}"
    else:
        step, forward = block_step(args.model, args.res, args.batch, torch.device("cuda")), None
        what = f"{args.model} {args.res}px batch {args.batch}"
    step_ms = time_ms(step)
    print(f"{what} {args.family}: step {step_ms:.3f} ms (do_bench), host {host_ms(step):.3f} ms per step", flush=True)
    print(launch_share(step, steps=5), flush=True)
    if forward is not None:
        print(f"forward alone: host {host_ms(forward):.3f} ms; {launch_share(forward, steps=5)}", flush=True)
    print(sync_points(step), flush=True)
    print(runtime_profile(step), flush=True)
    print(python_profile(step, rows=args.rows), flush=True)


if __name__ == "__main__":
    main()
