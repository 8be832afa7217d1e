"""Where the delta rule's time goes (kernels/delta_rule/chunk.py's five kernels), per launch setting, beside fla's
chunk_kda at the same shape: the tuning harness of issue 11's KDA-shaped family.

    python -m benchmarks.delta_rule_kernels [--shapes lm,hires] [--precision tf32] [--variants base,...] [--out DIR]

Per shape (B, T, H, d), bf16 inputs, the delta rule at KDA's shape (T steps, write scale = beta): fwd+bwd ms
(do_bench median), µs per kernel (torch.profiler over five calls) and its TFLOP/s (:func:`kernel_gflop`), the step's
peak memory and what the forward keeps for the backward, for each variant of
``chunk.LAUNCH`` (:data:`VARIANTS`: warps, pipeline stages, V block per kernel; the recompute mode; the bf16 state
path); and fla's
chunk_kda the same way if fla is installed.
``delta_rule_kernels.json`` under ``--out`` (rewritten after every variant), headed by device, date and commit.
"""
import argparse
import copy
import json
import os

import torch

from benchmarks.delta_rule import delta_kda, fla_kda
from benchmarks.kernels import SHAPES, make_inputs
from benchmarks.timing import device_us, median_ms, profile_steps
from hdla_vision.kernels.delta_rule import chunk as delta_chunk
from tools.provenance import provenance

# name -> {kernel: {bk: settings}} overrides of chunk.LAUNCH (BV: {bk: block}); "recompute": True runs the op in
# its recompute mode (the backward remakes the chunk terms; kernels/delta_rule/terms.py); "precision" replaces
# --precision (bf16: the state path on bf16 operands and bf16 terms, chunk.py's module docstring); "fast_gates" times
# today's settings on gates with fast-forgetting channels (issue 11: <= 1.2x the mild gates' time)
BF16 = {"precision": "bf16"}
VARIANTS = {
    "base": {},
    "recompute": {"recompute": True},
    "bf16": BF16,
    "bf16_recompute": {**BF16, "recompute": True},
    "bf16_dc": {"precision": "bf16_dc"},  # dC's products with U, dU, dO and the states on bf16 operands too
    "fast_gates": {"fast_gates": True},
    "bf16_serial_s3": {**BF16, **{k: {64: dict(num_warps=4, num_stages=3), 128: dict(num_warps=8, num_stages=3)}
                                  for k in ("S", "dS")}},
    "bf16_serial_w4": {**BF16, **{k: {64: dict(num_warps=4, num_stages=2), 128: dict(num_warps=4, num_stages=2)}
                                  for k in ("S", "dS")}},
    "warps4": {k: {64: dict(num_warps=4, num_stages=1), 128: dict(num_warps=4, num_stages=1)} for k in ("P", "dC")},
    "warps16": {k: {64: dict(num_warps=16, num_stages=1), 128: dict(num_warps=16, num_stages=1)} for k in ("P", "dC")},
    "serial_w4s3": {k: {64: dict(num_warps=4, num_stages=3), 128: dict(num_warps=4, num_stages=3)}
                    for k in ("S", "dS")},
    "serial_w8s1": {k: {64: dict(num_warps=8, num_stages=1), 128: dict(num_warps=8, num_stages=1)}
                    for k in ("S", "dS")},
    "dc_stages2": {"dC": {64: dict(num_warps=8, num_stages=2), 128: dict(num_warps=8, num_stages=2)}},
    "p_stages2": {"P": {64: dict(num_warps=4, num_stages=2), 128: dict(num_warps=4, num_stages=2)}},
    "ds_stages2": {"dS": {64: dict(num_warps=4, num_stages=2), 128: dict(num_warps=8, num_stages=2)}},
    "kb64": {"KB": {64: 64, 128: 64}},
    "kb32": {"KB": {64: 32, 128: 32}},
    "kb16": {"KB": {64: 16, 128: 16}},
    "bv64": {"BV": {64: 64, 128: 64}},
    "o_bv64": {"BV_O": {64: 64, 128: 64}},  # O and dO read qg and Aqk once per 64 / 128 value columns
    "o_bv128": {"BV_O": {64: 64, 128: 128}, "O": {128: dict(num_warps=8, num_stages=3)}},
    "bf16_o_bv128": {**BF16, "BV_O": {64: 64, 128: 128}, "O": {128: dict(num_warps=8, num_stages=3)}},
    "dc_bv64": {"BV_C": {64: 64, 128: 64}},  # dC's state products reduce over 64 value columns instead of 32
    # the serial passes as a two-level scan over groups of 8 / 16 chunks (for few programs: hires, long)
    "group8": {"GROUP": {64: 8, 128: 8}},
    "group16": {"GROUP": {64: 16, 128: 16}},
    "bf16_group16": {**BF16, "GROUP": {64: 16, 128: 16}},
    "bv16": {"BV": {64: 16, 128: 16}},
}


def kernel_gflop(batch: int, seq_len: int, heads: int, dim: int, per_head: bool = False,
                 recompute: bool = False) -> dict:
    """The tensor-core GFLOP each kernel of one fwd+bwd performs (kernels/delta_rule/chunk.py, K = V = dim, chunks of
    C = 64, masked products counted whole, as the tensor cores run them): the Grams (six levels of two products per
    K block, or two plain ones per head), T's doubling (six levels of two [C, C] products), w, u~; S's two products
    per chunk; O's two; dO's two; dS's two; dC's three passes (the Gram VJPs six levels of four products, or four).
    ``recompute``: P twice, the second also forming U = u~ - w h."""
    c, k, v = 64, dim, dim
    chunks = batch * heads * -(-seq_len // c)
    grams = (4 if per_head else 24) * c * c * k
    prepare = grams + 24 * c ** 3 + 2 * c * c * k + 2 * c * c * v
    flop = {"_prepare_kernel": prepare * (2 if recompute else 1) + (2 * c * k * v if recompute else 0),
            "_state_kernel": 4 * c * k * v, "_output_kernel": 2 * c * k * v + 2 * c * c * v,
            "_dout_kernel": 2 * c * c * v + 2 * c * k * v, "_state_bwd_kernel": 4 * c * k * v,
            "_chunk_bwd_kernel": (6 * c * c * v + 2 * c * v * k + 2 * c * c * k + (4 * c * c * k if per_head else 0)
                                  + 4 * c ** 3 + (8 if per_head else 48) * c * c * k + 4 * c * k * v + 2 * c * c * k)}
    return {kernel: round(chunks * f / 1e9, 2) for kernel, f in flop.items()}


def with_launch(overrides: dict) -> dict:
    launch = copy.deepcopy(delta_chunk.LAUNCH)
    for kernel, table in overrides.items():
        if kernel in launch:  # the others say how to run the op, not how to launch it
            launch[kernel].update(table)
    return launch


def kernel_us(step, calls: int = 5) -> dict:
    """``{kernel: µs per call}`` of ``step()``'s CUDA kernels (those launched at least once per call)."""
    events = profile_steps(step, calls).key_averages()
    return {e.key[:60]: round(device_us(e) / calls, 1) for e in events if device_us(e) > 0 and e.count >= calls}


def fwd_bwd_step(fn, inputs):
    grad = torch.randn_like(fn(*inputs))
    return lambda: torch.autograd.grad(fn(*inputs), inputs, grad)


def peak_mib(step) -> float:
    """The memory one call of ``step()`` allocates at its peak beyond what was allocated before (MiB)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2 ** 20, 1)


def kept_mib(fn, inputs) -> float:
    """What a forward leaves allocated for its backward, the output included (MiB): the memory a training step holds
    per call until its backward runs."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn(*inputs)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    del out
    return round(kept / 2 ** 20, 1)


def measure(fn, inputs, gflop=None) -> dict:
    """fwd+bwd ms, µs per kernel, peak and kept memory; with ``gflop`` (:func:`kernel_gflop`) each kernel's TFLOP/s."""
    try:
        step = fwd_bwd_step(fn, inputs)
        us = kernel_us(step)
        run = {"fwd_bwd_ms": round(median_ms(step), 3), "kernel_us": us, "peak_mib": peak_mib(step),
               "kept_mib": kept_mib(fn, inputs)}
        if gflop:
            run["kernel_tflops"] = {kernel: round(gflop[kernel] / us[kernel] * 1e3, 1)  # GFLOP per µs = PFLOP/s
                                    for kernel in gflop if us.get(kernel)}
        return run
    except Exception as error:  # a setting out of shared memory or registers leaves the others
        return {"failed": f"{type(error).__name__}: {str(error)[:200]}"}


def delta_inputs(shape: str, per_head: bool, fast_gates: bool = False):
    """(q, k, v, beta, g) in bf16 at ``shape`` (benchmarks.kernels.make_inputs; ``fast_gates``: every eighth channel at
    log-decay -20 per step); ``per_head``: g one fp32 log-decay per head (its first channel's, so -20 everywhere with
    ``fast_gates``)."""
    inputs = make_inputs(*SHAPES[shape], torch.bfloat16, "cuda", fast_forgetting=fast_gates)
    if per_head:
        inputs = (*inputs[:4], inputs[4][..., 0].detach().float().contiguous().requires_grad_())
    return inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="lm,hires")
    parser.add_argument("--precision", default="tf32")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--no-fla", action="store_true", help="leave fla's chunk_kda out (its autotuning takes minutes)")
    parser.add_argument("--per-head", action="store_true",
                        help="one log-decay per head (g [B, T, H]: Gated DeltaNet's shape, the kernels' scalar "
                             "specialisation) instead of KDA's per channel; fla's chunk_kda is then left out")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    result = {**provenance(torch.cuda.get_device_name()), "dtype": "bfloat16", "precision": args.precision,
              "g": "per head" if args.per_head else "per channel",
              "variants": {name: VARIANTS[name] for name in args.variants.split(",")}, "shapes": {}}
    default = copy.deepcopy(delta_chunk.LAUNCH)
    os.makedirs(args.out, exist_ok=True)
    for shape in args.shapes.split(","):
        inputs = delta_inputs(shape, args.per_head)
        runs = result["shapes"].setdefault(shape, {"bthd": list(SHAPES[shape])})
        try:
            if not args.no_fla and not args.per_head:
                import fla  # noqa: F401
                runs["fla_kda"] = measure(fla_kda, inputs)
                print(shape, "fla_kda", json.dumps(runs["fla_kda"]), flush=True)
        except ImportError:
            pass
        for name in args.variants.split(","):
            delta_chunk.LAUNCH = with_launch(VARIANTS[name])
            recompute = VARIANTS[name].get("recompute", False)
            gflop = kernel_gflop(*SHAPES[shape], per_head=args.per_head, recompute=recompute)
            variant_inputs = delta_inputs(shape, args.per_head, True) if VARIANTS[name].get("fast_gates") else inputs
            runs[name] = measure(delta_kda(VARIANTS[name].get("precision", args.precision), recompute), variant_inputs,
                                 gflop)
            delta_chunk.LAUNCH = default
            print(shape, name, json.dumps(runs[name]), flush=True)
            with open(os.path.join(args.out, "delta_rule_kernels.json"), "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
