"""Every shipped config's train transform survives thousands of images on the installed Pillow / timm.

An upstream change that makes an augmentation op raise (Pillow 13 refusing posterize with 0
bits, which timm's RandAugment asks for at magnitude 10) fails here, not in a user's run.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import auto_augment

from hdla_vision.training.augment import exact_posterize
from hdla_vision.training.config import load_config
from hdla_vision.training.data import build_transforms, data_settings
from tests.training_helpers import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
IMAGES_PER_CONFIG = 3000
SMALL_SIZE = 32  # the ops are the same at every size; small images keep this to seconds


def pillow12_posterize(array: np.ndarray, bits: int) -> np.ndarray:
    """Pillow 12.3's ImageOps.posterize lookup table ``i & ~(2 ** (8 - bits) - 1)``, for any bits."""
    return array & np.uint8(~(2 ** (8 - bits) - 1) & 0xFF)


def generated_images(count: int, seed: int) -> list:
    """Noise, flat-colour and grey images of varied sizes and aspect ratios (flat ones stress autocontrast)."""
    rng = np.random.default_rng(seed)
    images = []
    for i in range(count):
        h, w = (int(s) for s in rng.integers(16, 72, size=2))
        if i % 3 == 0:
            pixels = np.broadcast_to(rng.integers(0, 256, size=3, dtype=np.uint8), (h, w, 3))
        elif i % 3 == 1:
            pixels = np.repeat(rng.integers(0, 256, size=(h, w, 1), dtype=np.uint8), 3, axis=2)
        else:
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        images.append(Image.fromarray(np.ascontiguousarray(pixels)))
    return images


def train_transform(config_path):
    config = load_config(config_path, [f"data.img_size={SMALL_SIZE}"])
    return build_transforms(config, data_settings(config, None))[0]


def augment_ops(transform) -> list:
    ops = [t.ops for t in transform.transforms if isinstance(t, auto_augment.RandAugment)]
    return [op for group in ops for op in group]


@pytest.mark.parametrize("mode", ["L", "RGB"])
@pytest.mark.parametrize("bits", [-3, -1, 0, 1, 2, 4, 7, 8, 9])
def test_exact_posterize_gives_pillow12_results(bits, mode):
    array = np.random.default_rng(bits + 10).integers(0, 256, size=(9, 7, 3), dtype=np.uint8)
    image = Image.fromarray(array).convert(mode)
    expected = np.asarray(image) if bits >= 8 else pillow12_posterize(np.asarray(image), bits)
    result = exact_posterize(image, bits)
    assert result.mode == mode
    np.testing.assert_array_equal(np.asarray(result), expected)
    if bits <= 0:
        assert not np.asarray(result).any()


def test_train_transforms_use_exact_posterize():
    transform = train_transform(REPO / "configs" / "hdla_tiny.yaml")
    posterize = [op for op in augment_ops(transform) if "Posterize" in op.name]
    assert posterize and all(op.aug_fn is exact_posterize for op in posterize)
    assert auto_augment.NAME_TO_OP["PosterizeIncreasing"] is auto_augment.posterize  # timm itself untouched


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda p: p.stem)
def test_every_augment_op_runs_at_its_magnitude_bounds(config_path):
    """Each RandAugment op at magnitude 0 and at its upper bound, the two ends the noise is clamped to."""
    image = generated_images(3, seed=1)[2]
    for op in augment_ops(train_transform(config_path)):
        for magnitude in (0.0, op.magnitude_max or auto_augment._LEVEL_DENOM):
            op.prob, op.magnitude, op.magnitude_std = 1.0, magnitude, 0.0
            assert op(image.convert("RGB")).size == image.size, (op.name, magnitude)


def test_every_shipped_config_augments_thousands_of_images():
    """The whole train transform of every config in configs/ over generated images, as the loader calls it."""
    images = generated_images(IMAGES_PER_CONFIG, seed=0)
    zero_bit_calls = []
    for index, config_path in enumerate(CONFIGS):
        transform = train_transform(config_path)
        for op in augment_ops(transform):
            if "Posterize" in op.name:
                op.aug_fn = _recording(op.aug_fn, zero_bit_calls)
        random.seed(index)
        np.random.seed(index)
        torch.manual_seed(index)
        for i, image in enumerate(images):
            try:
                out = transform(image)
            except Exception as err:
                raise AssertionError(f"{config_path.name}: image {i} {image.size}: {type(err).__name__}: {err}")
            assert out.shape == (3, SMALL_SIZE, SMALL_SIZE)
    assert zero_bit_calls, "no posterize call with 0 bits: the test no longer covers the case that broke"


def _recording(fn, zero_bit_calls: list):
    def wrapped(img, bits, **kwargs):
        if bits <= 0:
            zero_bit_calls.append(bits)
        return fn(img, bits, **kwargs)
    return wrapped
