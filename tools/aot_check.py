"""Compile the Triton kernels an op launches for an H100 (sm_90a) on a machine without a GPU, and
report each kernel's registers, local-memory spills, shared memory and whether it uses wgmma.

    python -m tools.aot_check                 # the chunk ops at the benchmark shapes (bf16)
    python -m tools.aot_check --shapes lm     # one shape
    python -m tools.aot_check --bidirectional # the bidirectional ops (both directions in one launch)
    python -m tools.aot_check --host --ops hdla --shapes hires --s4-group 1,4   # host time, nothing launched
    python -m tools.aot_check --ops delta_kda,delta_gdn --shapes lm,hires   # the delta rule's kernels
    python -m tools.aot_check --ops delta_kda_bf16,delta_gdn_bf16_dc --shapes lm   # other precisions (chunk.PRECISIONS)

A launch ``kernel[grid](...)`` inside :func:`compile_only` compiles exactly what the GPU would
(the same specialisation, constexprs, num_warps and num_stages) through Triton's own pipeline down to
a cubin, and returns without running it; the op's outputs are then garbage. It catches, before any
device time is spent, kernels that fail to compile or that spill registers at the real shapes.
Autotuned kernels compile every config. Timing still needs the device (benchmarks/kernels.py).

``--host`` times instead the Python side of one fwd+bwd (our glue, Triton's binding and cache lookup of
each launch, nothing launched; median of ``--repeats``) and counts its launches, for each S4 grouping
(``bwd_chunk.b2_config``'s ``s4_group``). On a CPU the op's own PyTorch calls (scratch allocation and
zeroing) really run on CPU tensors, so only differences between settings carry over to a GPU's host.
"""
import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Dict, List

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver as triton_driver
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

H100 = GPUTarget("cuda", 90, 32)


class _CompileOnlyDriver:
    """Stands in for the CUDA driver: a device 0 of the given target, no stream, nothing launched."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> Dict[str, int]:
    """Registers, stack / local bytes (spills) and static shared memory of one cubin (cuobjdump -res-usage)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        match = re.search(rf"\b{key}:(\d+)", text)
        usage[key.lower()] = int(match.group(1)) if match else -1
    return usage


@contextmanager
def compile_only(target: GPUTarget = H100):
    """Within the block, Triton launches compile for ``target`` and return without running; yields the
    list of records ``{kernel, num_warps, num_stages, constexprs, reg, stack, local, shared, dyn_shared, wgmma}``."""
    records: List[dict] = []
    old_driver = triton_driver._active
    old_run, old_tune = JITFunction.run, Autotuner.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = old_run(self, *args, grid=grid, warmup=True, **kwargs)
        ptx = kernel.asm.get("ptx", "")
        constexprs = {k: v for k, v in kwargs.items() if k.isupper()}
        records.append(dict(kernel=self.__name__, num_warps=kernel.metadata.num_warps,
                            num_stages=kernel.metadata.num_stages, constexprs=constexprs,
                            dyn_shared=kernel.metadata.shared, wgmma="wgmma.mma_async" in ptx,
                            **resource_usage(kernel.asm["cubin"])))
        return kernel

    def tune(self, *args, **kwargs):  # every config, no benchmarking
        for config in self.configs:
            self.fn.run(*args, **dict(kwargs, **config.all_kwargs()))

    triton_driver.set_active(_CompileOnlyDriver(target))
    JITFunction.run, Autotuner.run = run, tune
    try:
        yield records
    finally:
        JITFunction.run, Autotuner.run = old_run, old_tune
        triton_driver._active = old_driver


def format_records(records: List[dict]) -> str:
    lines = [f"{'kernel':36s}{'warps':>6s}{'stages':>7s}{'regs':>6s}{'spill B':>9s}{'smem KB':>9s}{'wgmma':>7s}  constexprs"]
    for r in records:
        spill = max(r["stack"], 0) + max(r["local"], 0)
        const = ", ".join(f"{k}={v}" for k, v in r["constexprs"].items())
        lines.append(f"{r['kernel'][:36]:36s}{r['num_warps']:6d}{r['num_stages']:7d}{r['reg']:6d}{spill:9d}"
                     f"{r['dyn_shared'] / 1024:9.1f}{str(r['wgmma']):>7s}  {const}")
    return "\n".join(lines)


@contextmanager
def triton_path_for_cpu_tensors():
    """Route CPU tensors to the Triton path of the public ops (``use_triton`` answers True in every
    kernels module that imported it), so that :func:`compile_only` sees the launches a GPU would."""
    def always(x):
        return True

    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith(("hdla_vision.kernels", "kernels")) and hasattr(module, "use_triton"):
            patched.append((module, module.use_triton))
            module.use_triton = always
    try:
        yield
    finally:
        # the real function, also where one module object is listed under two names (its second entry saw `always`)
        real = next((original for module, original in patched if original is not always
                     and module.__name__.endswith("kernels.utils")), None)
        for module, original in patched:
            module.use_triton = real if original is always and real is not None else original
        # a module first imported inside the block took the patched name from kernels.utils: give it the real one
        for module in list(sys.modules.values()):
            if getattr(module, "use_triton", None) is always and real is not None:
                module.use_triton = real


def op_inputs(op: str, batch: int, seq_len: int, heads: int, dim: int, dtype=torch.bfloat16):
    """Zero inputs of the real shapes (CPU) for ``op``: ``hdla`` (q, k, v, beta, g), a generalized
    op (q, k, v, a, b, g): ``kda`` (r_ab = 1, vector decay), ``gla`` (r_ab = 0), ``gdn`` (r_ab = 1, decay per head),
    or the delta rule (q, k, v, beta, g, write): ``delta_kda`` (g per channel), ``delta_gdn`` (g per head)."""
    q = torch.zeros(batch, seq_len, heads, dim, dtype=dtype, requires_grad=True)
    if op.startswith("delta_"):
        beta = torch.zeros(batch, seq_len, heads, dtype=dtype, requires_grad=True)
        g_shape = (batch, seq_len, heads) if op == "delta_gdn" else (batch, seq_len, heads, dim)
        return (q, torch.zeros_like(q, requires_grad=True), torch.zeros_like(q, requires_grad=True), beta,
                torch.zeros(*g_shape, requires_grad=True), torch.zeros_like(beta, requires_grad=True))
    if op == "hdla":
        beta = torch.zeros(batch, seq_len, heads, dtype=dtype, requires_grad=True)
        return q, torch.zeros_like(q, requires_grad=True), torch.zeros_like(q, requires_grad=True), beta, \
            torch.zeros_like(q, requires_grad=True)
    r_ab = {"kda": 1, "gla": 0, "gdn": 1}[op]
    kv = torch.zeros(batch, seq_len, heads, 1, dim, dtype=dtype, requires_grad=True)
    ab = [torch.zeros(batch, seq_len, heads, r_ab, dim, dtype=dtype, requires_grad=True) for _ in range(2)]
    g_shape = (batch, seq_len, heads) if op == "gdn" else (batch, seq_len, heads, dim)
    g = torch.zeros(*g_shape, dtype=dtype, requires_grad=True)
    return (q, kv, torch.zeros_like(kv, requires_grad=True), *ab, g)


def stacked_by_direction(op: str, inputs):
    """``op_inputs`` for the bidirectional ops: the gates (HDLA: beta, g; generalized: g) and the
    generalized k, a, b stacked ``[2, ...]`` by direction, q and v shared."""
    def stack(x):
        return torch.stack([x.detach(), x.detach()]).requires_grad_()

    if op == "hdla":
        q, k, v, beta, g = inputs
        return q, k, v, stack(beta), stack(g)
    q, k, v, a, b, g = inputs
    return q, stack(k), v, stack(a), stack(b), stack(g)


def compile_op(op: str, shape, backward: bool, bidirectional: bool = False) -> List[dict]:
    """Compile the kernels of one forward (and backward) of ``op`` at ``shape`` for the H100 (the
    bidirectional op with ``bidirectional``)."""
    from hdla_vision import kernels

    from hdla_vision.kernels.delta_rule.chunk import chunk_delta_rule

    fn = kernels.chunk_hdla if op == "hdla" else kernels.chunk_generalized
    if op.startswith("delta_"):  # tf32 products, the GPU's default for 16-bit inputs; delta_kda_<precision>: another
        op, _, precision = op.partition("_")[2].partition("_")
        op = "delta_" + op
        fn = functools.partial(chunk_delta_rule, precision=precision or "tf32")
    inputs = op_inputs(op, *shape)
    if bidirectional:
        inputs = stacked_by_direction(op, inputs)
        fn = kernels.chunk_hdla_bidirectional if op == "hdla" else kernels.chunk_generalized_bidirectional
    with triton_path_for_cpu_tensors(), compile_only() as records:
        o, _ = fn(*inputs)
        if backward:
            torch.autograd.grad(o, inputs, torch.zeros_like(o), allow_unused=True)
    return records


@contextmanager
def launches_bound_only(counter: List[float]):
    """Within the block, a Triton launch binds its arguments and finds (or compiles, the first time) its
    kernel for the H100 and returns without running it; ``counter[0]`` counts the launches, ``counter[1]``
    sums their seconds."""
    old_driver, old_run = triton_driver._active, JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        kernel = old_run(self, *args, grid=grid, warmup=True, **kwargs)
        counter[0] += 1
        counter[1] += time.perf_counter() - start
        return kernel

    triton_driver.set_active(_CompileOnlyDriver(H100))
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run, triton_driver._active = old_run, old_driver


def host_ms(op: str, shape, s4_group: int, repeats: int = 15):
    """(median host ms, median ms inside Triton's launch calls, launches) of one fwd+bwd of ``op`` at ``shape``
    with S4's products ``s4_group`` per launch, nothing launched (:func:`launches_bound_only`)."""
    from benchmarks.launch_configs import launch_settings
    from hdla_vision import kernels

    inputs = op_inputs(op, *shape)
    fn = kernels.chunk_hdla if op == "hdla" else kernels.chunk_generalized
    counter, times, in_triton = [0, 0.0], [], []
    with launch_settings({"b2:s4_group": s4_group}), triton_path_for_cpu_tensors(), launches_bound_only(counter):
        for _ in range(repeats + 1):  # the first compiles
            counter[:] = [0, 0.0]
            start = time.perf_counter()
            o, _ = fn(*inputs)
            torch.autograd.grad(o, inputs, torch.zeros_like(o), allow_unused=True)
            times.append(1e3 * (time.perf_counter() - start))
            in_triton.append(1e3 * counter[1])
    return sorted(times[1:])[repeats // 2], sorted(in_triton[1:])[repeats // 2], counter[0]


def main(argv=None):
    from benchmarks.kernels import SHAPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--ops", default="hdla,kda,gla,gdn")
    parser.add_argument("--no-backward", action="store_true", help="compile the forward kernels only")
    parser.add_argument("--bidirectional", action="store_true",
                        help="the bidirectional ops (kernels/README.md §9) instead of the single-direction ones")
    parser.add_argument("--host", action="store_true", help="time the host side instead (see above)")
    parser.add_argument("--s4-group", default="1,4", help="with --host: S4's products per launch, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    if args.host:
        for op in args.ops.split(","):
            for name in args.shapes.split(","):
                for group in (int(g) for g in args.s4_group.split(",")):
                    ms, triton_ms, launches = host_ms(op, SHAPES[name], group, args.repeats)
                    print(f"{op} at {name} {SHAPES[name]}: s4_group {group}, {launches} launches, host {ms:.2f} ms, "
                          f"{triton_ms:.2f} ms of it in Triton's launch calls")
        return 0
    spills = 0
    for op in args.ops.split(","):
        for name in args.shapes.split(","):
            records = compile_op(op, SHAPES[name], not args.no_backward, args.bidirectional)
            kind = "bidirectional, " if args.bidirectional else ""
            print(f"\n== {op} at {name} {SHAPES[name]} ({kind}bf16, sm_90a)")
            print(format_records(records))
            spills += sum(r["stack"] > 0 or r["local"] > 0 for r in records)
    print(f"\n{spills} kernel compilations spill registers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
