"""hdla-vision: HDLA kernels, timm backbones, training and causal LMs."""
__version__ = "0.1.0"
