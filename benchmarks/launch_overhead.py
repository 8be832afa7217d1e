"""Host cost of one Triton launch: what a kernel with our kernels' argument counts costs the host per call,
through Triton's ``kernel[grid](...)`` path and through a launch of the already compiled kernel (no argument
binding, specialisation or cache key), against one small PyTorch op.

    python -m benchmarks.launch_overhead [--launches 300]

Each figure is the median over 5 repetitions of the wall time of ``launches`` calls issued while the GPU is
still busy with a sleep queued before them (so no call waits for the device), divided by ``launches``. Our
chunk kernels take 20-60 arguments (tensors, ints, constexprs) and chunk_hdla's fwd+bwd issues 39 launches at
the high-res shape, 2.0 of its 5.0 ms of host time (benchmarks/results/launch_h100/host_hires.txt). A launch cache in Python (a key from each
argument's dtype, alignment or value, then the compiled kernel's launcher) cost 45-48 µs here: no less than
Triton's own path (benchmarks/results/launch_h100/, 2026-11-25, third). Needs CUDA.
"""
import argparse
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _few_args_kernel(x_ptr, n):
    tl.store(x_ptr + tl.program_id(0), n)


@triton.jit
def _many_args_kernel(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, p16, p17, p18, p19,
                      n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, scale,
                      C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                      C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr):
    """A store into p0 that reads every argument's shape: 20 tensors, 10 ints, a float and 8 constexprs
    (B2's ``_vjp_kernel`` has 31 tensors, 15 ints, a float and 19 constexprs)."""
    total = n0 + n1 + n2 + n3 + n4 + n5 + n6 + n7 + n8 + n9 + C0 + C1 + C2 + C3 + C4 + C5 + C6 + C7
    tl.store(p0 + tl.program_id(0), total * scale)


def _per_launch_us(issue, launches: int, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
        start = time.perf_counter()
        for _ in range(launches):
            issue()
        times.append((time.perf_counter() - start) / launches * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def measure(launches: int) -> dict:
    dev = torch.device("cuda")
    tensors = [torch.zeros(64, device=dev) for _ in range(20)]
    ints = list(range(16, 26))
    consts = dict(C0=1, C1=2, C2=3, C3=4, C4=5, C5=6, C6=7, C7=8)
    grid = (4, 3, 2)
    compiled = _many_args_kernel[grid](*tensors, *ints, 0.5, **consts)
    every_arg = (*tensors, *ints, 0.5, *consts.values())  # the compiled launcher takes constexprs too (ignored)
    direct = compiled[grid]
    tensors[0].zero_()
    direct(*every_arg)
    expected = (sum(ints) + sum(consts.values())) * 0.5
    if tensors[0][0].item() != expected:  # the direct launch must run the same kernel on the same arguments
        raise RuntimeError(f"direct launch stored {tensors[0][0].item()}, expected {expected}")
    x = torch.zeros(64, device=dev)
    rows = {
        "torch x.add_(1)": _per_launch_us(lambda: x.add_(1), launches),
        "triton 2 args, kernel[grid]": _per_launch_us(lambda: _few_args_kernel[(4,)](x, 3), launches),
        "triton 39 args, kernel[grid]": _per_launch_us(
            lambda: _many_args_kernel[grid](*tensors, *ints, 0.5, **consts), launches),
        "triton 39 args, compiled kernel": _per_launch_us(lambda: direct(*every_arg), launches),
    }
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=300)
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    for name, us in measure(args.launches).items():
        print(f"{name:40s} {us:8.2f} µs per call")


if __name__ == "__main__":
    main()
