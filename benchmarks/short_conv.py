"""The short convolution on the GPU: ``causal_conv1d`` (kernels/short_conv/fused.py) against the ``nn.Conv1d`` form
it replaced (the sequence transposed to ``[B, C, T]``, padded in front, PyTorch's depthwise conv, transposed back),
forward and forward+backward, and its bf16 error against float64.

    python -m benchmarks.short_conv [--shapes mqar_mixer,mqar_baseconv,lm] [--out OUT_DIR]

Shapes (B, T, C, K, bias): the MQAR model's mixer convolution at L = 256 (batch 256, 3 x 128 channels of q, k, v,
4 taps), its BaseConv (128 channels, 3 taps, a bias) and a language-model shape. do_bench medians
(benchmarks/timing.py), bf16 inputs with fp32 filters as under autocast; ``short_conv.json`` under ``--out``,
headed by the device, date and commit.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

from benchmarks.kernels import rel_err
from benchmarks.timing import time_fwd_bwd
from hdla_vision.kernels import causal_conv1d, naive_causal_conv1d
from tools.provenance import provenance

SHAPES = {
    "mqar_mixer": (256, 256, 384, 4, False),
    "mqar_baseconv": (256, 256, 128, 3, True),
    "lm": (8, 4096, 3072, 4, False),
}


def conv1d_form(x, weight, bias):
    """What the mixers and BaseConv ran before: transposes around ``F.conv1d`` (autocast's bf16 filter)."""
    taps = weight.shape[1]
    seq = F.pad(x.transpose(1, 2), (taps - 1, 0))
    out = F.conv1d(seq, weight.to(x.dtype)[:, None], None if bias is None else bias.to(x.dtype), groups=x.shape[-1])
    return out.transpose(1, 2)


def inputs(batch, seq_len, channels, taps, with_bias):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, seq_len, channels, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(channels, taps, device="cuda", generator=gen) / taps ** 0.5).requires_grad_()
    bias = torch.randn(channels, device="cuda", generator=gen).requires_grad_() if with_bias else None
    return [x, weight, bias]


def parity(args) -> dict:
    """Relative errors of the op's output and gradients (bf16 x) against float64 on the same rounded inputs."""
    leaves = [t for t in args if t is not None]
    exact = [t.detach().double().requires_grad_() for t in leaves]
    out, ref = causal_conv1d(*args), naive_causal_conv1d(*exact)
    dy = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, dy.to(out.dtype))
    refs = torch.autograd.grad(ref, exact, dy)
    return {n: rel_err(a, b) for n, a, b in zip(("out", "dx", "dweight", "dbias"), (out, *grads), (ref, *refs))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    result = dict(**provenance(torch.cuda.get_device_name()), rows={})
    for name in args.shapes.split(","):
        call = inputs(*SHAPES[name])
        row = {"shape": SHAPES[name], "parity": parity(call)}
        for label, fn in (("causal_conv1d", causal_conv1d), ("conv1d_form", conv1d_form)):
            row[label] = dict(zip(("fwd_ms", "fwd_bwd_ms"), time_fwd_bwd(fn, call)))
        row["speedup_fwd_bwd"] = row["conv1d_form"]["fwd_bwd_ms"] / row["causal_conv1d"]["fwd_bwd_ms"]
        result["rows"][name] = row
        print(f"{name} {SHAPES[name]}: {row}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "short_conv.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
