"""The hdla_* timm models, checked the way timm's tests/test_models.py checks its models.

Small inputs (32-64 px) and reduced depth through create_model kwargs keep this fast on a
CPU; the parameter-count tests build the real configurations without running them.
"""
import math
from pathlib import Path

import pytest
import torch
import timm
from timm.layers import resample_abs_pos_embed
from timm.models import FeatureInfo, group_parameters
from timm.optim import create_optimizer_v2

import hdla_vision  # noqa: F401  registers the models
from hdla_vision.backbones import checkpoint_filter_fn
from hdla_vision.backbones.hdla import class_token_index, insert_class_token, split_class_token

MODELS = ["hdla_tiny", "hdla_small", "hdla_base"]
WIDTHS = {"hdla_tiny": (192, 3), "hdla_small": (384, 6), "hdla_base": (768, 12)}
SMALL = dict(img_size=32, depth=2)  # 2 x 2 patches, 2 blocks
TINY = sorted(name for name in timm.list_models(module=["hdla", "seed", "loglinear"]) if name.endswith("_tiny"))
LINEAR_TINY = [name for name in TINY if not name.startswith("loglinear_")]  # the checkpoint layouts predate the others


def small_model(name, **kwargs):
    torch.manual_seed(0)
    return timm.create_model(name, **dict(SMALL, **kwargs))


def fixed_projection(features: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``features [..., C] -> [...]``: a fixed random direction. Never ``features.sum(-1)``: the
    channel sum of a LayerNorm output (unit weight, zero bias at init) is identically zero, so its
    gradient is rounding noise."""
    weight = torch.randn(features.shape[-1], generator=torch.Generator().manual_seed(seed))
    return features @ weight.to(features.dtype)


def expected_param_count(dim, heads, depth=12, patch=16, in_chans=3, num_classes=1000, tokens=196, rank=16):
    """Parameters of the architecture, counted from its definition."""
    head_dim = dim // heads
    mixer = (
        3 * dim * dim  # shared q, k, v (no bias)
        + 2 * (dim * rank + rank * dim + dim)  # low-rank lambda projection per direction
        + dim * 2 * heads + 2 * heads  # beta per direction
        + dim * dim + dim  # output gate
        + head_dim  # per-head RMSNorm weight
        + dim * dim + dim  # output projection
    )
    mlp = dim * 4 * dim + 4 * dim + 4 * dim * dim + dim
    block = mixer + mlp + 2 * 2 * dim  # two LayerNorms
    stem = in_chans * patch * patch * dim + dim + tokens * dim
    return stem + depth * block + 2 * dim + dim * num_classes + num_classes


# ------------------------------------------------------------------------------ configs
def test_models_registered():
    assert set(MODELS) <= set(timm.list_models("hdla_*"))


@pytest.mark.parametrize("name", MODELS)
def test_param_count(name):
    model = timm.create_model(name)
    count = sum(p.numel() for p in model.parameters())
    assert count == expected_param_count(*WIDTHS[name])
    if name == "hdla_tiny":
        assert count == 6_321_520
        assert 5.5e6 <= count <= 6.6e6  # paper Table 8: 6.1M


@pytest.mark.parametrize("name", MODELS)
def test_pretrained_cfg(name):
    model = timm.create_model(name, img_size=32, depth=1)
    cfg = model.pretrained_cfg
    assert cfg["mean"] == timm.data.IMAGENET_DEFAULT_MEAN and cfg["std"] == timm.data.IMAGENET_DEFAULT_STD
    assert cfg["input_size"] == (3, 224, 224) and cfg["crop_pct"] == 0.9 and cfg["interpolation"] == "bicubic"
    assert cfg["num_classes"] == 1000
    state = model.state_dict()
    assert cfg["first_conv"] + ".weight" in state and cfg["classifier"] + ".weight" in state
    data_cfg = timm.data.resolve_data_config({}, model=model)
    assert data_cfg["crop_pct"] == 0.9 and data_cfg["interpolation"] == "bicubic"


@pytest.mark.parametrize("name", MODELS)
def test_kwargs_override_defaults(name):
    model = timm.create_model(name, img_size=48, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=7)
    assert model.embed_dim == 64 and len(model.blocks) == 2 and model.blocks[0].attn.num_heads == 4
    assert model.patch_embed.grid_size == (6, 6) and model.pos_embed.shape == (1, 36, 64)
    assert model(torch.randn(1, 3, 48, 48)).shape == (1, 7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(global_pool="max"), "global_pool"),
        (dict(global_pool="token"), "class_token=True"),
        (dict(mixer="no_such_mixer"), "unknown mixer"),
        (dict(embed_dim=100, num_heads=3), "multiple of num_heads"),
        (dict(qk_norm=True), "qk_norm"),
        (dict(reg_tokens=2), "reg_tokens"),
        (dict(attn_layer="attn"), "mixer="),
        (dict(mixer_kwargs=dict(window=3)), "unknown arguments for the 'hdla' mixer"),
        (dict(mixer_kwargs=dict(directions=("fwd",))), r"mixer_kwargs may not set \['directions'\]"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        timm.create_model("hdla_tiny", **dict(SMALL, **kwargs))


def test_block_refuses_attention_masks():
    model = small_model("hdla_tiny")
    tokens = torch.randn(1, 4, model.embed_dim)
    with pytest.raises(ValueError, match="attn_mask"):
        model.blocks[0](tokens, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="is_causal"):
        model.blocks[0](tokens, is_causal=True)


@pytest.mark.parametrize("name", TINY)
def test_fx_trace_keeps_the_mixer_a_leaf(name):
    """timm's FX feature extraction traces the blocks and keeps each mixer class a leaf (its kernels
    cannot be traced), and the traced model gives the model's output."""
    from torchvision.models.feature_extraction import create_feature_extractor

    from timm.models import get_notrace_functions, get_notrace_modules

    model = small_model(name).eval()
    tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
    traced = create_feature_extractor(model, return_nodes=["head"], tracer_kwargs=tracer_kwargs)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(traced(x)["head"], model(x))
    assert type(model.blocks[0].attn) in get_notrace_modules()


def test_unknown_argument_raises_type_error():
    """timm's model contract (its test_models.py): an unknown constructor argument is a TypeError."""
    with pytest.raises(TypeError, match="window_size"):
        timm.create_model("hdla_tiny", **SMALL, window_size=7)


@pytest.mark.parametrize("name", TINY)
def test_device_and_dtype_factory_arguments(name):
    """timm's device / dtype factory arguments reach every parameter, each mixer's gates included."""
    model = timm.create_model(name, **SMALL, device="meta", dtype=torch.float64)
    tensors = dict(model.named_parameters(), **dict(model.named_buffers()))
    assert all(t.device.type == "meta" and t.dtype == torch.float64 for t in tensors.values())
    assert model.forward_features(torch.randn(1, 3, 32, 32, device="meta", dtype=torch.float64)).shape == (1, 4, model.embed_dim)


# ----------------------------------------------------------------- forward / backward
@pytest.mark.parametrize("name", MODELS)
def test_forward_backward(name):
    """timm's test_model_backward: every parameter gets a gradient, the head has num_classes outputs."""
    model = small_model(name, num_classes=42).train()
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 42) and not torch.isnan(out).any()
    out.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"


@pytest.mark.parametrize("name", MODELS)
def test_features_head_and_classifier(name):
    """timm's test_model_default_cfgs_non_std: forward_features, forward_head(pre_logits), reset_classifier."""
    model = small_model(name).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_features(x)
    assert feats.shape == (2, 4, model.num_features)
    pre = model.forward_head(feats, pre_logits=True)
    assert pre.shape == (2, model.head_hidden_size)
    torch.testing.assert_close(pre, feats.mean(1))
    assert model.get_classifier() is model.head and model.head.out_features == 1000

    model.reset_classifier(0)
    assert model.num_classes == 0 and isinstance(model.get_classifier(), torch.nn.Identity)
    torch.testing.assert_close(model(x), pre)
    model.reset_classifier(0, "")
    torch.testing.assert_close(model(x), feats)
    model.reset_classifier(5, "avg")
    assert model(x).shape == (2, 5) and model.get_classifier().out_features == 5

    model = timm.create_model(name, **SMALL, num_classes=0, global_pool="").eval()
    assert model(x).shape == (2, 4, model.num_features)


@pytest.mark.parametrize("name", MODELS)
def test_class_token_in_the_middle(name):
    """The model keeps the class token first (timm's layout); each mixer scans it at index N // 2."""
    model = small_model(name, class_token=True, global_pool="token", img_size=48).eval()  # 9 patches
    x = torch.randn(1, 3, 48, 48)
    scanned = []
    model.blocks[0].attn.register_forward_hook(lambda module, args, kwargs, out: scanned.append((args[0], kwargs, out)),
                                               with_kwargs=True)
    feats = model.forward_features(x)
    assert feats.shape == (1, 10, model.num_features)
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats[:, 0])
    torch.testing.assert_close(model.pool(feats, "avg"), feats[:, 1:].mean(1))

    idx = class_token_index(9)
    assert idx == 4
    tokens = model._pos_embed(model.patch_embed(x))  # [cls, 9 patches], the block's input
    mixer_in, mixer_kwargs, mixer_out = scanned[0]
    # the mixer gets the block's input (class token moved) and applies norm1 itself, inside its recomputed stages
    torch.testing.assert_close(mixer_in, torch.cat([tokens[:, 1:5], tokens[:, :1], tokens[:, 5:]], 1))
    assert mixer_kwargs["norm"] is model.blocks[0].norm1
    torch.testing.assert_close(model.blocks[0].mix(tokens), torch.cat([mixer_out[:, 4:5], mixer_out[:, :4], mixer_out[:, 5:]], 1))
    normed = model.blocks[0].norm1(mixer_in)
    torch.testing.assert_close(mixer_out, model.blocks[0].attn(normed))  # = the mixer on the normalised tokens
    with pytest.raises(ValueError, match="class_token"):
        small_model(name).reset_classifier(0, "token")


def test_class_token_insert_split_roundtrip():
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    cls = torch.full((1, 1, 3), -1.0)
    seq = insert_class_token(x, cls)
    assert seq.shape == (2, 6, 3) and (seq[:, 2] == -1).all()
    got_cls, patches = split_class_token(seq)
    torch.testing.assert_close(patches, x)
    assert (got_cls == -1).all()


@pytest.mark.parametrize("name", MODELS)
def test_in_chans(name):
    model = small_model(name, in_chans=1)
    assert model.patch_embed.proj.weight.shape[1] == 1
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 1000)


@pytest.mark.parametrize("name", MODELS)
def test_drop_path_rate(name):
    model = small_model(name, drop_path_rate=0.2)
    rates = [getattr(b.drop_path1, "drop_prob", 0.0) for b in model.blocks]
    assert rates == pytest.approx([0.0, 0.2])
    x = torch.randn(2, 3, 32, 32)
    model.train()
    torch.manual_seed(1)
    a = model(x)
    torch.manual_seed(2)
    assert not torch.allclose(a, model(x)), "drop path inactive in training"
    model.eval()
    torch.testing.assert_close(model(x), model(x))


@pytest.mark.parametrize("name", MODELS)
def test_layer_scale(name):
    model = small_model(name, init_values=1e-5)
    assert torch.allclose(model.blocks[0].ls1.gamma, torch.full_like(model.blocks[0].ls1.gamma, 1e-5))


# ------------------------------------------------------------------- image sizes
@pytest.mark.parametrize("name", MODELS)
def test_dynamic_img_size(name):
    model = small_model(name, dynamic_img_size=True).eval()
    for height, width in [(32, 32), (48, 32), (16, 64)]:
        x = torch.randn(1, 3, height, width)
        assert model.forward_features(x).shape == (1, (height // 16) * (width // 16), model.num_features)
        _, inter = model.forward_intermediates(x, indices=1)
        assert inter[0].shape == (1, model.num_features, height // 16, width // 16)
    # at the nominal size the dynamic model equals the static one
    static = small_model(name).eval()
    static.load_state_dict(model.state_dict())
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(model(x), static(x))


@pytest.mark.parametrize("name", MODELS)
def test_img_size_and_set_input_size(name):
    model = small_model(name, img_size=64).eval()
    assert model.pos_embed.shape[1] == 16
    with pytest.raises(AssertionError):  # a static model refuses other sizes, as timm's PatchEmbed does
        model(torch.randn(1, 3, 32, 32))
    old = model.pos_embed.detach().clone()
    model.set_input_size(img_size=(48, 32))
    assert model.patch_embed.grid_size == (3, 2) and model.pos_embed.shape[1] == 6
    torch.testing.assert_close(model.pos_embed.detach(), resample_abs_pos_embed(old, (3, 2), (4, 4), num_prefix_tokens=0))
    assert model(torch.randn(1, 3, 48, 32)).shape == (1, 1000)


# ------------------------------------------------------------ intermediates / features
@pytest.mark.parametrize("name", MODELS)
def test_forward_intermediates(name):
    """timm's test_model_forward_intermediates plus indices, norm, NLC, intermediates_only, stop_early."""
    model = small_model(name, img_size=(32, 48)).eval()  # 2 x 3 patches
    x = torch.randn(1, 3, 32, 48)
    feature_info = FeatureInfo(model.feature_info, len(model.feature_info))
    final, inter = model.forward_intermediates(x)
    assert len(inter) == len(model.blocks) == len(feature_info.channels())
    for channels, reduction, y in zip(feature_info.channels(), feature_info.reduction(), inter):
        assert y.shape == (1, channels, math.ceil(32 / reduction), math.ceil(48 / reduction))
    torch.testing.assert_close(final, model.forward_features(x))

    nlc = model.forward_intermediates(x, indices=[0, -1], output_fmt="NLC", intermediates_only=True)
    assert len(nlc) == 2 and nlc[0].shape == (1, 6, model.num_features)
    torch.testing.assert_close(nlc[1].transpose(1, 2).reshape(1, -1, 2, 3), inter[-1])
    normed = model.forward_intermediates(x, indices=1, norm=True, output_fmt="NLC", intermediates_only=True)
    torch.testing.assert_close(normed[0], final)
    calls = []
    model.blocks[-1].register_forward_pre_hook(lambda *args: calls.append(1))
    early = model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
    assert not calls, "stop_early ran the last block"
    torch.testing.assert_close(early[0], inter[0])
    with pytest.raises(AssertionError, match="Output format"):  # timm's own check
        model.forward_intermediates(x, output_fmt="NHWC")


@pytest.mark.parametrize("name", MODELS)
def test_forward_intermediates_class_token(name):
    model = small_model(name, img_size=48, class_token=True).eval()
    x = torch.randn(1, 3, 48, 48)
    final, inter = model.forward_intermediates(x, indices=1, output_fmt="NLC")
    assert final.shape == (1, 10, model.num_features) and inter[0].shape == (1, 9, model.num_features)
    pairs = model.forward_intermediates(x, indices=1, output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True)
    patches, cls = pairs[0]
    last = model.blocks(model._pos_embed(model.patch_embed(x)))
    torch.testing.assert_close(cls, last[:, :1])
    torch.testing.assert_close(patches, last[:, 1:])


@pytest.mark.parametrize("name", MODELS)
def test_prune_intermediate_layers(name):
    model = small_model(name).eval()
    x = torch.randn(1, 3, 32, 32)
    full = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    kept = model.prune_intermediate_layers([0, 1], prune_norm=True)
    assert kept == [0, 1] and len(model.blocks) == 2
    assert isinstance(model.norm, torch.nn.Identity) and isinstance(model.head, torch.nn.Identity)
    pruned = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    for a, b in zip(full, pruned):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", MODELS)
def test_features_only(name):
    """timm's test_model_forward_features."""
    model = small_model(name, features_only=True, depth=3).eval()
    assert model.feature_info.channels() == [WIDTHS[name][0]] * 3  # default: the last 3 blocks
    assert model.feature_info.reduction() == [16] * 3
    outs = model(torch.randn(1, 3, 32, 32))
    assert len(outs) == 3
    for channels, y in zip(model.feature_info.channels(), outs):
        assert y.shape == (1, channels, 2, 2) and not torch.isnan(y).any()

    picked = small_model(name, features_only=True, depth=3, out_indices=(0, 1))
    assert len(picked.model.blocks) == 2  # blocks after the last requested one are pruned
    assert [y.shape[1] for y in picked(torch.randn(1, 3, 32, 32))] == [WIDTHS[name][0]] * 2


# --------------------------------------------------------------------- training API
@pytest.mark.parametrize("name", MODELS)
def test_grad_checkpointing(name):
    """Same outputs and gradients; the blocks really run again in the backward pass."""
    model = small_model(name).train()
    x = torch.randn(1, 3, 32, 32)
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda *args: calls.append(1))

    out = model(x)
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert len(calls) == 1
    model.zero_grad()

    model.set_grad_checkpointing(True)
    calls.clear()
    out2 = model(x)
    out2.sum().backward()
    assert len(calls) == 2, "block 0 was not recomputed in backward"
    torch.testing.assert_close(out, out2, rtol=1e-4, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6)
    calls.clear()
    final, _ = model.forward_intermediates(x)
    fixed_projection(final).sum().backward()  # final is LayerNorm output: its plain sum has no gradient
    assert len(calls) == 2
    torch.testing.assert_close(final, model.forward_features(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_group_matcher_and_no_weight_decay(name):
    model = small_model(name)
    groups = group_parameters(model, model.group_matcher())
    depth = len(model.blocks)
    assert len(groups) == depth + 2  # stem, one per block (the final norm joins the last), head
    assert set(groups[0]) == {"pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"}
    for i in range(depth):
        expected = {n for n in dict(model.named_parameters()) if n.startswith(f"blocks.{i}.")}
        if i == depth - 1:
            expected |= {"norm.weight", "norm.bias"}  # timm's MATCH_PREV_GROUP
        assert set(groups[i + 1]) == expected
    assert set(groups[depth + 1]) == {"head.weight", "head.bias"}
    params = dict(model.named_parameters())
    assert "pos_embed" in model.no_weight_decay()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    no_decay = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert id(params["pos_embed"]) in no_decay and id(params["blocks.0.attn.qkv.weight"]) not in no_decay
    layer_decay = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.5)
    scales = sorted({g["lr_scale"] for g in layer_decay.param_groups})
    assert len(scales) == depth + 2


def test_class_token_no_weight_decay():
    model = small_model("hdla_tiny", class_token=True)
    groups = group_parameters(model, model.group_matcher())
    assert "cls_token" in groups[0] and "cls_token" in model.no_weight_decay()


# ------------------------------------------------------------------- bidirectionality
def test_backbone_token_depends_on_both_sides():
    """One patch's output feature has a real gradient w.r.t. the pixels of patches before and after
    it: at least 1e-3 of the gradient w.r.t. its own patch (rounding noise is ~1e-7 of it)."""
    model = small_model("hdla_tiny", img_size=64, depth=1).eval()  # 4 x 4 patches
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    i = 6  # row 1, column 2
    fixed_projection(model.forward_features(x)[0, i]).backward()
    per_patch = x.grad[0].abs().sum(0).view(4, 16, 4, 16).sum((1, 3)).flatten()
    others = torch.cat([per_patch[:i], per_patch[i + 1:]])
    assert (others > 1e-3 * per_patch[i]).all(), per_patch / per_patch[i]


# ------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_load_local_checkpoint(name, fmt, tmp_path):
    """pretrained=True with pretrained_cfg_overlay=dict(file=...): same-size load is exact; a
    larger input resamples the position embedding; a head for other classes is dropped."""
    source = small_model(name, num_classes=10).eval()
    path = tmp_path / f"weights.{fmt}"
    if fmt == "pth":
        torch.save(source.state_dict(), path)
    else:
        import safetensors.torch

        safetensors.torch.save_file(source.state_dict(), str(path))
    overlay = dict(file=str(path), num_classes=10, input_size=(3, 32, 32))

    same = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **SMALL, num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(same(x), source(x))

    larger = timm.create_model(
        name, pretrained=True, pretrained_cfg_overlay=overlay, depth=2, img_size=64, num_classes=10
    )
    expected_pos = resample_abs_pos_embed(source.pos_embed.detach(), (4, 4), (2, 2), num_prefix_tokens=0)
    torch.testing.assert_close(larger.pos_embed.detach(), expected_pos)
    torch.testing.assert_close(larger.head.weight, source.head.weight)

    # the checkpoint's 10-class head does not fit a 5-class model: dropped, the rest loads strictly
    other = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(overlay, num_classes=5), **SMALL, num_classes=5)
    assert other.head.weight.shape == (5, source.embed_dim)
    torch.testing.assert_close(other.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight)
    torch.testing.assert_close(other.pos_embed, source.pos_embed)

    gray = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **SMALL, num_classes=0, in_chans=1)
    torch.testing.assert_close(gray.patch_embed.proj.weight, source.patch_embed.proj.weight.sum(1, keepdim=True))


def test_checkpoint_filter_fn():
    source = small_model("hdla_tiny", num_classes=10, img_size=32)
    target = small_model("hdla_tiny", num_classes=3, img_size=64, patch_size=8)
    out = checkpoint_filter_fn({"model": source.state_dict()}, target)
    assert out["pos_embed"].shape == target.pos_embed.shape  # 2x2 -> 8x8
    assert out["patch_embed.proj.weight"].shape == target.patch_embed.proj.weight.shape  # 16 -> 8 kernel
    assert out["head.weight"] is target.state_dict()["head.weight"] or torch.equal(
        out["head.weight"], target.state_dict()["head.weight"]
    )
    target.load_state_dict(out, strict=True)
    headless = small_model("hdla_tiny", num_classes=0)
    out = checkpoint_filter_fn(source.state_dict(), headless)
    assert not any(k.startswith("head.") for k in out)
    headless.load_state_dict(out, strict=True)


@pytest.mark.parametrize("linear,loglinear", [("hdla_tiny", "loglinear_hdla_tiny"), ("gdn_tiny", "loglinear_gdn_tiny")])
def test_linear_checkpoint_loads_into_its_loglinear_model(linear, loglinear, tmp_path):
    """A linear model's checkpoint in its log-linear model: a non-strict load misses exactly the lambda
    heads ``blocks.{i}.attn.directions.{0,1}.levels.{proj.weight,level_gain}`` (nothing unexpected);
    ``pretrained=True`` with the file (checkpoint_filter_fn) loads strictly, keeping the model's own
    lambda heads. With ``W_lambda = 0`` every weight is softplus(0) = ln 2, and the mixers' output
    RMS norm divides that constant out: the log-linear model gives the linear model's logits (with
    the norms' eps 0 in both models: eps is not scale-free where a head's output is small)."""
    source = small_model(linear, num_classes=10).eval()
    target = small_model(loglinear, num_classes=10).eval()
    missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
    heads = {f"blocks.{i}.attn.directions.{d}.levels.{name}" for i in range(2) for d in range(2)
             for name in ("proj.weight", "level_gain")}
    assert set(missing) == heads and not unexpected
    path = tmp_path / "linear.pth"
    torch.save(source.state_dict(), path)
    overlay = dict(file=str(path), num_classes=10, input_size=(3, 32, 32))
    converted = timm.create_model(loglinear, pretrained=True, pretrained_cfg_overlay=overlay, **SMALL,
                                  num_classes=10).eval()
    torch.testing.assert_close(converted.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight)
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in converted.named_parameters() if n.endswith("level_gain"))
    with torch.no_grad():
        for block in converted.blocks:
            for gates in block.attn.directions:
                gates["levels"].proj.weight.zero_()
        for block in (*converted.blocks, *source.blocks):
            block.attn.norm_eps = 0.0
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(converted(x), source(x), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------- CPU vs CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_and_cuda_paths_agree():
    """The same weights give the same logits and gradients on the CPU (PyTorch chunk path) and on
    CUDA (Triton kernels): fp32 closely, bf16 autocast within bf16 tolerance."""
    cpu_model = small_model("hdla_tiny", img_size=64, num_classes=10, class_token=True).train()
    cuda_model = small_model("hdla_tiny", img_size=64, num_classes=10, class_token=True).train().cuda()
    cuda_model.load_state_dict(cpu_model.state_dict())
    x = torch.randn(2, 3, 64, 64)

    out_cpu = cpu_model(x)
    out_cpu.square().mean().backward()
    out_cuda = cuda_model(x.cuda())
    out_cuda.square().mean().backward()
    torch.testing.assert_close(out_cuda.cpu(), out_cpu, rtol=1e-3, atol=1e-3)
    for (name, p_cpu), p_cuda in zip(cpu_model.named_parameters(), cuda_model.parameters()):
        # the kernels' tensor-core products run in TF32: compare each gradient as a whole
        err = (p_cuda.grad.cpu() - p_cpu.grad).norm() / p_cpu.grad.norm()
        assert err < 1e-2, f"{name}: gradient relative error {err:.3g}"

    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_bf16 = cuda_model(x.cuda()).float()
    err = (out_bf16.cpu() - out_cpu).norm() / out_cpu.norm()
    assert err < 3e-2, f"bf16 relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["loglinear_hdla_tiny", "loglinear_gdn_tiny"])
def test_loglinear_model_on_cuda_matches_cpu(name, monkeypatch):
    """A log-linear model's training step on CUDA, where its scan takes the chunk form compiled by inductor (the
    default there), gives the CPU's (eager chunk form) logits and gradients."""
    from hdla_vision.kernels.loglinear import chunk as loglinear_chunk

    monkeypatch.delenv(loglinear_chunk.COMPILE_ENV, raising=False)
    cpu_model = small_model(name, img_size=64, num_classes=10).train()
    cuda_model = small_model(name, img_size=64, num_classes=10).train().cuda()
    cuda_model.load_state_dict(cpu_model.state_dict())
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    out_cpu = cpu_model(x)
    fixed_projection(out_cpu).square().mean().backward()
    out_cuda = cuda_model(x.cuda())
    fixed_projection(out_cuda.cpu()).square().mean().backward()
    assert (out_cuda.cpu() - out_cpu).norm() / out_cpu.norm() < 1e-3
    for (param, p_cpu), p_cuda in zip(cpu_model.named_parameters(), cuda_model.parameters()):
        err = (p_cuda.grad.cpu() - p_cpu.grad).norm() / p_cpu.grad.norm()  # TF32 products: each gradient as a whole
        assert err < 1e-2, f"{param}: gradient relative error {err:.3g}"


# ------------------------------------------------------- checkpoints of the first layout
V0_CHECKPOINTS = Path(__file__).parent / "data" / "backbone_layout_v0.pt"


@pytest.mark.parametrize("name", ["hdla_tiny", "gdn_tiny", "rwkv7_tiny"])
def test_first_layout_checkpoint_loads_with_the_same_logits(name, tmp_path):
    """tests/data/backbone_layout_v0.pt holds state dicts and logits written by the backbone before it
    became a timm VisionTransformer (commit 6dbd3f2: its own block class, mixers named
    ``blocks.{i}.mixer``, the class token kept in the middle of the sequence): small models (width 16,
    2 blocks, 3 x 3 patches of 8 px) with a class token and token pooling (hdla), layer scale (gdn),
    a class token with average pooling (rwkv7), every weight moved off its init. Loaded through
    ``checkpoint_filter_fn`` (``pretrained=True`` with a local file), they give the same logits."""
    case = torch.load(V0_CHECKPOINTS, weights_only=True)[name]
    assert any(".mixer." in key for key in case["state_dict"])
    path = tmp_path / "v0.pth"
    torch.save(case["state_dict"], path)
    overlay = dict(file=str(path), num_classes=5, input_size=(3, 24, 24))
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **case["kwargs"]).eval()
    x = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x), case["logits"])
    assert sum(v.numel() for v in model.state_dict().values()) == sum(v.numel() for v in case["state_dict"].values())


# ------------------------------------------------------ checkpoints of the second layout
V1_CHECKPOINTS = Path(__file__).parent / "data" / "backbone_layout_v1.safetensors"


def _v1_cases():
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(V1_CHECKPOINTS), "pt") as handle:
        kwargs = json.loads(handle.metadata()["kwargs"])
    return kwargs, load_file(str(V1_CHECKPOINTS))


@pytest.mark.parametrize("name", LINEAR_TINY)
def test_second_layout_checkpoint_loads_with_the_same_logits(name, tmp_path):
    """tests/data/backbone_layout_v1.safetensors holds, for every tiny name, a state dict (bf16 values)
    and its logits on one input, written by the backbone before one mixer class served the vision and
    the LM uses (main at 2b0b9bd: HDLA's gates were ``attn.decay_{fwd,bwd}`` and one ``attn.beta`` for
    both directions; the seed mixers already kept theirs in ``attn.directions``). Small models (width
    16, 2 blocks, 3 x 3 patches of 4 px, MLP ratio 1) with class tokens, token and average pooling,
    layer scale and non-default mixer options, every weight moved off its init. Loaded through
    ``checkpoint_filter_fn`` (``pretrained=True`` with a local file) they have the same number of
    parameters and the same logits to float32 rounding (the stored logits come from another CPU, whose
    matrix-product kernels round differently: 3e-7 apart on an AMD EPYC); for the seed mixers, whose keys
    were only renamed, every loaded value is bit-identical to a stored one (HDLA's two-direction beta
    projection became one per direction)."""
    kwargs, tensors = _v1_cases()
    prefix = f"{name}/state_dict/"
    state_dict = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
    if name == "hdla_tiny":
        assert "blocks.1.attn.decay_bwd.up.bias" in state_dict and "blocks.1.attn.beta.weight" in state_dict
    path = tmp_path / "v1.pth"
    torch.save(state_dict, path)
    overlay = dict(file=str(path), num_classes=5, input_size=(3, 12, 12))
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs[name]).eval()
    assert sum(p.numel() for p in model.parameters()) == sum(v.numel() for v in state_dict.values())
    with torch.no_grad():
        logits = model(tensors["input"])
    torch.testing.assert_close(logits, tensors[f"{name}/logits"], rtol=1e-6, atol=1e-6)
    if name != "hdla_tiny":
        values = lambda sd: sorted((tuple(v.shape), v.float().numpy().tobytes()) for v in sd.values())  # noqa: E731
        assert values(model.state_dict()) == values(state_dict)
