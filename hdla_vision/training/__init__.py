"""DeiT-style image-classification training through Accelerate (see ``train_imagenet.py``).

Needs the ``train`` extra (Accelerate, TensorBoard, matplotlib); without it importing this
package raises ``ModuleNotFoundError`` naming the extra.
"""
from hdla_vision._extras import require_extra

TRAIN_EXTRA = ("accelerate", "tensorboard", "matplotlib", "tqdm")
require_extra(TRAIN_EXTRA, "train", "hdla_vision.training")

from hdla_vision.training.config import Config, load_config  # noqa: E402  (after the extra check)
from hdla_vision.training.runner import evaluate_checkpoint, train  # noqa: E402

__all__ = ["Config", "load_config", "train", "evaluate_checkpoint"]
