"""One fwd+bwd of an op for Nsight Compute: a warm-up call (compiles), then the profiled call between
``cudaProfilerStart`` / ``cudaProfilerStop`` (run ncu with ``--profile-from-start off``).

    ncu --profile-from-start off --clock-control none -k regex:chunk_intra_kernel python3 -m tools.ncu_step lm
    ncu --profile-from-start off ... -k regex:_chunk_bwd_kernel python3 -m tools.ncu_step lm delta_kda

Shapes: benchmarks.kernels.SHAPES. Ops: ``hdla`` (the default; :func:`benchmarks.host_profile.op_steps`' fwd+bwd of
``chunk_hdla``) and ``delta_kda`` (the delta rule at KDA's shape with tf32 products, ``benchmarks.delta_rule``;
``delta_kda_<precision>`` with another of ``delta_rule.chunk.PRECISIONS``, e.g. ``delta_kda_bf16_dc``).
"""
import sys

import torch

from benchmarks.host_profile import op_steps


def delta_kda_step(shape_name: str, precision: str = "tf32"):
    """fwd+bwd of the delta rule at KDA's shape on random bf16 inputs of ``SHAPES[shape_name]``."""
    from benchmarks.delta_rule import delta_kda
    from benchmarks.kernels import SHAPES, make_inputs

    inputs = make_inputs(*SHAPES[shape_name], torch.bfloat16, torch.device("cuda"))
    op = delta_kda(precision)
    grad = torch.randn_like(op(*inputs))
    return lambda: torch.autograd.grad(op(*inputs), inputs, grad)


STEPS = {"hdla": lambda shape: op_steps(shape)[0], "delta_kda": delta_kda_step}


def main(shape_name: str, op: str = "hdla") -> None:
    if op.startswith("delta_kda_"):
        step = delta_kda_step(shape_name, op.removeprefix("delta_kda_"))
    elif op in STEPS:
        step = STEPS[op](shape_name)
    else:
        raise SystemExit(f"op must be one of {', '.join(STEPS)} or delta_kda_<precision>, got {op!r}")
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main(*(sys.argv[1:] or ["lm"]))
