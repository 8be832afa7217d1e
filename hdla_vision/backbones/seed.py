"""Seed-mixer baselines on the HDLA backbone, as timm models at the tiny size (the HDLA paper's Table 8).

Each name builds :class:`~hdla_vision.backbones.hdla.HDLAVisionTransformer` with width 192, depth 12 and
3 heads (head dim 64), exactly as ``hdla_tiny``, with only the token mixer changed:

=================  ==========================  ==================================================
timm name          mixer (registry), options   recurrence
=================  ==========================  ==================================================
``gla_tiny``       ``gla``                     Diag(alpha) S + k v^T
``deltanet_tiny``  ``deltanet``                (I - b k k^T) S + b k v^T
``gdn_tiny``       ``gated_deltanet``          alpha (I - b k k^T) S + b k v^T
``kda_tiny``       ``kda``                     (I - b k k^T) Diag(alpha) S + b k v^T
``rwkv7_tiny``     ``rwkv7``                   (Diag(w) - (a * kh) kh^T) S + k v^T
``gdp2_tiny``      ``gated_deltaproduct``, 2   Gated DeltaProduct, n_h = ``num_householder`` = 2
``gdp3_tiny``      ``gated_deltaproduct``, 3   Gated DeltaProduct, n_h = ``num_householder`` = 3
``hihdn_tiny``     ``hih_deltanet``            Head-in-Head DeltaNet, r = 4 (static mask)
``hihgdn_tiny``    ``hih_gated_deltanet``      Head-in-Head Gated DeltaNet, r = 4 (static mask)
=================  ==========================  ==================================================
"""
from typing import Any, Dict, Tuple

from timm.models import generate_default_cfgs, register_model

from .hdla import HDLAVisionTransformer, _cfg, _create_hdla

TINY = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)

# timm name -> (mixer name, the mixer options the name fixes)
SEED_MODELS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "gla_tiny": ("gla", {}),
    "deltanet_tiny": ("deltanet", {}),
    "gdn_tiny": ("gated_deltanet", {}),
    "kda_tiny": ("kda", {}),
    "rwkv7_tiny": ("rwkv7", {}),
    "gdp2_tiny": ("gated_deltaproduct", {"num_householder": 2}),
    "gdp3_tiny": ("gated_deltaproduct", {"num_householder": 3}),
    "hihdn_tiny": ("hih_deltanet", {}),
    "hihgdn_tiny": ("hih_gated_deltanet", {}),
}

default_cfgs = generate_default_cfgs({name: _cfg() for name in SEED_MODELS})


def _create_seed(variant: str, pretrained: bool, kwargs: Dict[str, Any]) -> HDLAVisionTransformer:
    return create_tiny(variant, *SEED_MODELS[variant], pretrained, kwargs)


def create_tiny(variant: str, mixer: str, fixed: Dict[str, Any], pretrained: bool,
                kwargs: Dict[str, Any]) -> HDLAVisionTransformer:
    """The tiny layout with the token mixer ``mixer`` and the mixer options ``fixed`` (which kwargs may
    not change)."""
    if "mixer" in kwargs:
        raise ValueError(f"{variant} fixes mixer={mixer!r}; use hdla_tiny(mixer=...) for another mixer")
    mixer_kwargs = dict(kwargs.pop("mixer_kwargs", None) or {})
    clash = sorted(name for name in fixed if name in mixer_kwargs and mixer_kwargs[name] != fixed[name])
    if clash:
        raise ValueError(f"{variant} fixes mixer_kwargs {fixed}; got {clash} = {[mixer_kwargs[n] for n in clash]}")
    mixer_kwargs.update(fixed)
    return _create_hdla(variant, pretrained=pretrained, **dict(TINY, mixer=mixer, mixer_kwargs=mixer_kwargs, **kwargs))


@register_model
def gla_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """GLA-Tiny/16 on the HDLA backbone."""
    return _create_seed("gla_tiny", pretrained, kwargs)


@register_model
def deltanet_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """DeltaNet-Tiny/16 on the HDLA backbone."""
    return _create_seed("deltanet_tiny", pretrained, kwargs)


@register_model
def gdn_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """Gated DeltaNet-Tiny/16 on the HDLA backbone."""
    return _create_seed("gdn_tiny", pretrained, kwargs)


@register_model
def kda_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """KDA-Tiny/16 on the HDLA backbone."""
    return _create_seed("kda_tiny", pretrained, kwargs)


@register_model
def rwkv7_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """RWKV-7-Tiny/16 (its diagonal-plus-rank-1 transition) on the HDLA backbone."""
    return _create_seed("rwkv7_tiny", pretrained, kwargs)


@register_model
def gdp2_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """Gated DeltaProduct (n_h = 2)-Tiny/16 on the HDLA backbone."""
    return _create_seed("gdp2_tiny", pretrained, kwargs)


@register_model
def gdp3_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """Gated DeltaProduct (n_h = 3)-Tiny/16 on the HDLA backbone."""
    return _create_seed("gdp3_tiny", pretrained, kwargs)


@register_model
def hihdn_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """Head-in-Head DeltaNet (r = 4)-Tiny/16 on the HDLA backbone."""
    return _create_seed("hihdn_tiny", pretrained, kwargs)


@register_model
def hihgdn_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """Head-in-Head Gated DeltaNet (r = 4)-Tiny/16 on the HDLA backbone."""
    return _create_seed("hihgdn_tiny", pretrained, kwargs)
