"""Fullgraph compile check of every ``*_tiny`` backbone of this project: one graph, no graph break, and the
compiled output and gradients equal eager.

    python -m tools.compile_models                                   # CPU, aot_eager, depth 2, 32 px
    python -m tools.compile_models --device cuda --img-size 224     # the Triton path, bf16 autocast
    python -m tools.compile_models --shard 1/2                      # every second model, from the second

Each model is built with ``depth`` blocks (the blocks are alike: tracing, not depth, is what is checked),
compiled with ``torch.compile(model, backend=..., fullgraph=True)`` on a fresh dynamo cache, and run
forward and backward (loss ``mean(logits^2)``) eagerly and compiled on the same images. A graph break
under fullgraph is an error, recorded with its first line. ``out_rel`` and ``grad_rel`` are the relative
differences (Frobenius norm) of the logits and of the worst of the input's and every parameter's
gradients. On CUDA the step runs under bf16 autocast, as training does; the Triton scans accumulate
across blocks with atomics, so compiled and eager may differ in the last bits there. ``aot_eager``
(the default) traces the forward and the backward with AOTAutograd, the op's fake implementations
included, without generating code; ``inductor`` generates it too (slow on a CPU).

The rows (and the provenance) go to ``compile_models.json`` in ``--out`` (default ``$OUT``, else ``.``).
tests/test_compiled_models.py runs :func:`check_model` on the CPU for every model.
"""
import argparse
import contextlib
import json
import os
import sys
import time
from typing import Dict, List, Optional

import timm
import torch
from torch._dynamo.utils import counters

import hdla_vision  # noqa: F401  registers the timm models
from tools.provenance import provenance
from tools.timm_suite import OUR_MODULES

TINY = sorted(name for name in timm.list_models(module=list(OUR_MODULES)) if name.endswith("_tiny"))


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``|got - expected| / |expected|`` (Frobenius; 0 when both are 0)."""
    diff = (got.double() - expected.double()).norm().item()
    return diff / max(expected.double().norm().item(), 1e-30) if diff else 0.0


def _run(module: torch.nn.Module, forward, images: torch.Tensor, autocast: Optional[torch.dtype]):
    """Logits and the gradients ``{name: grad}`` of the images (``"input"``) and every parameter."""
    module.zero_grad(set_to_none=True)
    x = images.clone().requires_grad_()
    context = (torch.autocast(images.device.type, dtype=autocast) if autocast is not None
               else contextlib.nullcontext())
    with context:
        logits = forward(x)
    logits.float().square().mean().backward()
    grads = {"input": x.grad, **{n: p.grad for n, p in module.named_parameters() if p.grad is not None}}
    return logits.detach().float(), grads


def check_model(module: torch.nn.Module, images: torch.Tensor, backend: str = "aot_eager",
                autocast: Optional[torch.dtype] = None) -> Dict:
    """Compile ``module`` with fullgraph and compare it with eager on ``images`` ``[B, 3, H, W]``: the
    graphs and graph breaks dynamo made, the seconds the first compiled step took, ``out_rel``,
    ``grad_rel``, how many parameters got a gradient (``params_with_grad``, of ``params``), or
    ``error`` (the first line of what compiling raised)."""
    row = dict(params=sum(1 for _ in module.parameters()))
    logits_ref, grads_ref = _run(module, module, images, autocast)
    torch._dynamo.reset()
    counters.clear()
    start = time.perf_counter()
    try:
        logits, grads = _run(module, torch.compile(module, backend=backend, fullgraph=True), images, autocast)
    except Exception as error:  # noqa: BLE001  recorded: the check reports every model
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        return row
    row["compile_and_step_s"] = round(time.perf_counter() - start, 2)
    row["graphs"] = counters["stats"]["unique_graphs"]
    row["graph_breaks"] = sum(counters["graph_break"].values())
    row["out_rel"] = relative(logits, logits_ref)
    row["grad_rel"] = max(relative(grads[n], grads_ref[n]) for n in grads_ref) if grads.keys() == grads_ref.keys() \
        else float("inf")
    row["params_with_grad"] = len(grads) - 1
    return row


def check_all(names: List[str], device: str, backend: str, depth: int, img_size: int, batch: int) -> List[Dict]:
    """:func:`check_model` for each named model (eval mode: drop path off), printed as it goes."""
    autocast = torch.bfloat16 if device.startswith("cuda") else None
    rows = []
    for name in names:
        torch.manual_seed(0)
        model = timm.create_model(name, depth=depth, img_size=img_size, num_classes=10).to(device).eval()
        images = torch.randn(batch, 3, img_size, img_size, device=device)
        row = dict(model=name, **check_model(model, images, backend, autocast))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def passed(row: Dict, tolerance: float) -> bool:
    return ("error" not in row and row["graphs"] == 1 and row["graph_breaks"] == 0
            and row["params_with_grad"] == row["params"] and max(row["out_rel"], row["grad_rel"]) <= tolerance)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=TINY, choices=TINY, metavar="MODEL")
    parser.add_argument("--shard", default="0/1", help="K/N: check every N-th model from the K-th (0-based)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest out_rel / grad_rel that passes (default 1e-5 on the CPU, 2e-2 on CUDA: bf16)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of compile_models.json")
    args = parser.parse_args(argv)
    index, count = (int(part) for part in args.shard.split("/"))
    if not 0 <= index < count:
        parser.error(f"--shard must be K/N with 0 <= K < N, got {args.shard}")
    tolerance = args.tolerance if args.tolerance is not None else (2e-2 if args.device.startswith("cuda") else 1e-5)
    rows = check_all(args.models[index::count], args.device, args.backend, args.depth, args.img_size, args.batch)
    for row in rows:
        row["passed"] = passed(row, tolerance)
    device = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else args.device
    settings = dict(backend=args.backend, depth=args.depth, img_size=args.img_size, batch=args.batch,
                    tolerance=tolerance, autocast="bfloat16" if args.device.startswith("cuda") else None)
    result = dict(**provenance(device), torch=torch.__version__, settings=settings, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compile_models.json"), "w") as f:
        json.dump(result, f, indent=1)
    failed = [row["model"] for row in rows if not row["passed"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} models compile to one graph equal to eager"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
