"""One backbone block, fwd+bwd under bf16 autocast: its time per kernel family and recompute setting, and
where its glue goes (torch.profiler's aten ops by input shape, device time per call of the block).

    python -m benchmarks.block_profile --model hdla_tiny --res 224 --batch 256
    python -m benchmarks.block_profile --model hdla_tiny --res 2048 --batch 2 --families chunk64

The block is ``model.blocks[0]`` of ``timm.create_model(model)`` on a random input ``[batch, tokens,
embed_dim]`` (tokens = (res / 16)^2, no class token); a step is the block's forward, ``sum()`` of its
fp32 output and the backward. Times are ``triton.testing.do_bench`` medians after warm-up. Needs CUDA.
"""
import argparse
import os

import timm
import torch
import triton.testing

import hdla_vision  # noqa: F401  registers the models
from hdla_vision.layers.mixer import set_activation_recompute

FAMILIES = ("chunk16", "chunk64")


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


def profile_ops(step, steps: int = 3, rows: int = 45) -> str:
    """The aten ops (and custom ops) by self device time per step, grouped by input shapes."""
    step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
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
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--no-profile", action="store_true", help="times only")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    for family in args.families:
        os.environ["HDLA_VISION_KERNELS"] = family
        for recompute in (True, False):
            set_activation_recompute(recompute)
            step = block_step(args.model, args.res, args.batch, device)
            torch.cuda.reset_peak_memory_stats()
            ms = time_ms(step)
            peak = torch.cuda.max_memory_allocated() / 2**20
            print(f"{args.model} {args.res}px batch {args.batch} {family} recompute={recompute}: "
                  f"{ms:.3f} ms/step, peak {peak:.0f} MiB", flush=True)
            if recompute and not args.no_profile:
                print(profile_ops(step), flush=True)
    set_activation_recompute(True)


if __name__ == "__main__":
    main()
