"""hdla-vision: HDLA kernels, timm backbones, training and causal LMs."""
from hdla_vision._torchvision_compat import import_torchvision as _import_torchvision

_import_torchvision()
__version__ = "0.1.0"
