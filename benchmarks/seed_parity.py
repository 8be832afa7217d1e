"""Seed-mixer backbones: the same weights on CPU (PyTorch chunk form) and CUDA (Triton kernels).

    python benchmarks/seed_parity.py                    # prints the relative error of logits and gradients per model
    python benchmarks/seed_parity.py gdp3_tiny hihdn_tiny   # only these models
"""
import sys

import torch
import timm

import hdla_vision  # noqa: F401  registers the models

NAMES = ("gla_tiny", "deltanet_tiny", "gdn_tiny", "kda_tiny", "rwkv7_tiny", "gdp2_tiny", "gdp3_tiny",
         "hihdn_tiny", "hihgdn_tiny", "hdla_tiny")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    x = torch.randn(2, 3, 64, 64)
    for name in sys.argv[1:] or NAMES:
        cpu = timm.create_model(name, img_size=64, depth=2, num_classes=10)
        gpu = timm.create_model(name, img_size=64, depth=2, num_classes=10).cuda()
        gpu.load_state_dict(cpu.state_dict())
        out_cpu, out_gpu = cpu(x), gpu(x.cuda())
        out_cpu.square().mean().backward()
        out_gpu.square().mean().backward()
        grad_err = max(rel(pg.grad.cpu(), pc.grad) for pc, pg in zip(cpu.parameters(), gpu.parameters()))
        print(f"{name:14s} logits rel err {rel(out_gpu.cpu(), out_cpu):.1e}  worst grad rel err {grad_err:.1e}", flush=True)


if __name__ == "__main__":
    main()
