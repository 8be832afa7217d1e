"""Per-kernel timing of the chunk backward (kernels/generalized/bwd.py): B1 (serial dS pass) and B2
(chunk VJP), separately and together, with ``triton.testing.do_bench`` medians, bf16 inputs.

    python -m benchmarks.kernel_stages_bwd [--out results.json] [--shapes vision,hires,lm,2048px]

The forward's per-chunk tensors (N, Qeff, gamma, h) are random tensors of the right shapes and
dtypes: the kernels' run time does not depend on their values, and the float64 stand-in of the
forward does not fit in memory at the LM shape. Variants: HDLA, and r_ab = 1 with vector decay.
"""
import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F
import triton

from kernels.generalized import bwd

SHAPES = {"vision": (128, 196, 3, 64), "hires": (8, 4096, 3, 64), "lm": (4, 4096, 16, 128),
          "2048px": (2, 16384, 3, 64)}


def _inputs(kind, batch, seq_len, heads, d, chunk):
    dev, bf = "cuda", torch.bfloat16
    nt = triton.cdiv(seq_len, chunk)
    q = torch.randn(batch, seq_len, heads, d, device=dev, dtype=bf)
    g = -torch.rand(batch, seq_len, heads, d, device=dev) * 0.5
    do = torch.randn(batch, seq_len, heads, d, device=dev, dtype=bf)
    prep = dict(N=0.01 * torch.randn(batch, heads, nt, d, d, device=dev, dtype=bf),
                Qeff=torch.randn(batch, heads, nt * chunk, d, device=dev, dtype=bf),
                gamma=torch.rand(batch, heads, nt, d, device=dev), chunk=chunk)
    h = torch.randn(batch, heads, nt, d, d, device=dev, dtype=bf)
    if kind == "hdla":
        k = F.normalize(torch.randn(batch, seq_len, heads, d, device=dev), dim=-1).to(bf)
        v = torch.randn(batch, seq_len, heads, d, device=dev, dtype=bf)
        beta = 2 * torch.rand(batch, seq_len, heads, device=dev)
        args = (q, k, v, None, None, g)
    else:
        k = torch.randn(batch, seq_len, heads, 1, d, device=dev, dtype=bf) / d**0.5
        v = torch.randn(batch, seq_len, heads, 1, d, device=dev, dtype=bf)
        a = torch.randn(batch, seq_len, heads, 1, d, device=dev, dtype=bf) / d**0.5
        b = torch.randn(batch, seq_len, heads, 1, d, device=dev, dtype=bf) / d**0.5
        args, beta = (q, k, v, a, b, g), None
    dht = torch.randn(batch, heads, d, d, device=dev)
    return dict(do=do, dht=dht, args=args, beta=beta, prep=prep, h=h, h0=torch.randn(batch, heads, d, d, device=dev))


def time_case(kind, shape, chunk):
    batch, seq_len, heads, d = shape
    x = _inputs(kind, batch, seq_len, heads, d, chunk)
    timings = {}
    stages = {}

    def full():
        return bwd.generalized_backward(x["do"], x["dht"], *x["args"], 0.1, x["h0"], x["h"], False,
                                        hdla_beta=x["beta"], prep=x["prep"], stages=stages)

    full()
    torch.cuda.synchronize()
    timings["b1_plus_b2_ms"] = triton.testing.do_bench(full, warmup=50, rep=200)
    for name, fn in stages.items():
        timings[name + "_ms"] = triton.testing.do_bench(fn, warmup=50, rep=200)
    return timings


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernel_stages_bwd.json"))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kinds", default="hdla,rab1")
    parser.add_argument("--chunks", default="64")
    args = parser.parse_args()
    results = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), runs=[])
    for name in args.shapes.split(","):
        for kind in args.kinds.split(","):
            for chunk in (int(c) for c in args.chunks.split(",")):
                try:
                    t = time_case(kind, SHAPES[name], chunk)
                except Exception as exc:  # noqa: BLE001  one failing configuration must not end the sweep
                    t = {"error": f"{type(exc).__name__}: {str(exc)[-400:]}"}
                run = dict(shape=name, bthd=SHAPES[name], kind=kind, chunk=chunk, **t)
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
