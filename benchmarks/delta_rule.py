"""The delta rule (kernels/delta_rule, kernels/README.md §12) on the GPU against today's HDLA op and fla's KDA, in
one process: the first timing of the KDA-shaped kernel family (issue 11's LM target).

    python -m benchmarks.delta_rule [--shapes lm,hires,b1024] [--precisions tf32,tf32x3] [--cuda-graphs] [--no-fla]
                                    [--out DIR]

Per shape (B, T, H, d), bf16 inputs, forward (no gradient) and forward+backward, do_bench medians
(benchmarks/timing.py; ``--cuda-graphs``: also as CUDA-graph replays):
  * ``hdla_today``: ``chunk_hdla`` (the chunk kernels of §8, or the token recurrence where it routes);
  * ``delta_hdla_<precision>``: HDLA through the delta rule's kernels over 2T steps (``steps.hdla_steps``; the
    interleaving copies timed with it), for each ``tl.dot`` operand precision;
  * ``delta_kda_<precision>``: the delta rule at KDA's shape (T steps, write scale = beta);
  * ``fla_kda``: fla's ``chunk_kda`` (if fla is installed).
Also HDLA through the delta rule against the float64 loop at (2, 300, 2, 64) and (1, 2048, 2, 128) per precision
(output and every gradient, bf16 inputs). ``delta_rule.json`` under ``--out``, headed by device, date and commit.
"""
import argparse
import json
import os

import torch

from benchmarks.kernels import SHAPES, make_inputs, rel_err
from benchmarks.timing import time_fwd_bwd
from hdla_vision.kernels import chunk_hdla, naive_hdla
from hdla_vision.kernels.delta_rule.chunk import PRECISIONS, chunk_delta_rule
from hdla_vision.kernels.delta_rule.steps import chunk_token_steps, hdla_steps
from tools.provenance import provenance


def delta_hdla(precision):
    def run(q, k, v, beta, g):
        return chunk_token_steps(hdla_steps, 2, (q, k, v, beta, g), None, None, False, False, precision)[0]
    return run


def delta_kda(precision, recompute: bool = False):
    """The delta rule at KDA's shape (write scale = beta) with these operands (and ``recompute`` mode)."""
    def run(q, k, v, beta, g):
        return chunk_delta_rule(q, k, v, beta, g, beta, precision=precision, recompute=recompute)[0]
    return run


def hdla_today(q, k, v, beta, g):
    return chunk_hdla(q, k, v, beta, g)[0]


def fla_kda(q, k, v, beta, g):
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, g.float(), beta, scale=1.0)[0]


def ops(precisions, with_fla: bool = True):
    table = {"hdla_today": hdla_today}
    for precision in precisions:
        table[f"delta_hdla_{precision}"] = delta_hdla(precision)
        table[f"delta_kda_{precision}"] = delta_kda(precision)
    try:
        if with_fla:
            import fla  # noqa: F401

            table["fla_kda"] = fla_kda
    except ImportError:
        pass
    return table


PARITY_SHAPES = {"short": (2, 300, 2, 64), "long_d128": (1, 2048, 2, 128)}  # (B, T, H, d); long: 64 chunks of steps


def parity(precisions) -> dict:
    """HDLA through the delta rule (bf16 inputs) against the float64 loop, per shape and precision: the largest
    relative error over the output and every gradient (a variant that fails to run is recorded as such)."""
    errors = {}
    for name, (batch, seq_len, heads, dim) in PARITY_SHAPES.items():
        inputs = make_inputs(batch, seq_len, heads, dim, torch.bfloat16, "cuda", seed=1)
        exact = [t.detach().double().requires_grad_() for t in inputs]
        ref = naive_hdla(*exact)[0]
        do = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, exact, do)
        for p in precisions:
            try:
                out = delta_hdla(p)(*inputs)
                grads = torch.autograd.grad(out, inputs, do.to(out.dtype))
                errors[f"{name}/{p}"] = max([rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(grads, ref_grads)])
            except Exception as error:  # e.g. out of shared memory on this GPU
                errors[f"{name}/{p}"] = f"failed: {type(error).__name__}: {str(error)[:200]}"
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="lm,hires,b1024")
    parser.add_argument("--precisions", default="tf32", help=f"some of {','.join(PRECISIONS)}")
    parser.add_argument("--cuda-graphs", action="store_true", help="also time each op as CUDA-graph replays")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--autotune-rep-ms", type=float, default=None, help="time each fla autotune config this long")
    parser.add_argument("--no-fla", action="store_true", help="leave fla's chunk_kda out (its autotuning takes minutes)")
    args = parser.parse_args()
    if args.autotune_rep_ms:
        from tools.triton_cache import shorten_autotune
        shorten_autotune(rep_ms=args.autotune_rep_ms)
    precisions = args.precisions.split(",")
    result = {**provenance(torch.cuda.get_device_name()), "dtype": "bfloat16", "parity": parity(precisions),
              "fwd_ms": {}, "fwd_bwd_ms": {}}
    print("parity (HDLA, bf16, against float64):", json.dumps(result["parity"]), flush=True)
    for name in args.shapes.split(","):
        batch, seq_len, heads, dim = SHAPES[name]
        inputs = make_inputs(batch, seq_len, heads, dim, torch.bfloat16, "cuda")
        for part in ("fwd_ms", "fwd_bwd_ms"):
            result[part].setdefault(name, {"bthd": [batch, seq_len, heads, dim]})
        for op, fn in ops(precisions, not args.no_fla).items():
            for graphs in (False, True) if args.cuda_graphs else (False,):
                label = op + ("_graphed" if graphs else "")
                try:
                    fwd, fwd_bwd = time_fwd_bwd(fn, inputs, cuda_graphs=graphs)
                except Exception as error:  # one variant failing (shared memory, a capture) leaves the others
                    fwd = fwd_bwd = f"failed: {type(error).__name__}: {str(error)[:200]}"
                result["fwd_ms"][name][label], result["fwd_bwd_ms"][name][label] = fwd, fwd_bwd
                shown = [x if isinstance(x, str) else f"{x:8.3f} ms" for x in (fwd, fwd_bwd)]
                print(f"{name:6s} {label:32s} fwd {shown[0]}  fwd+bwd {shown[1]}", flush=True)
                write_json(result, args.out)  # after every variant: a run cut by a time limit keeps what it timed


def write_json(result: dict, out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "delta_rule.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
