"""The delta rule's forward (kernels/delta_rule, kernels/README.md §12) on the GPU against today's HDLA forward and
fla's KDA forward, in one process: the first timing of the KDA-shaped kernel family (issue 11's LM target).

    python -m benchmarks.delta_rule [--shapes lm,hires,b1024] [--precisions ieee,tf32x3,tf32] [--out OUT_DIR]

Per shape (B, T, H, d), forward only, no gradient, bf16 inputs, do_bench medians (benchmarks/timing.py):
  * ``hdla_today``: ``chunk_hdla``'s forward (the chunk kernels of §8, or the token recurrence where it routes);
  * ``delta_hdla_<precision>``: HDLA through the delta rule's kernels over 2T steps (``steps.hdla_steps``; the
    interleaving copies timed with it), for each ``tl.dot`` operand precision;
  * ``delta_kda_<precision>``: the delta rule at KDA's shape (T steps, write scale = beta);
  * ``fla_kda``: fla's ``chunk_kda`` forward (if fla is installed).
Also each delta-rule variant's relative error against the float64 loop on a (2, 300, 2, 64) problem (HDLA through
its two steps per token). ``delta_rule.json`` under ``--out``, headed by device, date and commit.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

from benchmarks.kernels import SHAPES, make_inputs, rel_err
from benchmarks.timing import median_ms
from hdla_vision.kernels import chunk_hdla, naive_hdla
from hdla_vision.kernels.delta_rule.chunk import PRECISIONS, chunk_delta_rule_fwd
from hdla_vision.kernels.delta_rule.steps import hdla_steps
from tools.provenance import provenance


def delta_hdla(precision):
    def run(q, k, v, beta, g):
        o = chunk_delta_rule_fwd(*hdla_steps(q, k, v, beta, g), precision=precision)[0]
        return o[:, 1::2]
    return run


def delta_kda(precision):
    def run(q, k, v, beta, g):
        return chunk_delta_rule_fwd(q, k, v, beta, g, beta, precision=precision)[0]
    return run


def hdla_today(q, k, v, beta, g):
    return chunk_hdla(q, k, v, beta, g)[0]


def fla_kda(q, k, v, beta, g):
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, g.float(), beta, scale=1.0)[0]


def ops(precisions):
    table = {"hdla_today": hdla_today}
    for precision in precisions:
        table[f"delta_hdla_{precision}"] = delta_hdla(precision)
        table[f"delta_kda_{precision}"] = delta_kda(precision)
    try:
        import fla  # noqa: F401

        table["fla_kda"] = fla_kda
    except ImportError:
        pass
    return table


def parity(precisions) -> dict:
    """HDLA through the delta rule (bf16 inputs) against the float64 loop, per precision."""
    q, k, v, beta, g = make_inputs(2, 300, 2, 64, torch.bfloat16, "cuda", seed=1)
    exact = naive_hdla(*(t.detach().double() for t in (q, k, v, beta, g)))[0]
    with torch.no_grad():
        return {p: rel_err(delta_hdla(p)(q, k, v, beta, g), exact) for p in precisions}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="lm,hires,b1024")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    result = {**provenance(torch.cuda.get_device_name()), "dtype": "bfloat16", "parity": parity(precisions),
              "fwd_ms": {}}
    print("parity (HDLA, bf16, against float64):", json.dumps(result["parity"]), flush=True)
    for name in args.shapes.split(","):
        batch, seq_len, heads, dim = SHAPES[name]
        inputs = [t.detach() for t in make_inputs(batch, seq_len, heads, dim, torch.bfloat16, "cuda")]
        inputs[1] = F.normalize(inputs[1].float(), dim=-1).bfloat16()
        row = result["fwd_ms"].setdefault(name, {"bthd": [batch, seq_len, heads, dim]})
        for op, fn in ops(precisions).items():
            with torch.no_grad():
                try:
                    row[op] = median_ms(lambda: fn(*inputs))
                except Exception as error:  # one variant failing (e.g. out of shared memory) leaves the others
                    row[op] = f"failed: {type(error).__name__}: {str(error)[:200]}"
            print(f"{name:6s} {op:24s} {row[op] if isinstance(row[op], str) else f'{row[op]:8.3f} ms'}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "delta_rule.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
