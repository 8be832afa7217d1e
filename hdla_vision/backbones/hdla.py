"""Bidirectional HDLA vision backbones as timm models: ``hdla_tiny``, ``hdla_small``, ``hdla_base``.

A plain isotropic ViT layout (16x16 patches, learned absolute position embedding, pre-norm
blocks with MLP ratio 4) whose token mixer is chosen by name from the vision mixer registry
(``mixer='hdla'`` by default, see :mod:`hdla_vision.layers.hdla`).

Class token placement: the scans run over the patches in raster order, forward and backward,
and a token at position i reads position j only through the decays of the |i - j| tokens
between them. A class token at the start would be reached by the backward scan alone and
would see the far end of the image through N decays; in the middle of the sequence (index
``N // 2`` of the N patch tokens, as in Vision Mamba) each scan brings it one half of the image
within N/2 steps. So, when ``class_token=True``, it is inserted at index ``N // 2`` (after
the position embedding, which covers the patches only), and pooling / intermediates take it
out from there. Without a class token (the default) the head averages the patch tokens.
"""
import logging
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    DropPath,
    LayerNorm,
    LayerScale,
    Mlp,
    PatchEmbed,
    calculate_drop_path_rates,
    resample_abs_pos_embed,
    resample_patch_embed,
    trunc_normal_,
)
from timm.models import build_model_with_cfg, checkpoint, checkpoint_seq, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from timm.models._input import get_pretrained_grid_size, update_model_args, update_model_input_size
from timm.models._manipulate import named_apply

from hdla_vision.layers import create_mixer

__all__ = ["HDLAVisionTransformer", "Block", "checkpoint_filter_fn"]

_logger = logging.getLogger(__name__)

GLOBAL_POOLS = ("", "avg", "token")


class Block(nn.Module):
    """Pre-norm residual block: ``x + DropPath(LS(mixer(LN(x))))``, then the same with an MLP.

    ``x [B, L, C] -> [B, L, C]``. The mixer is built by name through the vision mixer registry
    with ``(dim, num_heads, qkv_bias, proj_drop, **mixer_kwargs)``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        proj_drop: float = 0.0,
        init_values: Optional[float] = None,
        drop_path: float = 0.0,
        act_layer: Callable = nn.GELU,
        norm_layer: Callable = LayerNorm,
        mlp_layer: Callable = Mlp,
        mixer: str = "hdla",
        mixer_kwargs: Optional[Dict[str, Any]] = None,
    ):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.mixer = create_mixer(
            mixer, kind="vision", dim=dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop,
            **(mixer_kwargs or {}),
        )
        self.ls1 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.ls2 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.mixer(self.norm1(x))))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


def class_token_index(num_patches: int) -> int:
    """Where the class token sits among ``num_patches`` patch tokens (the middle)."""
    return num_patches // 2


def insert_class_token(x: torch.Tensor, cls_token: torch.Tensor) -> torch.Tensor:
    """``x [B, N, C]``, ``cls_token [1, 1, C]`` -> ``[B, N + 1, C]`` with the token at ``N // 2``."""
    idx = class_token_index(x.shape[1])
    cls = cls_token.expand(x.shape[0], -1, -1).to(x.dtype)
    return torch.cat([x[:, :idx], cls, x[:, idx:]], dim=1)


def split_class_token(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [B, N + 1, C]`` -> ``(cls [B, 1, C], patches [B, N, C])``."""
    idx = class_token_index(x.shape[1] - 1)
    return x[:, idx:idx + 1], torch.cat([x[:, :idx], x[:, idx + 1:]], dim=1)


def _check_global_pool(global_pool: str, class_token: bool) -> None:
    if global_pool not in GLOBAL_POOLS:
        raise ValueError(f"global_pool must be one of {GLOBAL_POOLS}, got {global_pool!r}")
    if global_pool == "token" and not class_token:
        raise ValueError("global_pool='token' needs class_token=True")


class HDLAVisionTransformer(nn.Module):
    """Isotropic ViT with a bidirectional linear-attention token mixer (HDLA by default).

    ``forward(x [B, in_chans, H, W]) -> logits [B, num_classes]`` (or pooled features
    ``[B, embed_dim]`` with ``num_classes=0``, or tokens ``[B, L, embed_dim]`` with
    ``global_pool=''``). ``forward_features`` returns the normalised tokens ``[B, L, C]``,
    ``L = N (+1 with the class token at N // 2)``.
    """

    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        patch_size: Union[int, Tuple[int, int]] = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        embed_dim: int = 192,
        depth: int = 12,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        init_values: Optional[float] = None,
        class_token: bool = False,
        dynamic_img_size: bool = False,
        dynamic_img_pad: bool = False,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        mixer: str = "hdla",
        mixer_kwargs: Optional[Dict[str, Any]] = None,
        weight_init: str = "",
        **kwargs,
    ):
        super().__init__()
        if kwargs:
            raise ValueError(f"unknown arguments for HDLAVisionTransformer: {sorted(kwargs)}")
        _check_global_pool(global_pool, class_token)
        if weight_init not in ("", "skip"):
            raise ValueError(f"weight_init must be '' or 'skip', got {weight_init!r}")
        if not (isinstance(embed_dim, int) and isinstance(num_heads, int) and num_heads > 0 and embed_dim % num_heads == 0):
            raise ValueError(f"embed_dim must be a multiple of num_heads, got {embed_dim} and {num_heads}")
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive int, got {depth!r}")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
        self.has_class_token = class_token
        self.dynamic_img_size = dynamic_img_size
        self.grad_checkpointing = False

        embed_args = dict(strict_img_size=False, output_fmt="NHWC") if dynamic_img_size else {}
        self.patch_embed = PatchEmbed(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
            dynamic_img_pad=dynamic_img_pad, **embed_args,
        )
        reduction = self.patch_embed.feat_ratio()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim))
        self.pos_drop = nn.Dropout(pos_drop_rate)

        dpr = calculate_drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.Sequential(*[
            Block(
                dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                proj_drop=proj_drop_rate, init_values=init_values, drop_path=dpr[i],
                mixer=mixer, mixer_kwargs=mixer_kwargs,
            )
            for i in range(depth)
        ])
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=reduction) for i in range(depth)]
        self.norm = LayerNorm(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if weight_init != "skip":
            self.init_weights()

    # ----------------------------------------------------------------------------- init
    def init_weights(self) -> None:
        """ViT-style init (truncated normal 0.02 for linears and embeddings), then each mixer's own init."""
        trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        named_apply(_init_linear, self)
        for block in self.blocks:
            if hasattr(block.mixer, "init_weights"):
                block.mixer.init_weights()

    # ------------------------------------------------------------------- timm model API
    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {"pos_embed", "cls_token"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r"^cls_token|pos_embed|patch_embed",
            blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """New head with ``num_classes`` outputs (identity for 0); optionally a new pooling."""
        self.num_classes = num_classes
        if global_pool is not None:
            _check_global_pool(global_pool, self.has_class_token)
            self.global_pool = global_pool
            update_model_args(self, global_pool=global_pool)
        device, dtype = self.pos_embed.device, self.pos_embed.dtype
        self.head = nn.Linear(self.embed_dim, num_classes, device=device, dtype=dtype) if num_classes > 0 else nn.Identity()
        self.head.train(self.training)

    def set_input_size(self, img_size: Optional[Tuple[int, int]] = None, patch_size: Optional[Tuple[int, int]] = None) -> None:
        """Change the nominal input size (and patch size), resampling the position embedding."""
        prev_grid_size = self.patch_embed.grid_size
        self.patch_embed.set_input_size(img_size=img_size, patch_size=patch_size)
        if self.patch_embed.grid_size != prev_grid_size:
            self.pos_embed = nn.Parameter(
                resample_abs_pos_embed(
                    self.pos_embed, new_size=self.patch_embed.grid_size, old_size=prev_grid_size, num_prefix_tokens=0
                ),
                requires_grad=self.pos_embed.requires_grad,
            )
        update_model_input_size(self, self.patch_embed.img_size, patch_size=patch_size)

    # ------------------------------------------------------------------------- forward
    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """Patch tokens (``[B, N, C]``, or ``[B, h, w, C]`` with dynamic size) -> ``[B, L, C]``."""
        if self.dynamic_img_size:
            batch, height, width, channels = x.shape
            pos_embed = resample_abs_pos_embed(
                self.pos_embed, new_size=(height, width), old_size=self.patch_embed.grid_size, num_prefix_tokens=0
            )
            x = x.reshape(batch, height * width, channels)
        else:
            pos_embed = self.pos_embed
        x = x + pos_embed
        if self.cls_token is not None:
            x = insert_class_token(x, self.cls_token)
        return self.pos_drop(x)

    def _split_prefix(self, x: torch.Tensor) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """``[B, L, C]`` -> (class token ``[B, 1, C]`` or None, patch tokens ``[B, N, C]``)."""
        if self.cls_token is None:
            return None, x
        return split_class_token(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, in_chans, H, W] -> [B, L, C]`` normalised tokens."""
        x = self._pos_embed(self.patch_embed(x))
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        return self.norm(x)

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None) -> torch.Tensor:
        """``[B, L, C]`` -> ``[B, C]`` ('avg' over patches, 'token': the class token) or unchanged ('')."""
        pool_type = self.global_pool if pool_type is None else pool_type
        if not pool_type:
            return x
        cls, patches = self._split_prefix(x)
        if pool_type == "token":
            return cls[:, 0]
        return patches.mean(dim=1)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.pool(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    # ------------------------------------------------------------------- intermediates
    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Block outputs as features.

        Args:
            x: ``[B, in_chans, H, W]``.
            indices: last n blocks (int), all (None), or block indices (list, negatives from the end).
            return_prefix_tokens: pair each patch feature with the class token ``[B, 1, C]``.
            norm: apply the final norm to each intermediate.
            stop_early: run only the blocks up to the last requested one.
            output_fmt: 'NCHW' (``[B, C, h, w]``) or 'NLC' (``[B, N, C]``, patch tokens only).
            intermediates_only: return only the list of intermediates.
        Returns:
            ``intermediates`` or ``(final normalised tokens [B, L, C], intermediates)``.
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        batch, _, height, width = x.shape
        x = self._pos_embed(self.patch_embed(x))
        blocks = self.blocks[: max_index + 1] if stop_early and not torch.jit.is_scripting() else self.blocks
        intermediates = []
        for i, block in enumerate(blocks):
            x = checkpoint(block, x) if self.grad_checkpointing and not torch.jit.is_scripting() else block(x)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)

        split = [self._split_prefix(y) for y in intermediates]
        intermediates = [patches for _, patches in split]
        if output_fmt == "NCHW":
            grid_h, grid_w = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(batch, grid_h, grid_w, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if return_prefix_tokens and self.cls_token is not None:
            intermediates = list(zip(intermediates, [cls for cls, _ in split]))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(
        self, indices: Union[int, List[int]] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> List[int]:
        """Drop the blocks after the last of ``indices`` (and the norm / head); return the kept indices."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices


def _init_linear(module: nn.Module, name: str = "") -> None:
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: HDLAVisionTransformer) -> Dict[str, torch.Tensor]:
    """Adapt a checkpoint to ``model``: resample the position embedding to the model's grid and
    the patch kernel to its patch size; a classifier whose shape differs from the model's (another
    number of classes) is dropped and the model keeps its own freshly initialised head."""
    state_dict = state_dict.get("model", state_dict)
    state_dict = state_dict.get("state_dict", state_dict)
    model_state = model.state_dict()
    out = {}
    for key, value in state_dict.items():
        if key == "patch_embed.proj.weight" and value.shape[-2:] != model.patch_embed.proj.weight.shape[-2:]:
            value = resample_patch_embed(value, list(model.patch_embed.proj.weight.shape[-2:]), verbose=True)
        elif key == "pos_embed" and value.shape != model.pos_embed.shape:
            old_size = get_pretrained_grid_size(model, state_dict.get("patch_embed.proj.weight"), value.shape[1])
            value = resample_abs_pos_embed(
                value, new_size=model.patch_embed.grid_size, old_size=old_size, num_prefix_tokens=0, verbose=True
            )
        elif key.startswith("head.") and (key not in model_state or model_state[key].shape != value.shape):
            _logger.info(f"checkpoint {key} {tuple(value.shape)} does not fit the model's head; dropped")
            continue
        out[key] = value
    for key, value in model_state.items():
        if key.startswith("head.") and key not in out:
            out[key] = value  # keep the model's own head so the load stays strict for every other key
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
