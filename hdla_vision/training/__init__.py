"""DeiT-style image-classification training through Accelerate (see ``train_imagenet.py``)."""
from hdla_vision.training.config import Config, load_config
from hdla_vision.training.runner import evaluate_checkpoint, train

__all__ = ["Config", "load_config", "train", "evaluate_checkpoint"]
