"""timm backbones; importing this registers ``hdla_tiny``, ``hdla_small``, ``hdla_base`` and the seed
baselines ``gla_tiny``, ``deltanet_tiny``, ``gdn_tiny``, ``kda_tiny``, ``rwkv7_tiny``, ``gdp2_tiny``,
``gdp3_tiny``, ``hihdn_tiny``, ``hihgdn_tiny`` and the log-linear ``loglinear_hdla_tiny``,
``loglinear_gdn_tiny`` with timm."""
from .hdla import HDLAVisionTransformer, MixerBlock, checkpoint_filter_fn
from . import seed  # noqa: F401  registers the seed-mixer baselines
from . import loglinear  # noqa: F401  registers the log-linear models
