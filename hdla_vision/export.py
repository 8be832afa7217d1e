"""ONNX export of a registered backbone, checked against eager PyTorch with onnxruntime.

    python -m hdla_vision.export --model hdla_tiny --out model.onnx [--img-size 224] [--opset 18]
                                 [--checkpoint file.safetensors] [--batch 2]

Exports ``model(image [N, 3, S, S]) -> logits [N, num_classes]`` with a dynamic batch N and a fixed
image size S (the chunk loop of the scans is unrolled for the token count of that size), through
``torch.onnx.export(dynamo=True)``. Under ONNX export the linear-attention ops run their exportable
decomposition (``kernels/ops.py``), so the graph holds standard ONNX operators only. It then runs the
file in onnxruntime on a random batch and prints the relative error against the eager model.

Needs the ``export`` extra (onnx, onnxscript, onnxruntime). Not imported by ``import hdla_vision``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

import hdla_vision  # noqa: F401  registers the backbones
from hdla_vision._extras import raise_missing_extra

MIN_OPSET = 17
DEFAULT_IMG_SIZE = 224
EXTERNAL_DATA_BYTES = 1 << 30  # above this the weights go to a side file (protobuf's 2 GiB limit)


def _require(module: str) -> None:
    """Import ``module`` or raise an ImportError naming the ``export`` extra."""
    try:
        __import__(module)
    except ImportError as err:
        raise_missing_extra(err, module, "export", "hdla_vision.export")


def build_model(name: str, img_size: int, checkpoint: Optional[str] = None, **kwargs) -> torch.nn.Module:
    """``timm.create_model(name, img_size=img_size, **kwargs)`` in eval mode, with the weights of a
    safetensors export of this project (file or run directory) if ``checkpoint`` is given (its
    recorded architecture kwargs and num_classes are used; another image size resamples the
    position embedding). ValueError for an unknown name or a checkpoint that does not fit."""
    from hdla_vision.training.models import _create, _create_from_checkpoint, check_model_name
    from hdla_vision.training.models import read_export_metadata, resolve_weights_file, saved_model_kwargs

    check_model_name(name)
    if checkpoint is None:
        return _create(name, img_size, **kwargs).eval()
    meta = read_export_metadata(resolve_weights_file(checkpoint))
    if meta.get("model_name", name) != name:
        raise ValueError(f"checkpoint '{checkpoint}' holds a '{meta['model_name']}' model, not '{name}'")
    kwargs = {**saved_model_kwargs(meta, checkpoint), **kwargs}
    return _create_from_checkpoint(name, img_size, checkpoint, kwargs).eval()


def export_onnx(model: torch.nn.Module, out: str | Path, img_size: int, opset: int = 18, batch: int = 2) -> float:
    """Export ``model`` (image ``[N, 3, img_size, img_size]`` -> output) to ``out`` with a dynamic N,
    tracing it on a batch of ``batch >= 2`` (torch.export specialises sizes 0 and 1). Returns the
    export time in seconds."""
    _require("onnxscript")
    if opset < MIN_OPSET:
        raise ValueError(f"opset {opset} is below {MIN_OPSET}")
    image = torch.randn(max(batch, 2), 3, img_size, img_size)
    big = sum(p.numel() * p.element_size() for p in model.parameters()) > EXTERNAL_DATA_BYTES
    start = time.perf_counter()
    with torch.no_grad():
        torch.onnx.export(model, (image,), str(out), dynamo=True, opset_version=opset, input_names=["image"],
                          output_names=["output"], dynamic_shapes=({0: torch.export.Dim("batch")},),
                          external_data=big, verbose=False)
    return time.perf_counter() - start


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def onnx_parity(model: torch.nn.Module, path: str | Path, img_size: int, batch: int = 2, seed: int = 0) -> float:
    """Relative error of onnxruntime's output for the file at ``path`` against ``model`` in eager mode
    on a random image batch ``[batch, 3, img_size, img_size]`` (CPU execution provider)."""
    _require("onnxruntime")
    import onnxruntime

    image = torch.randn(batch, 3, img_size, img_size, generator=torch.Generator().manual_seed(seed))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: image.numpy()})
    with torch.no_grad():
        ref = model(image)
    return rel_error(torch.from_numpy(out), ref)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hdla_vision.export", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="registered timm model name, e.g. hdla_tiny, gdn_tiny")
    parser.add_argument("--out", required=True, help="the .onnx file to write")
    parser.add_argument("--img-size", type=int, default=None,
                        help=f"image side in pixels (default: the checkpoint's, else {DEFAULT_IMG_SIZE})")
    parser.add_argument("--opset", type=int, default=18, help=f"ONNX opset, >= {MIN_OPSET} (default 18)")
    parser.add_argument("--checkpoint", default=None, help="weights: a .safetensors export or a run directory")
    parser.add_argument("--batch", type=int, default=2, help="batch of the onnxruntime check (default 2)")
    args = parser.parse_args(argv)
    if args.opset < MIN_OPSET:
        parser.error(f"--opset: {args.opset} is below {MIN_OPSET}, the lowest supported")
    if args.img_size is not None and args.img_size <= 0:
        parser.error(f"--img-size: must be positive, got {args.img_size}")
    if args.batch <= 0:
        parser.error(f"--batch: must be positive, got {args.batch}")
    out = Path(args.out)
    if out.suffix != ".onnx" or not out.parent.is_dir():
        parser.error(f"--out: '{args.out}' must be a .onnx file in an existing directory")
    args.parser = parser
    return args


def _img_size(args: argparse.Namespace) -> int:
    """--img-size, else the size the checkpoint records, else 224."""
    if args.img_size is not None:
        return args.img_size
    if args.checkpoint is not None:
        from hdla_vision.training.models import read_export_metadata, resolve_weights_file

        return int(read_export_metadata(resolve_weights_file(args.checkpoint)).get("img_size", DEFAULT_IMG_SIZE))
    return DEFAULT_IMG_SIZE


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The CLI: export, check with onnxruntime, print the time and the relative error. Returns 0."""
    args = parse_args(argv)
    for module in ("onnx", "onnxscript", "onnxruntime"):
        _require(module)
    from hdla_vision.training.models import check_model_name

    try:
        check_model_name(args.model)
    except ValueError as err:
        args.parser.error(f"--model: {err}")
    try:  # with the name known, what can still fail is the checkpoint (unreadable, another model, mismatch)
        img_size = _img_size(args)
        model = build_model(args.model, img_size, args.checkpoint)
    except ValueError as err:
        args.parser.error(f"{'--checkpoint' if args.checkpoint else '--model'}: {err}")
    seconds = export_onnx(model, args.out, img_size, args.opset)
    print(f"exported {args.model} ({img_size}x{img_size}, opset {args.opset}, dynamic batch) to {args.out} "
          f"in {seconds:.1f} s")
    err = onnx_parity(model, args.out, img_size, args.batch)
    print(f"onnxruntime vs eager on a random batch of {args.batch}: relative error {err:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
