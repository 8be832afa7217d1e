"""The built-in quickstart dataset: procedurally drawn shapes, written once as an ImageFolder.

Ten classes of shapes and patterns (circle, square, triangle, plus, ring, diamond,
horizontal bars, vertical bars, checkerboard, diagonal cross), each drawn at a random
position and scale, with random foreground/background colours and pixel noise. The
images are written as PNG files under ``<cache>/train/<class>/`` and ``<cache>/val/<class>/``,
so training on it goes through exactly the same ImageFolder code path as ImageNet.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLASS_NAMES = (
    "circle", "square", "triangle", "plus", "ring",
    "diamond", "horizontal_bars", "vertical_bars", "checkerboard", "diagonal_cross",
)
_FORMAT_VERSION = 2
_DRAW_SCALE = 4  # draw at 4x and downsample: anti-aliased edges


def default_cache_dir() -> Path:
    """``$HDLA_VISION_CACHE`` or ``~/.cache/hdla_vision``."""
    root = os.environ.get("HDLA_VISION_CACHE") or Path.home() / ".cache" / "hdla_vision"
    return Path(root)


def _contrasting_colours(rng: np.random.Generator) -> tuple[tuple, tuple]:
    """A bright foreground of random hue on a dark background of random hue."""
    fg = rng.integers(110, 256, size=3)
    fg[rng.integers(0, 3)] = rng.integers(220, 256)
    bg = rng.integers(0, 90, size=3)
    return tuple(int(c) for c in fg), tuple(int(c) for c in bg)


def _draw_shape(draw: ImageDraw.ImageDraw, name: str, box: tuple, fg: tuple, rng: np.random.Generator) -> None:
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    thick = max(2.0, 0.22 * w)
    if name == "circle":
        draw.ellipse(box, fill=fg)
    elif name == "square":
        draw.rectangle(box, fill=fg)
    elif name == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fg)
    elif name == "plus":
        draw.rectangle((cx - thick / 2, y0, cx + thick / 2, y1), fill=fg)
        draw.rectangle((x0, cy - thick / 2, x1, cy + thick / 2), fill=fg)
    elif name == "ring":
        draw.ellipse(box, outline=fg, width=int(max(2, 0.15 * w)))
    elif name == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fg)
    elif name in ("horizontal_bars", "vertical_bars"):
        bars = int(rng.integers(3, 5))
        step = (h if name == "horizontal_bars" else w) / (2 * bars - 1)
        for i in range(bars):
            a = i * 2 * step
            if name == "horizontal_bars":
                draw.rectangle((x0, y0 + a, x1, y0 + a + step), fill=fg)
            else:
                draw.rectangle((x0 + a, y0, x0 + a + step, y1), fill=fg)
    elif name == "checkerboard":
        cells = int(rng.integers(3, 5))
        cw, ch = w / cells, h / cells
        for i in range(cells):
            for j in range(cells):
                if (i + j) % 2 == 0:
                    draw.rectangle((x0 + i * cw, y0 + j * ch, x0 + (i + 1) * cw, y0 + (j + 1) * ch), fill=fg)
    elif name == "diagonal_cross":
        draw.line((x0, y0, x1, y1), fill=fg, width=int(thick))
        draw.line((x0, y1, x1, y0), fill=fg, width=int(thick))
    else:
        raise ValueError(f"unknown quickstart class '{name}'")


def render_example(class_index: int, image_size: int, rng: np.random.Generator) -> Image.Image:
    """Draw one RGB image of class ``CLASS_NAMES[class_index]``, ``image_size`` pixels square."""
    canvas = image_size * _DRAW_SCALE
    fg, bg = _contrasting_colours(rng)
    image = Image.new("RGB", (canvas, canvas), bg)
    side = rng.uniform(0.45, 0.85) * canvas
    aspect = rng.uniform(0.85, 1.15)
    w, h = side * min(1.0, aspect), side * min(1.0, 1.0 / aspect)
    x0, y0 = rng.uniform(0, canvas - w), rng.uniform(0, canvas - h)
    _draw_shape(ImageDraw.Draw(image), CLASS_NAMES[class_index], (x0, y0, x0 + w, y0 + h), fg, rng)
    image = image.resize((image_size, image_size), Image.Resampling.BICUBIC)
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0.0, rng.uniform(4, 16), (image_size, image_size, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _write_split(root: Path, split: str, per_class: int, image_size: int, rng: np.random.Generator) -> None:
    for class_index, name in enumerate(CLASS_NAMES):
        folder = root / split / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            render_example(class_index, image_size, rng).save(folder / f"{name}_{i:05d}.png")


def ensure_quickstart_dataset(
    cache_dir: str | Path | None = None,
    train_per_class: int = 500,
    val_per_class: int = 100,
    image_size: int = 32,
    seed: int = 0,
) -> Path:
    """Return the dataset root (``train/`` and ``val/`` inside), generating it on first use.

    The dataset is written to a temporary directory and renamed into place, so an
    interrupted generation never leaves a half-written dataset behind.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"quickstart-v{_FORMAT_VERSION}-{image_size}px-{train_per_class}x{val_per_class}-seed{seed}"
    root = cache_dir / name
    if (root / "COMPLETE").is_file():
        return root
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        rng = np.random.default_rng(seed)
        _write_split(staging, "train", train_per_class, image_size, rng)
        _write_split(staging, "val", val_per_class, image_size, rng)
        (staging / "COMPLETE").write_text("ok\n")
        try:
            os.replace(staging, root)
        except OSError:
            if not (root / "COMPLETE").is_file():  # another process did not win the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root
