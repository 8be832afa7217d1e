"""Bidirectional HDLA vision backbones as timm models: ``hdla_tiny``, ``hdla_small``, ``hdla_base``.

:class:`HDLAVisionTransformer` is timm's :class:`~timm.models.vision_transformer.VisionTransformer`
(as timm's ``deit.py`` subclasses it): 16x16 patches, a learned absolute position embedding over
the patches, pre-norm blocks with MLP ratio 4, average pooling of the normalised patch tokens.
Only two things differ, both in :class:`MixerBlock`: its ``attn`` is a bidirectional
linear-attention token mixer chosen by name from the mixer registry (``mixer='hdla'`` by default,
see :mod:`hdla_vision.layers.hdla`), built with ``directions=("fwd", "bwd")`` (both scans, see
:mod:`hdla_vision.layers.mixer`), and the class token is scanned in the middle.

Class token placement: the scans run over the patches in raster order, forward and backward,
and a token at position i reads position j only through the decays of the |i - j| tokens
between them. A class token at the start would be reached by the backward scan alone and
would see the far end of the image through N decays; in the middle of the sequence (index
``N // 2`` of the N patch tokens, as in Vision Mamba) each scan brings it one half of the image
within N/2 steps. Everything else in a block acts on each token alone, so the model keeps the
class token first, where timm keeps its prefix tokens (``forward_features``, pooling,
``forward_intermediates`` and ``return_prefix_tokens`` work as for any timm ViT), and each block
moves it to index ``N // 2`` of the sequence its mixer scans and back. The position embedding
covers the patches only (timm's ``no_embed_class=True``).

Not supported (they raise ``ValueError``): ``attn_layer`` (use ``mixer``), ``qk_norm``,
``scale_attn_norm``, ``attn_drop_rate``, ``proj_bias=False``, ``reg_tokens``, attention masks
and causal masking, and the 'max' / 'avgmax' / 'map' / 'prr' pools. TorchScript cannot script
the Triton kernels; FX tracing treats the mixers as leaves.
"""
import logging
import re
from functools import partial
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import Mlp, register_notrace_function, register_notrace_module
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._input import update_model_args
from timm.models.vision_transformer import Block, VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as vit_checkpoint_filter_fn

from hdla_vision.layers import create_mixer
from hdla_vision.layers.mixer import recompute

__all__ = ["HDLAVisionTransformer", "MixerBlock", "checkpoint_filter_fn"]

_logger = logging.getLogger(__name__)

GLOBAL_POOLS = ("", "avg", "token")
# The mixers' vision use: both scans over the patches (hdla_vision.layers.mixer), eps of their norms.
VISION_DIRECTIONS = ("fwd", "bwd")
MIXER_NORM_EPS = 1e-5
# mixer arguments the block sets itself (mixer_kwargs may not)
BLOCK_MIXER_ARGUMENTS = ("dim", "num_heads", "directions", "qkv_bias", "proj_bias", "proj_drop", "norm_eps", "device",
                         "dtype")


def class_token_index(num_patches: int) -> int:
    """Where the class token sits among ``num_patches`` patch tokens in the scanned sequence (the middle)."""
    return num_patches // 2


def insert_class_token(x: torch.Tensor, cls_token: torch.Tensor) -> torch.Tensor:
    """``x [B, N, C]``, ``cls_token [1 or B, 1, C]`` -> ``[B, N + 1, C]`` with the token at ``N // 2``."""
    idx = class_token_index(x.shape[1])
    cls = cls_token.expand(x.shape[0], -1, -1).to(x.dtype)
    return torch.cat([x[:, :idx], cls, x[:, idx:]], dim=1)


def split_class_token(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [B, N + 1, C]`` with the token at ``N // 2`` -> ``(cls [B, 1, C], patches [B, N, C])``."""
    idx = class_token_index(x.shape[1] - 1)
    return x[:, idx:idx + 1], torch.cat([x[:, :idx], x[:, idx + 1:]], dim=1)


def _refuse(**options: Tuple[Any, Any]) -> None:
    """Raise for each timm attention option set away from the value our mixers implement."""
    for name, (value, supported) in options.items():
        if value != supported:
            raise ValueError(f"{name}={value!r} is not supported by the token mixers (only {supported!r})")


def _check_global_pool(global_pool: str, class_token: bool) -> None:
    if global_pool not in GLOBAL_POOLS:
        raise ValueError(f"global_pool must be one of {GLOBAL_POOLS}, got {global_pool!r}")
    if global_pool == "token" and not class_token:
        raise ValueError("global_pool='token' needs class_token=True")


@register_notrace_function  # under FX the arguments are proxies: the check is recorded, and runs with the graph
def check_no_mask(attn_mask: Optional[torch.Tensor], is_causal: bool) -> None:
    """timm's blocks take an attention mask and a causal flag; the bidirectional mixers use neither."""
    if attn_mask is not None or is_causal:
        raise ValueError("attn_mask / is_causal: the bidirectional token mixers take no attention mask")


class MixerBlock(Block):
    """timm's pre-norm ViT block whose ``attn`` is a registered bidirectional token mixer.

    ``x [B, P + N, C] -> [B, P + N, C]`` with ``P = num_prefix_tokens`` (0, or 1 for the class
    token, first). The mixer is built by name with ``(dim, num_heads, directions=("fwd", "bwd"),
    qkv_bias, proj_bias, proj_drop, norm_eps=1e-5, device, dtype, **mixer_kwargs)`` and scans the
    class token at index ``N // 2``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mixer: str = "hdla",
        mixer_kwargs: Optional[Dict[str, Any]] = None,
        num_prefix_tokens: int = 0,
        qkv_bias: bool = False,
        proj_drop: float = 0.0,
        qk_norm: bool = False,
        scale_attn_norm: bool = False,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        attn_layer: Any = None,
        device=None,
        dtype=None,
        **block_kwargs,
    ):
        _refuse(qk_norm=(qk_norm, False), scale_attn_norm=(scale_attn_norm, False),
                proj_bias=(proj_bias, True), attn_drop=(attn_drop, 0.0))
        fixed = sorted(set(mixer_kwargs or {}) & set(BLOCK_MIXER_ARGUMENTS))
        if fixed:
            raise ValueError(f"mixer_kwargs may not set {fixed}: the backbone sets them")
        # nn.Identity takes (and ignores) timm's attention arguments; the mixer replaces it below
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop, proj_bias=proj_bias,
                         attn_layer=nn.Identity, device=device, dtype=dtype, **block_kwargs)
        self.attn = create_mixer(
            mixer, dim=dim, num_heads=num_heads, directions=VISION_DIRECTIONS, qkv_bias=qkv_bias, proj_bias=proj_bias,
            proj_drop=proj_drop, norm_eps=MIXER_NORM_EPS, device=device, dtype=dtype, **(mixer_kwargs or {}),
        )
        register_notrace_module(type(self.attn))  # FX traces the blocks and keeps the mixer (its kernels) a leaf
        self.num_prefix_tokens = num_prefix_tokens

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """``attn(norm1(x))`` for the block's input ``x``, with the class token (first in ``x [B, 1 + N, C]``)
        scanned at index ``N // 2``. The mixer applies ``norm1`` itself, inside its recomputed stages
        (:mod:`hdla_vision.layers.mixer`): the normalised tokens are not kept for the backward."""
        if not self.num_prefix_tokens:
            return self.attn(x, norm=self.norm1)
        cls, patches = split_class_token(self.attn(insert_class_token(x[:, 1:], x[:, :1]), norm=self.norm1))
        return torch.cat([cls, patches], dim=1)

    def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``self.mlp(x)``; for timm's ``Mlp``, the activation recomputed in the backward
        (:func:`~hdla_vision.layers.mixer.recompute`): fc1's output is kept, not the activation's."""
        mlp = self.mlp
        if type(mlp) is not Mlp:
            return mlp(x)
        random = self.training and mlp.drop1.p > 0
        return mlp.drop2(recompute(self.mlp_hidden_to_output, mlp.fc1(x), random=random))

    def mlp_hidden_to_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """timm's ``Mlp`` after fc1, before its last dropout: ``fc2(norm(drop1(act(hidden))))``."""
        mlp = self.mlp
        return mlp.fc2(mlp.norm(mlp.drop1(mlp.act(hidden))))

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        check_no_mask(attn_mask, is_causal)
        x = x + self.drop_path1(self.ls1(self.mix(x)))
        return x + self.drop_path2(self.ls2(self.mlp_forward(self.norm2(x))))


class HDLAVisionTransformer(VisionTransformer):
    """timm's ViT with a bidirectional linear-attention token mixer (HDLA by default) in every block.

    ``forward(x [B, in_chans, H, W]) -> logits [B, num_classes]`` (or pooled features
    ``[B, embed_dim]`` with ``num_classes=0``, or tokens ``[B, L, embed_dim]`` with
    ``global_pool=''``). ``forward_features`` returns the normalised tokens ``[B, L, C]``,
    ``L = N (+1: the class token, first)``. Takes every argument of timm's ``VisionTransformer``
    (``device`` and ``dtype`` included) except those listed in the module docstring, plus
    ``mixer`` (a registered mixer name) and ``mixer_kwargs``; the defaults are those of ``hdla_tiny``.
    """

    def __init__(
        self,
        embed_dim: int = 192,
        depth: int = 12,
        num_heads: int = 3,
        qkv_bias: bool = False,
        class_token: bool = False,
        global_pool: str = "avg",
        reg_tokens: int = 0,
        attn_drop_rate: float = 0.0,
        mixer: str = "hdla",
        mixer_kwargs: Optional[Dict[str, Any]] = None,
        **kwargs,
    ):
        if not (isinstance(embed_dim, int) and isinstance(num_heads, int) and num_heads > 0 and embed_dim % num_heads == 0):
            raise ValueError(f"embed_dim must be a multiple of num_heads, got {embed_dim} and {num_heads}")
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive int, got {depth!r}")
        _check_global_pool(global_pool, class_token)
        _refuse(reg_tokens=(reg_tokens, 0), attn_drop_rate=(attn_drop_rate, 0.0))
        if "attn_layer" in kwargs or "block_fn" in kwargs:
            raise ValueError("attn_layer / block_fn: the token mixer is chosen with mixer=<name> (hdla_vision.layers.list_mixers())")
        block_fn = partial(MixerBlock, mixer=mixer, mixer_kwargs=mixer_kwargs, num_prefix_tokens=int(class_token))
        super().__init__(
            embed_dim=embed_dim, depth=depth, num_heads=num_heads, qkv_bias=qkv_bias, class_token=class_token,
            global_pool=global_pool, no_embed_class=True, fc_norm=False, block_fn=block_fn, **kwargs,
        )

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """New head with ``num_classes`` outputs (identity for 0); optionally a new pooling."""
        if global_pool is not None:
            _check_global_pool(global_pool, self.has_class_token)
        super().reset_classifier(num_classes, global_pool)
        if global_pool is not None:
            update_model_args(self, global_pool=global_pool)


def rename_v0_keys(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """State dicts of the first layout (before the backbone became a timm ``VisionTransformer``)
    named each block's mixer ``blocks.{i}.mixer``; timm's blocks call it ``attn``."""
    def rename(key: str) -> str:
        parts = key.split(".")
        if len(parts) > 3 and parts[0] == "blocks" and parts[2] == "mixer":
            parts[2] = "attn"
        return ".".join(parts)

    return {rename(key): value for key, value in state_dict.items()}


_LAMBDA_HEAD = re.compile(r"^blocks\.\d+\.attn\.directions\.\d+\.levels\.")
_V1_HDLA_DECAY = re.compile(r"^(blocks\.\d+\.attn)\.decay_(fwd|bwd)\.(.+)$")
_V1_HDLA_BETA = re.compile(r"^(blocks\.\d+\.attn)\.beta\.(weight|bias)$")


def convert_v1_hdla_gates(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """State dicts of the second layout (before one mixer class served vision and the LM, issue 18)
    kept the HDLA mixer's gates apart from the ``directions`` of the other mixers:
    ``attn.decay_{fwd,bwd}.{down,up}.*`` is now ``attn.directions.{0,1}.decay.logits.{down,up}.*``,
    and ``attn.beta`` (one linear map, rows ``[:H]`` forward, ``[H:]`` backward) is split into
    ``attn.directions.{0,1}.beta.proj``. The other mixers' keys did not change."""
    out = {}
    for key, value in state_dict.items():
        decay, beta = _V1_HDLA_DECAY.match(key), _V1_HDLA_BETA.match(key)
        if decay:
            prefix, direction, rest = decay.groups()
            out[f"{prefix}.directions.{'01'[direction == 'bwd']}.decay.logits.{rest}"] = value
        elif beta:
            prefix, name = beta.groups()
            forward, backward = value.chunk(2, dim=0)
            out[f"{prefix}.directions.0.beta.proj.{name}"] = forward
            out[f"{prefix}.directions.1.beta.proj.{name}"] = backward
        else:
            out[key] = value
    return out


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: HDLAVisionTransformer) -> Dict[str, torch.Tensor]:
    """Adapt a checkpoint to ``model``: old key names are renamed (:func:`rename_v0_keys`,
    :func:`convert_v1_hdla_gates`); timm's ViT filter resamples the position embedding to the model's
    grid and the patch kernel to its patch size; a classifier whose shape differs from the model's
    (another number of classes) is dropped and the model keeps its own freshly initialised head; a
    linear model's checkpoint in a log-linear model lacks the lambda heads
    (``blocks.{i}.attn.directions.{d}.levels.*``), which keep the model's initial values."""
    state_dict = state_dict.get("model", state_dict)
    state_dict = state_dict.get("state_dict", state_dict)
    state_dict = convert_v1_hdla_gates(rename_v0_keys(state_dict))
    state_dict = vit_checkpoint_filter_fn(state_dict, model)
    model_state = model.state_dict()
    out = {}
    for key, value in state_dict.items():
        if key.startswith("head.") and (key not in model_state or model_state[key].shape != value.shape):
            _logger.info(f"checkpoint {key} {tuple(value.shape)} does not fit the model's head; dropped")
            continue
        out[key] = value
    lambda_heads = [key for key in model_state if _LAMBDA_HEAD.match(key) and key not in out]
    if lambda_heads:
        _logger.info(f"checkpoint has no log-linear lambda heads ({len(lambda_heads)} tensors, e.g. {lambda_heads[0]}); "
                     "the model keeps their initial values")
    for key, value in model_state.items():
        if (key.startswith("head.") or key in lambda_heads) and key not in out:
            out[key] = value  # keep the model's own values so the load stays strict for every other key
    return out


def _create_hdla(variant: str, pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        HDLAVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )


def _cfg(url: str = "", **kwargs) -> Dict[str, Any]:
    return {
        "url": url,
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "hdla_tiny": _cfg(),
    "hdla_small": _cfg(),
    "hdla_base": _cfg(),
})


@register_model
def hdla_tiny(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """HDLA-Tiny/16: width 192, depth 12, 3 heads (head dim 64)."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
    return _create_hdla("hdla_tiny", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def hdla_small(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """HDLA-Small/16: width 384, depth 12, 6 heads (head dim 64)."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_hdla("hdla_small", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def hdla_base(pretrained: bool = False, **kwargs) -> HDLAVisionTransformer:
    """HDLA-Base/16: width 768, depth 12, 12 heads (head dim 64)."""
    model_args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create_hdla("hdla_base", pretrained=pretrained, **dict(model_args, **kwargs))
