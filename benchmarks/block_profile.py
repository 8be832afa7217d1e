"""One backbone block, fwd+bwd under bf16 autocast: its time per kernel family and recompute setting, and
where its glue goes (torch.profiler's aten ops by input shape, device time per call of the block).

    python -m benchmarks.block_profile --model hdla_tiny --res 224 --batch 256
    python -m benchmarks.block_profile --model hdla_tiny --res 2048 --batch 2 --families chunk64

``--families``: the kernel family setting (``$HDLA_VISION_KERNELS``); ``auto``, the default, runs HDLA's token
recurrence where it routes training (up to 1024 tokens, kernels/README.md §11), the others pin a chunk family.

The block is ``model.blocks[0]`` of ``timm.create_model(model)`` on a random input ``[batch, tokens,
embed_dim]`` (tokens = (res / 16)^2, no class token); a step is the block's forward, ``sum()`` of its
fp32 output and the backward. Times are ``triton.testing.do_bench`` medians after warm-up; the host time
is that of issuing one step behind a sleep kernel (:func:`host_ms`). ``--prologues fused unfused`` times
HDLA's fused mixer prologue against the unfused definition in the same run, ``--combines kernel torch``
the unfused bidirectional path's combine kernels against the PyTorch ops, ``--output-stages fused composed``
the mixers' gated_rms_norm op against the composition it replaced. Needs CUDA.
"""
import argparse
import os
import time
from contextlib import contextmanager

import timm
import torch
import triton.testing

import hdla_vision  # noqa: F401  registers the models
from benchmarks.timing import profile_steps
from hdla_vision.layers.hdla import HDLAMixer
from hdla_vision.layers.mixer import LinearAttentionMixer, set_activation_recompute

FAMILIES = ("auto", "chunk16", "chunk64")
PROLOGUES = ("fused", "unfused")
COMBINES = ("kernel", "torch")
OUTPUT_STAGES = ("fused", "composed")


@contextmanager
def unfused_combine(kind: str):
    """The unfused bidirectional path's sum and own-write correction: one Triton kernel each way (the
    default) or the PyTorch ops (kernels/bidirectional_ops.py)."""
    from hdla_vision.kernels import bidirectional_ops

    real = bidirectional_ops._combined_in_kernel
    if kind == "torch":
        bidirectional_ops._combined_in_kernel = lambda q: False
    try:
        yield
    finally:
        bidirectional_ops._combined_in_kernel = real


def composed_gated_norm(self, y, x, norm=None):
    """The mixers' output stage as the PyTorch composition the gated_rms_norm op replaced."""
    x = x if norm is None else norm(x)
    y = torch.nn.functional.rms_norm(y, (self.head_dim_v,), self.norm.weight.to(y.dtype), self.norm_eps)
    return y.reshape(*x.shape[:2], -1) * self.gate_activation(self.gate(x))


@contextmanager
def output_stage(kind: str):
    """Every mixer's output stage as the fused op (the default) or its PyTorch composition."""
    fused = LinearAttentionMixer.gated_norm
    if kind == "composed":
        LinearAttentionMixer.gated_norm = composed_gated_norm
    try:
        yield
    finally:
        LinearAttentionMixer.gated_norm = fused


@contextmanager
def hdla_prologue(kind: str):
    """HDLA's mixer with its fused prologue (the default) or the base class's unfused definition."""
    fused = HDLAMixer.mix
    if kind == "unfused":
        HDLAMixer.mix = LinearAttentionMixer.mix
    try:
        yield
    finally:
        HDLAMixer.mix = fused


def block_step(model_name: str, res: int, batch: int, device: torch.device):
    model = timm.create_model(model_name, dynamic_img_size=True).to(device).train()
    block = model.blocks[0]
    tokens = (res // 16) ** 2
    x = torch.randn(batch, tokens, model.embed_dim, device=device, requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = block(x)
        y.float().sum().backward()

    return step


def time_ms(step, warmup_ms: int = 50, rep_ms: int = 200) -> float:
    return triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def host_ms(step, reps: int = 5) -> float:
    """Median wall time of issuing one step while the GPU is still busy with a sleep queued before it: the
    host's own cost of the step (launches, Python, the dispatcher), with no wait on the device as long as
    the step neither synchronises nor fills the launch queue (see :func:`sync_points`)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4e8))  # ~0.2 s of device time at ~2 GHz: the step below queues behind it
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def profile_ops(step, steps: int = 3, rows: int = 45) -> str:
    """The aten ops (and custom ops) by self device time per step, grouped by input shapes."""
    prof = profile_steps(step, steps, cpu=True, record_shapes=True)
    events = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / steps / 1e3
    lines = [f"self device time per step: {total:.3f} ms in {sum(e.count for e in events) / steps:.0f} op calls",
             f"{'ms/step':>8s} {'calls':>6s}  op  input shapes"]
    for e in events[:rows]:
        lines.append(f"{e.self_device_time_total / steps / 1e3:8.3f} {e.count / steps:6.1f}  {e.key}  "
                     f"{str(e.input_shapes)[:150]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="hdla_tiny")
    parser.add_argument("--res", type=int, default=224)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--families", nargs="+", default=["auto"], choices=FAMILIES)
    parser.add_argument("--prologues", nargs="+", default=["fused"], choices=PROLOGUES,
                        help="HDLA's mixer prologue: fused (layers/hdla.py) or the unfused definition")
    parser.add_argument("--combines", nargs="+", default=["kernel"], choices=COMBINES,
                        help="the unfused bidirectional path's sum: one Triton kernel each way, or PyTorch")
    parser.add_argument("--output-stages", nargs="+", default=["fused"], choices=OUTPUT_STAGES,
                        help="every mixer's output stage: the gated_rms_norm op, or the PyTorch composition")
    parser.add_argument("--no-profile", action="store_true", help="times only")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    variants = [(p, c, o) for p in args.prologues for c in args.combines for o in args.output_stages]
    for family in args.families:
        os.environ["HDLA_VISION_KERNELS"] = family
        for prologue, combine, output in variants:
            for recompute in (True, False):
                set_activation_recompute(recompute)
                with hdla_prologue(prologue), unfused_combine(combine), output_stage(output):
                    step = block_step(args.model, args.res, args.batch, device)
                    torch.cuda.reset_peak_memory_stats()
                    ms = time_ms(step)
                    peak = torch.cuda.max_memory_allocated() / 2**20
                    print(f"{args.model} {args.res}px batch {args.batch} {family} prologue={prologue} "
                          f"combine={combine} output={output} recompute={recompute}: {ms:.3f} ms/step, "
                          f"host {host_ms(step):.3f} ms, peak {peak:.0f} MiB", flush=True)
                    if recompute and not args.no_profile:
                        print(profile_ops(step), flush=True)
    set_activation_recompute(True)


if __name__ == "__main__":
    main()
