"""timm backbones; importing this registers ``hdla_tiny``, ``hdla_small``, ``hdla_base`` with timm."""
from .hdla import Block, HDLAVisionTransformer, checkpoint_filter_fn
