"""HDLA's token recurrence (kernels/hdla/fused_recurrent.py, kernels/README.md §11) against the chunk op,
fla's KDA and SDPA, per shape, in one process; and its bf16 error against the float64 loop.

    python -m benchmarks.recurrent --shapes vision,m224,m512,m1024 --out OUT_DIR [--no-parity]

Per shape (do_bench medians, benchmarks/timing.py; ms):
  chunk: the chunk op's forward (its custom op called directly) and fwd+bwd (chunk_hdla with gradients, the
      chunk kernels pinned: chunk_kernels_in_training);
  recurrent: the recurrence's op (chunk_hdla's inference path up to 1024 tokens), forward and fwd+bwd
      (its Triton backward);
  bidir_chunk / bidir_recurrent: the forward of chunk_hdla_bidirectional (two directions) on each path;
  the baselines (fla_kda, sdpa): (fwd, fwd+bwd).

    python -m benchmarks.recurrent --shapes vision,m224 --bwd-configs 16x1,16x2,16x4,16x1x2 --no-parity

times the recurrence's backward launch alone (``triton_fused_recurrent_hdla_backward``) at each
(state columns per program)x(warps)[x(tokens per checkpoint)] and checks its bf16 gradients on the reversed
fast-gate case;

    python -m benchmarks.recurrent --bidir-train b224,b512,b1024

times one training step's op of a backbone block (both directions, fwd+bwd) on the chunk kernels
(``chunk_hdla_bidirectional`` with gradients, the auto family, the recurrence's training route off) and
on the recurrence (its bidirectional forward and backward launches), with the bf16 error of the latter's
gradients against float64.
"""
import argparse
import json
import os
from unittest import mock

import torch
import triton

from benchmarks.kernels import OPS, SHAPES, make_inputs, rel_err
from benchmarks.timing import median_ms
from hdla_vision.kernels import chunk_hdla, chunk_hdla_bidirectional, custom_ops, naive_hdla, utils
from hdla_vision.kernels.bidirectional_ops import fused_recurrent_hdla_bidirectional_op
from hdla_vision.kernels.hdla import fused_recurrent
from hdla_vision.kernels.hdla.fused_recurrent import (triton_fused_recurrent_hdla,
                                                      triton_fused_recurrent_hdla_backward,
                                                      triton_fused_recurrent_hdla_bidirectional,
                                                      triton_fused_recurrent_hdla_bidirectional_backward)
from tools.provenance import provenance

# The backbones' training shapes with both scan directions as batch (benchmarks/models.py: batch 256 at 224 px,
# 64 at 512, 16 at 1024): the work of one block's bidirectional op.
MODEL_SHAPES = {"m224": (512, 196, 3, 64), "m512": (128, 1024, 3, 64), "m1024": (32, 4096, 3, 64)}
ALL_SHAPES = {**SHAPES, **MODEL_SHAPES}
# One block's bidirectional op in training: hdla_tiny's batch at 224 / 512 / 1024 px (the directions not folded).
BIDIR_SHAPES = {"b224": (256, 196, 3, 64), "b512": (64, 1024, 3, 64), "b1024": (16, 4096, 3, 64)}


def chunk_kernels_in_training():
    """A context in which calls with gradients run the chunk kernels at every length (no training on the
    recurrence: utils.RECURRENT_TRAIN_MAX_TOKENS = 0), so that the "chunk" rows time them."""
    return mock.patch.object(utils, "RECURRENT_TRAIN_MAX_TOKENS", 0)


def grad_time(fn, inputs):
    """Median ms of ``fn(*inputs)`` and the gradients of every input (random output cotangent)."""
    do = torch.randn_like(fn(*inputs)[0])
    return median_ms(lambda: torch.autograd.grad(fn(*inputs)[0], inputs, do))


def timings(shape, dtype, baselines):
    """The rows of one shape (see the module docstring)."""
    inputs = make_inputs(*shape, dtype, "cuda")
    q, k, v, beta, g = plain = [x.detach() for x in inputs]
    row = {}
    with torch.no_grad():
        row["chunk"] = [median_ms(lambda: custom_ops.chunk_hdla_op(*plain, 1.0, None, False, False))]
        row["recurrent"] = [median_ms(lambda: custom_ops.fused_recurrent_hdla_op(*plain, 1.0, None, False))]
    with chunk_kernels_in_training():
        row["chunk"].append(grad_time(lambda *x: chunk_hdla(*x), inputs))
    row["recurrent"].append(grad_time(lambda *x: custom_ops.fused_recurrent_hdla_op(*x, 1.0, None, False), inputs))
    betas, gates = torch.stack([beta, beta.flip(1)]), torch.stack([g, g.flip(1)])
    with torch.no_grad():
        row["bidir_recurrent"] = median_ms(lambda: fused_recurrent_hdla_bidirectional_op(q, k, v, betas, gates, 1.0,
                                                                                          None))
        with mock.patch.dict(os.environ, {utils.KERNEL_FAMILY_ENV: "chunk64"}):  # the fused bidirectional kernels
            row["bidir_chunk"] = median_ms(lambda: chunk_hdla_bidirectional(q, k, v, betas, gates))
    for base in baselines:
        try:
            row[base] = [median_ms(lambda: OPS[base](*plain)), grad_time(lambda *x: (OPS[base](*x),), inputs)]
        except Exception as exc:  # fla missing or a shape it refuses: record it, go on
            row[base] = repr(exc)[:200]
    return row


def parity(shape, dtype, reverse, fast_forgetting):
    """Relative errors of o, the final state and every gradient against the float64 loop (batch 2)."""
    _, seq_len, heads, dim = shape
    inputs = make_inputs(2, seq_len, heads, dim, torch.float64, "cuda", seed=1, fast_forgetting=fast_forgetting)
    h0 = torch.randn(2, heads, dim, dim, device="cuda", dtype=torch.float64, requires_grad=True)
    o, s = naive_hdla(*inputs, initial_state=h0, output_final_state=True, reverse=reverse)
    do, dht = torch.randn_like(o), torch.randn_like(s)
    torch.autograd.backward([o, s], [do, dht])
    low = [x.detach().to(dtype) for x in inputs]
    o_r, s_r = triton_fused_recurrent_hdla(*low, 1.0, h0.detach().float(), reverse)
    grads = triton_fused_recurrent_hdla_backward(do.to(dtype), dht.float(), *low, 1.0, h0.detach().float(), reverse)
    errors = {"o": rel_err(o_r, o), "state": rel_err(s_r, s)}
    refs = [x.grad for x in inputs] + [h0.grad]
    errors.update({n: rel_err(a, b) for n, a, b in zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), grads, refs)})
    return errors


def backward_configs(shapes, dtype, configs):
    """{config: {shape: backward ms, "parity": errors}} for each "BVxWARPS" or "BVxWARPSxCK" of ``configs`` (CK:
    a checkpoint every CK tokens, ``fused_recurrent.CHECKPOINT_EVERY``; the module's value where not given)."""
    out = {}
    for config in configs:
        block_v, warps, *every = (int(x) for x in config.split("x"))

        def pinned(dk, dv, block_v=block_v, warps=warps):
            return triton.next_power_of_2(dk), block_v, warps

        every = every[0] if every else fused_recurrent.CHECKPOINT_EVERY
        with mock.patch.object(fused_recurrent, "_bwd_config", pinned), \
                mock.patch.object(fused_recurrent, "CHECKPOINT_EVERY", every):
            row = out[config] = {"parity": parity(SHAPES["vision"], dtype, True, True)}
            for name in shapes:
                q, k, v, beta, g = (x.detach() for x in make_inputs(*ALL_SHAPES[name], dtype, "cuda"))
                do = torch.randn_like(v)
                row[name] = median_ms(lambda: triton_fused_recurrent_hdla_backward(do, None, q, k, v, beta, g, 1.0))
        print(f"bwd {config}: {row}", flush=True)
    return out


def bidirectional_inputs(shape, dtype, seed=0):
    """(q, k, v, betas [2, ...], gates [2, ...]) with gradients: each direction its own beta and g."""
    q, k, v, beta, g = make_inputs(*shape, dtype, "cuda", seed=seed)
    _, _, _, beta2, g2 = make_inputs(*shape, dtype, "cuda", seed=seed + 1)
    return [x.detach().requires_grad_() for x in (q, k, v, torch.stack([beta, beta2]), torch.stack([g, g2]))]


def bidirectional_parity(dtype):
    """bf16 errors of the recurrence's bidirectional forward and backward against float64 (T = 196)."""
    inputs = bidirectional_inputs((2, 196, 3, 64), torch.float64)
    y, states = chunk_hdla_bidirectional(*inputs, output_final_state=True)
    dy, dst = torch.randn_like(y), torch.randn_like(states)
    torch.autograd.backward([y, states], [dy, dst])
    low = [x.detach().to(dtype) for x in inputs]
    y_r, st_r = triton_fused_recurrent_hdla_bidirectional(*low, 1.0, None)
    grads = triton_fused_recurrent_hdla_bidirectional_backward(dy.to(dtype), dst.float(), *low, 1.0, None)
    errors = {"y": rel_err(y_r, y), "states": rel_err(st_r, states)}
    errors.update({n: rel_err(a, x.grad) for n, a, x in zip(("dq", "dk", "dv", "dbeta", "dg"), grads, inputs)})
    return errors


def bidirectional_training(shapes, dtype):
    """{shape: {"chunk": ms, "recurrent": ms}} of one fwd+bwd of the bidirectional op, and the parity."""
    out = {"parity_b2_T196": bidirectional_parity(dtype)}
    print(f"bidir parity: {out['parity_b2_T196']}", flush=True)
    for name in shapes:
        inputs = bidirectional_inputs(BIDIR_SHAPES[name], dtype)
        plain = [x.detach() for x in inputs]
        dy = torch.randn_like(plain[2])

        def recurrent():
            triton_fused_recurrent_hdla_bidirectional(*plain, 1.0, None)
            triton_fused_recurrent_hdla_bidirectional_backward(dy, None, *plain, 1.0, None)

        with chunk_kernels_in_training():
            chunk = median_ms(lambda: torch.autograd.grad(chunk_hdla_bidirectional(*inputs)[0], inputs, dy))
        out[name] = {"chunk": chunk, "recurrent": median_ms(recurrent)}
        print(f"bidir train {name} {BIDIR_SHAPES[name]}: {out[name]}", flush=True)
    return out


def sum_parts_timing(shape=(256, 196, 3, 64)) -> dict:
    """The backward's epilogue at hdla_tiny's 224 px batch: its fp32 V-block partials summed and cast to bf16
    by PyTorch (a sum over the parts' axis, then a copy) and by ``sum_parts`` (one launch), ms each, for dq
    (8 partials: 4 V-blocks x 2 directions into one) and dg (4 V-blocks into each direction's), with the
    largest difference between the two (bf16 rounding of fp32 sums taken in another order)."""
    from hdla_vision.kernels.hdla.fused_recurrent import sum_parts

    out = {}
    for name, parts, outputs in (("dq", 8, 1), ("dg", 4, 2)):
        x = torch.randn(parts * outputs, *shape, device="cuda")
        grouped = x.view(outputs, parts, *shape)
        torch_ms = median_ms(lambda: grouped.sum(1).to(torch.bfloat16))
        ours_ms = median_ms(lambda: sum_parts(x, parts, torch.bfloat16))
        diff = (grouped.sum(1).to(torch.bfloat16).float() - sum_parts(x, parts, torch.bfloat16).float()).abs().max()
        out[name] = {"torch_ms": torch_ms, "sum_parts_ms": ours_ms, "max_abs_diff": diff.item()}
        print(f"sum parts {name}: {out[name]}", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="vision,m224,m512,m1024")
    parser.add_argument("--baselines", default="fla_kda,sdpa")
    parser.add_argument("--no-parity", action="store_true", help="timings only")
    parser.add_argument("--bwd-configs", default=None, help="e.g. 16x1,16x2: the backward launch per config")
    parser.add_argument("--bidir-train", default=None, help="e.g. b224,b512: the bidirectional op in training")
    parser.add_argument("--sum-parts", action="store_true", help="the backward's epilogue: PyTorch against sum_parts")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16
    result = dict(**provenance(torch.cuda.get_device_name()), parity={}, times={})
    for case, (shape, reverse, fast) in {"vision_rev_gates20": (SHAPES["vision"], True, True),
                                         "v512_mild": (SHAPES["v512"], False, False),
                                         "lm_dims_short": ((4, 256, 4, 128), False, False)}.items():
        if args.no_parity:
            break
        result["parity"][case] = errs = parity(shape, dtype, reverse, fast)
        print(f"parity {case}: " + " ".join(f"{n} {e:.1e}" for n, e in errs.items()), flush=True)
    shapes = list(filter(None, args.shapes.split(",")))
    if args.sum_parts:
        result["sum_parts"] = sum_parts_timing()
    if args.bidir_train:
        result["bidir_train"] = bidirectional_training(args.bidir_train.split(","), dtype)
    if args.bwd_configs:
        result["bwd_configs"] = backward_configs(shapes, dtype, args.bwd_configs.split(","))
    for name in shapes if not (args.bidir_train or args.bwd_configs or args.sum_parts) else ():
        result["times"][name] = row = timings(ALL_SHAPES[name], dtype, list(filter(None, args.baselines.split(","))))
        print(f"{name} {ALL_SHAPES[name]}: {row}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "recurrent.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
