"""Log-linear mixers on the HDLA backbone, as timm models at the tiny size.

Each name builds :class:`~hdla_vision.backbones.hdla.HDLAVisionTransformer` exactly as its linear
model (width 192, depth 12, 3 heads of 64) with the mixer's log-linear version (see
:mod:`hdla_vision.layers.mixer`: both scans on one absolute bucket grid, one lambda head per
direction):

=========================  ============================  ===================
timm name                  mixer (registry)              linear model
=========================  ============================  ===================
``loglinear_hdla_tiny``    ``loglinear_hdla``            ``hdla_tiny``
``loglinear_gdn_tiny``     ``loglinear_gated_deltanet``  ``gdn_tiny``
=========================  ============================  ===================

A checkpoint of the linear model loads into its log-linear model with only the lambda heads
missing, ``blocks.{i}.attn.directions.{0,1}.levels.{proj.weight,level_gain}``:
``model.load_state_dict(state_dict, strict=False)`` reports exactly these as its ``missing_keys``
(the model keeps their initial values), and :func:`~hdla_vision.backbones.hdla.checkpoint_filter_fn`
(what ``pretrained=True`` with ``pretrained_cfg_overlay=dict(file=...)`` runs) fills them with the
model's own initial values, so that timm's strict load takes the linear checkpoint.
"""
from typing import Any, Dict, Tuple

from timm.models import generate_default_cfgs, register_model

from .hdla import HDLAVisionTransformer, _cfg
from .seed import create_tiny

# timm name -> (mixer name, the mixer options the name fixes)
LOG_LINEAR_MODELS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "loglinear_hdla_tiny": ("loglinear_hdla", {}),
    "loglinear_gdn_tiny": ("loglinear_gated_deltanet", {}),
}

default_cfgs = generate_default_cfgs({name: _cfg() for name in LOG_LINEAR_MODELS})


@register_model
def loglinear_hdla_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """Log-linear HDLA-Tiny/16."""
    return create_tiny("loglinear_hdla_tiny", *LOG_LINEAR_MODELS["loglinear_hdla_tiny"], pretrained, kwargs)


@register_model
def loglinear_gdn_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """Log-linear Gated DeltaNet-Tiny/16."""
    return create_tiny("loglinear_gdn_tiny", *LOG_LINEAR_MODELS["loglinear_gdn_tiny"], pretrained, kwargs)
