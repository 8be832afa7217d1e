"""timm's AutoAugment / RandAugment ops made independent of the installed Pillow version.

timm's posterize ops can ask for 0 bits: ``PosterizeIncreasing`` keeps ``4 - int(m / 10 * 4)``
bits, which is 0 whenever the magnitude reaches its upper bound 10 (with
``rand-m9-mstd0.5-inc1`` the magnitude is drawn from N(9, 0.5) and clamped to [0, 10], so
about 1 posterize call in 44 and 1 image in 600), and ``Posterize`` keeps
``int(m / 10 * 4)`` bits, 0 below magnitude 2.5. Pillow up to 12.x computed the
lookup table ``i & ~(2 ** (8 - bits) - 1)`` for any ``bits``, which for ``bits <= 0`` maps
every value to 0 (a black image); Pillow 13 raises ``ValueError: bits must be between or
equal to 1 and 8`` instead. ``exact_posterize`` reproduces the Pillow 12 result on every
Pillow, so the recipe trains on the same images as before, and ``use_exact_posterize``
swaps it into the ops of a transform built by ``timm.data.create_transform`` (only that
transform: timm's module-level op table is left alone).
"""
from __future__ import annotations

from PIL import Image, ImageOps
from timm.data import auto_augment

_LUT_MODES = ("L", "RGB")  # the modes Pillow 12's ImageOps._lut accepted


def exact_posterize(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """timm's ``posterize`` with Pillow 12's result for ``bits_to_keep <= 0`` (all values 0)."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep >= 1:
        return ImageOps.posterize(img, bits_to_keep)
    if img.mode not in _LUT_MODES:
        raise ValueError(f"posterize: image mode {img.mode!r} is not supported (expected L or RGB)")
    mask = ~(2 ** (8 - bits_to_keep) - 1)  # Pillow 12's formula: 0 for every bits_to_keep <= 0
    return img.point([i & mask for i in range(256)] * len(img.getbands()))


def use_exact_posterize(transform) -> int:
    """Replace timm's posterize in every AugmentOp inside ``transform``; return how many were replaced."""
    replaced = 0
    for op in _augment_ops(transform):
        if op.aug_fn is auto_augment.posterize:
            op.aug_fn = exact_posterize
            replaced += 1
    return replaced


def _augment_ops(transform):
    """Every ``AugmentOp`` reachable through Compose lists, RandAugment / AugMix ops and AutoAugment policies."""
    if isinstance(transform, auto_augment.AugmentOp):
        yield transform
    elif isinstance(transform, (list, tuple)):  # e.g. an AutoAugment sub-policy
        for child in transform:
            yield from _augment_ops(child)
    else:
        for attr in ("transforms", "ops", "policy"):
            yield from _augment_ops(getattr(transform, attr, ()))
