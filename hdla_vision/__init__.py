"""hdla-vision: HDLA kernels, timm backbones, training and causal LMs."""
__version__ = "0.1.0"

from . import backbones  # noqa: F401  registers the timm models (hdla_tiny, hdla_small, hdla_base)
