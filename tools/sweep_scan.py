"""Time the HDLA forward (chunk_scan) at one shape under several serial-kernel launch configs.

    python -m tools.sweep_scan --shape lm
"""
import argparse
import itertools

import torch
import triton

from benchmarks.kernels import SHAPES, make_inputs
from hdla_vision.kernels.generalized.chunk import chunk_scan


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="lm")
    args = parser.parse_args()
    q, k, v, beta, g = (t.detach() for t in make_inputs(*SHAPES[args.shape], torch.bfloat16, "cuda"))

    def fwd(**launch):
        return chunk_scan(q.unsqueeze(3), k.unsqueeze(3), v.unsqueeze(3), g, hdla=(k, beta),
                          store_x=True, store_final=True, launch=launch)

    print(f"{args.shape}: default {triton.testing.do_bench(lambda: fwd(), return_mode='median'):.3f} ms")
    for bv, warps, stages in itertools.product((32, 64), (4, 8), (2, 3)):
        try:
            t = triton.testing.do_bench(lambda: fwd(BV=bv, num_warps=warps, num_stages=stages), return_mode="median")
            print(f"BV {bv:3d} warps {warps} stages {stages}: {t:.3f} ms", flush=True)
        except Exception as exc:  # out of shared memory etc.
            print(f"BV {bv:3d} warps {warps} stages {stages}: {type(exc).__name__}")



def compiled_kernel_report():
    """Registers, spills and shared memory of every compiled variant of our kernels."""
    from hdla_vision.kernels.generalized import scan

    for name in ("chunk_local_kernel", "chunk_scan_kernel", "chunk_kread_kernel"):
        fn = getattr(scan, name)
        for cache in getattr(fn, "device_caches", {}).values():
            for kernel in cache[0].values():
                meta = kernel.metadata
                print(f"{name}: regs {kernel.n_regs} spills {kernel.n_spills} shared {meta.shared} warps {meta.num_warps}")


if __name__ == "__main__":
    main()
    compiled_kernel_report()
