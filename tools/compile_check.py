"""Compile our Triton kernels for sm_90 without a GPU and print registers / spills / shared memory.

    python -m tools.compile_check [--dim 64]

Catches compile errors before a device call, and shows register pressure per variant
(forward, adjoint and recompute passes of chunk_hdla).
"""
import argparse
import inspect
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hdla_vision.kernels.generalized import scan
from hdla_vision.kernels.hdla.backward import hdla_backward_epilogue_kernel

FLOATS = {"scale", "thresh"}


def compile_variant(kernel, constexprs, dtype="fp32"):
    num_warps = constexprs.pop("_warps", 4)
    names = inspect.signature(kernel.fn).parameters
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps))
    return compiled


def variants(dim):
    common = dict(RKV=1, RKP=1, RAB=2, RAP=2, BT=scan.BT, BK=dim, REVERSE=False)
    warps = 4 if dim <= 64 else 8
    yield "local fwd", scan.chunk_local_kernel, dict(common, NQ=1, NQP=1, HDLA=True, SWAP_AB=False, SHIFT=0, SOLVE=True, LOG2_BT=scan.LOG2_BT, _warps=warps)
    yield "local adjoint", scan.chunk_local_kernel, dict(common, NQ=3, NQP=4, HDLA=True, SWAP_AB=True, SHIFT=1, SOLVE=True, LOG2_BT=scan.LOG2_BT, _warps=warps)
    for bv in (32, 64):
        base = dict(common, BV=bv, X_GIVEN=False, STORE_X=True, USE_H0=False, STORE_HT=True, ATOMIC=True, _warps=warps)
        yield f"scan fwd BV{bv}", scan.chunk_scan_kernel, dict(base, NQ=1, NQP=1, NWP=0, NWPP=1, NWQ=0, NWQP=1)
        yield f"scan adjoint BV{bv}", scan.chunk_scan_kernel, dict(base, NQ=3, NQP=4, NWP=3, NWPP=4, NWQ=0, NWQP=1)
    yield "hdla epilogue", hdla_backward_epilogue_kernel, dict(BT=16, BK=dim, REVERSE=False, HAS_FINAL=True, _warps=warps)
    yield "kread post", scan.chunk_kread_kernel, dict(common, NW=3, NWP=4, BV=dim, HDLA=True, SWAP_AB=True, SHIFT=1, STRICT=False, _warps=warps)


def ptxas_report(compiled):
    """'registers, spill bytes' from ptxas -v on the kernel's PTX (Triton ships ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    for label, kernel, constexprs in variants(args.dim):
        c = compile_variant(kernel, dict(constexprs))
        regs, spills = ptxas_report(c)
        print(f"K=V={args.dim} {label:18s} regs {regs:3d} spill bytes {spills:5d} shared {c.metadata.shared:6d}", flush=True)


if __name__ == "__main__":
    main()
