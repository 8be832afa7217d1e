"""One fwd+bwd of ``chunk_hdla`` for Nsight Compute: a warm-up call (compiles), then the profiled call between
``cudaProfilerStart`` / ``cudaProfilerStop`` (run ncu with ``--profile-from-start off``).

    ncu --profile-from-start off --clock-control none -k regex:chunk_intra_kernel python3 -m tools.ncu_step lm

Shapes: benchmarks.kernels.SHAPES (bf16 inputs, benchmarks.kernels.make_inputs).
"""
import sys

import torch

from benchmarks.kernels import SHAPES, make_inputs, ours


def main(shape_name: str) -> None:
    inputs = make_inputs(*SHAPES[shape_name], torch.bfloat16, torch.device("cuda"))
    grad = torch.randn_like(ours(*inputs))

    def step():
        torch.autograd.grad(ours(*inputs), inputs, grad)

    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lm")
