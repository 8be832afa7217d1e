"""One fwd+bwd of ``chunk_hdla`` for Nsight Compute: a warm-up call (compiles), then the profiled call between
``cudaProfilerStart`` / ``cudaProfilerStop`` (run ncu with ``--profile-from-start off``).

    ncu --profile-from-start off --clock-control none -k regex:chunk_intra_kernel python3 -m tools.ncu_step lm

Shapes: benchmarks.kernels.SHAPES (the step is :func:`benchmarks.host_profile.op_steps`' fwd+bwd).
"""
import sys

import torch

from benchmarks.host_profile import op_steps


def main(shape_name: str) -> None:
    step = op_steps(shape_name)[0]
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lm")
