"""Kernel demo: ``python -m hdla_vision.kernels.demo``.

Runs chunk_hdla on random inputs, checks the output and gradients against the float64 token
loop, and times forward and forward+backward. On a GPU it uses the Triton kernels; on a CPU the
PyTorch chunk form (or the Triton interpreter with TRITON_INTERPRET=1).
"""
import argparse
import time

import torch
import torch.nn.functional as F

from hdla_vision.kernels import chunk_hdla, naive_hdla


def rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=196)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = (args.batch, args.seq_len, args.heads, args.dim)
    gen = torch.Generator().manual_seed(0)
    q, k, v, g0 = (torch.randn(*shape, generator=gen) for _ in range(4))
    inputs = [q, F.normalize(k, dim=-1), v, 2 * torch.rand(*shape[:3], generator=gen), F.logsigmoid(g0 + 2)]
    leaves = [t.to(device, dtype).requires_grad_() for t in inputs]
    ref_leaves = [t.double().requires_grad_() for t in inputs]

    o = chunk_hdla(*leaves)[0]
    do = torch.randn(o.shape, generator=gen)
    grads = torch.autograd.grad(o, leaves, do.to(device, dtype))
    ref = naive_hdla(*ref_leaves)[0]
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    print(f"chunk_hdla on {device} ({dtype}), B, T, H, D = {shape}")
    print(f"  relative error vs float64 loop: o {rel(o.cpu(), ref):.1e}, "
          + ", ".join(f"d{n} {rel(a.cpu(), b):.1e}" for n, a, b in zip("q k v beta g".split(), grads, ref_grads)))

    def step():
        out = chunk_hdla(*leaves)[0]
        torch.autograd.grad(out, leaves, do.to(device, dtype))

    step()
    reps = 20 if device == "cuda" else 3
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"  forward+backward: {(time.perf_counter() - start) / reps * 1e3:.2f} ms per call")


if __name__ == "__main__":
    main()
