"""First-call time of ``torch.compile(fullgraph=True)`` on a reduced HDLA backbone.

Each measurement runs in a fresh subprocess with an empty inductor cache, so it is the cold first
call (tracing, AOTAutograd, code generation and compilation, plus one run), minus the same call in
eager mode. ``--inline`` swaps the mixer's op for the PyTorch chunk form called directly (what the
CPU path was before the ops became custom ops): dynamo then traces the chunk loop into the graph.

    python -m benchmarks.compile_time --depth 2 --img-size 32 --backend inductor

The result (provenance, the times in seconds, the settings) is printed and written to
``compile_time.json`` in ``--out`` (default ``$OUT``, else the current directory).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from tools.provenance import provenance


def measure(args) -> dict:
    """One cold measurement in this process (the caller set a fresh cache directory)."""
    import timm
    import torch

    import hdla_vision  # noqa: F401  registers the timm models
    from hdla_vision.layers import set_chunk_backend

    if args.inline:
        set_chunk_backend("torch")  # the mixers call the PyTorch chunk form directly
    torch.manual_seed(0)
    model = timm.create_model("hdla_tiny", depth=args.depth, img_size=args.img_size, num_classes=10).to(args.device)
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, device=args.device)

    def step(fn):
        out = fn(images)
        if args.backward:
            out.square().mean().backward()
        if args.device == "cuda":
            torch.cuda.synchronize()

    step(model)  # eager warm-up (allocator, kernels' own first call)
    start = time.perf_counter()
    step(model)
    eager = time.perf_counter() - start
    compiled = torch.compile(model, backend=args.backend, fullgraph=True)
    start = time.perf_counter()
    step(compiled)
    first = time.perf_counter() - start
    start = time.perf_counter()
    step(compiled)
    second = time.perf_counter() - start
    return dict(first_call_s=round(first, 2), compile_s=round(first - eager, 2), eager_call_s=round(eager, 3),
                second_call_s=round(second, 3))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--inline", action="store_true", help="trace the PyTorch chunk form instead of the op")
    parser.add_argument("--backward", action="store_true", help="time forward + backward (else forward only)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of compile_time.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        cmd = [sys.executable, "-m", "benchmarks.compile_time", "--child"] + sys.argv[1:]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-4000:])
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "out")}
    result = {**provenance(device_name(args.device)), **json.loads(proc.stdout.strip().splitlines()[-1]),
              "settings": settings}
    print(json.dumps(result))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compile_time.json"), "w") as f:
        json.dump(result, f, indent=1)


def device_name(device: str) -> str:
    """The GPU's name for ``--device cuda``, else ``device`` itself."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return device


if __name__ == "__main__":
    main()
