"""The benchmarks' one timing rule: ``triton.testing.do_bench`` medians after warm-up."""
import os
import statistics
import time
from contextlib import contextmanager
from typing import Optional

import torch
import triton


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` (do_bench: ``warmup`` ms of warm-up, ``rep`` ms of timed calls)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def cpu_median_ms(fn, reps: int = 5) -> float:
    """:func:`median_ms` for CPU work (no CUDA events): the median of ``reps`` wall-clock calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_fwd_bwd(fn, inputs, median=median_ms, cuda_graphs: bool = False):
    """(fwd ms, fwd+bwd ms) of ``fn(*inputs) -> o``: the forward under no_grad, then forward and the
    gradients of every input tensor that requires one (unused ones allowed: SDPA ignores beta, g).
    ``median``: :func:`median_ms`, or :func:`cpu_median_ms` for CPU tensors. ``cuda_graphs``: each of the
    two timed as the replay of one CUDA graph (:func:`graphed`), so that the host's launch work is not in it."""
    grad = torch.randn_like(fn(*inputs))
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        torch.autograd.grad(fn(*inputs), wrt, grad, allow_unused=True)

    if not cuda_graphs:
        return median(fwd), median(fwd_bwd)
    return tuple(median(graphed(step)) for step in (fwd, fwd_bwd))


def graphed(step, warmup_calls: int = 3):
    """``step`` (no arguments) captured as one CUDA graph: a function that replays it. The warm-up calls run on a
    side stream first (autotuning and compilation happen there, outside the capture). A replay runs the captured
    kernels with none of the host's work (argument handling, launches, allocation), as a CUDA-graph training step
    does (``train.compile_mode=reduce-overhead``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def profile_steps(step, steps: int, cpu: bool = False, record_shapes: bool = False):
    """torch.profiler over ``steps`` calls of ``step()`` after one warm-up call (the profiler object;
    CUDA activity, and the host's with ``cpu``). Divide its totals by ``steps`` for per-step figures."""
    step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if cpu else [])
    with torch.profiler.profile(activities=activities, record_shapes=record_shapes) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof


def device_us(event) -> float:
    """An event's total device µs (``device_time_total``; ``cuda_time_total`` on older torch)."""
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)


@contextmanager
def env_var(name: str, value: Optional[str]):
    """``$name`` set to ``value`` inside the block (None: left as it is), restored after; for the settings the ops
    read at every call (the kernel family, B2's scratch dtypes)."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
