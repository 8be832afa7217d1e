"""The benchmarks' one timing rule: ``triton.testing.do_bench`` medians after warm-up."""
import statistics
import time

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


def time_fwd_bwd(fn, inputs, median=median_ms):
    """(fwd ms, fwd+bwd ms) of ``fn(*inputs) -> o``: the forward under no_grad, then forward and the
    gradients of every input tensor that requires one (unused ones allowed: SDPA ignores beta, g).
    ``median``: :func:`median_ms`, or :func:`cpu_median_ms` for CPU tensors."""
    grad = torch.randn_like(fn(*inputs))
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        torch.autograd.grad(fn(*inputs), wrt, grad, allow_unused=True)

    return median(fwd), median(fwd_bwd)


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
