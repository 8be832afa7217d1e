"""Seed mixers in their bidirectional (vision) use: each timm name (the log-linear ones too) builds, runs
forward and backward on CPU at a tiny size; the bidirectional sum is the forward scan plus the reversed scan minus one own write."""
import pytest
import timm
import torch

import hdla_vision  # noqa: F401  registers the timm models
from hdla_vision.backbones.loglinear import LOG_LINEAR_MODELS
from hdla_vision.backbones.seed import SEED_MODELS
from hdla_vision.layers import GeneralizedMixer, create_mixer, list_mixers
from hdla_vision.kernels import chunk_generalized_bidirectional

BIDIRECTIONAL = ("fwd", "bwd")


TINY_MODELS = dict(SEED_MODELS, **LOG_LINEAR_MODELS)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_timm_name_forward_backward(name):
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, depth=2, num_classes=5)
    mixer_name, options = TINY_MODELS[name]
    assert model.blocks[0].attn.mixer_name == mixer_name
    assert model.blocks[0].attn.directions_used == BIDIRECTIONAL
    assert all(getattr(model.blocks[0].attn, option) == value for option, value in options.items())
    images = torch.randn(2, 3, 32, 32)
    logits = model(images)
    assert logits.shape == (2, 5) and torch.isfinite(logits).all()
    logits.square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    grads = [p.grad for p in model.blocks[0].attn.directions.parameters()]
    assert all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


def test_tiny_size_matches_hdla_tiny():
    model = timm.create_model("gdn_tiny", img_size=32, depth=1)
    assert (model.embed_dim, model.blocks[0].attn.num_heads, model.blocks[0].attn.head_dim) == (192, 3, 64)
    with pytest.raises(ValueError, match="fixes mixer"):
        timm.create_model("gdn_tiny", mixer="hdla")
    with pytest.raises(ValueError, match="fixes mixer_kwargs"):
        timm.create_model("gdp3_tiny", mixer_kwargs={"num_householder": 2})
    model = timm.create_model("gdp3_tiny", img_size=32, depth=1, mixer_kwargs={"beta_range": 1.0})
    assert (model.blocks[0].attn.num_householder, model.blocks[0].attn.beta_range) == (3, 1.0)


def _bidirectional_case(name, **kw):
    torch.manual_seed(1)
    mixer = create_mixer(name, dim=16, num_heads=2, directions=BIDIRECTIONAL, **kw).double()
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    return mixer, x


@pytest.mark.parametrize("name,kw", [("gla", {}), ("kda", {}), ("rwkv7", {}), ("gated_deltaproduct", {}),
                                     ("gated_deltaproduct", {"num_householder": 3}),
                                     ("hih_gated_deltanet", {"groups": 2, "mask": "data"})])
def test_mix_is_forward_plus_backward_minus_own_write(name, kw):
    """Oracle: the forward scan of x plus the forward scan of the flipped sequence with the backward
    gates, flipped back, minus the backward own write (computed here from the op's definition)."""
    mixer, x = _bidirectional_case(name, **kw)
    q, k, v = mixer.projections(x)
    y_fwd, _ = mixer.scan(q, mixer.features(x, q, k, v, mixer.directions[0]), reverse=False)
    flip = lambda t: t.flip(1)  # noqa: E731
    bwd_flipped = mixer.features(flip(x), flip(q), flip(k), flip(v), mixer.directions[1])
    y_bwd_flipped, _ = mixer.scan(flip(q), bwd_flipped, reverse=False)
    own_flipped = mixer.own_write(flip(q), bwd_flipped)
    expected = y_fwd + flip(y_bwd_flipped) - flip(own_flipped)
    torch.testing.assert_close(mixer.mix(x), expected)
    # the token reads itself once: the mixer differs from the plain sum by exactly the own write
    step = mixer.features(x, q, k, v, mixer.directions[1])
    own = mixer.scale * torch.einsum("bnhk,bnhrk,bnhrv->bnhv", q, step.k, step.v)
    torch.testing.assert_close(own, flip(own_flipped))
    assert own.abs().max() > 1e-6


def test_registered_and_argument_errors():
    for name, _ in SEED_MODELS.values():
        assert name in list_mixers()
        assert isinstance(create_mixer(name, dim=16, num_heads=2, directions=BIDIRECTIONAL), GeneralizedMixer)
    with pytest.raises(ValueError, match="unknown arguments"):
        create_mixer("deltanet", dim=16, num_heads=2, directions=BIDIRECTIONAL, decay_rank=4)
    with pytest.raises(ValueError, match="groups"):
        create_mixer("hih_deltanet", dim=16, num_heads=2, directions=BIDIRECTIONAL, groups=3)
    with pytest.raises(ValueError, match="mask"):
        create_mixer("hih_deltanet", dim=16, num_heads=2, directions=BIDIRECTIONAL, mask="dynamic")
    with pytest.raises(ValueError, match="num_householder"):
        create_mixer("gated_deltaproduct", dim=16, num_heads=2, directions=BIDIRECTIONAL, num_householder=0)
    with pytest.raises(ValueError, match=r"x must have shape"):
        create_mixer("gla", dim=16, num_heads=2, directions=BIDIRECTIONAL)(torch.randn(1, 4, 8))


# mixer name -> whether its decay is one scalar per head (g [B, T, H]) rather than per key channel
DECAY_PER_HEAD = {"gla": False, "deltanet": True, "gated_deltanet": True, "kda": False, "rwkv7": False,
                  "gated_deltaproduct": True, "hih_deltanet": True, "hih_gated_deltanet": True}


@pytest.mark.parametrize("name", list(DECAY_PER_HEAD))
def test_scalar_decay_mixers_pass_g_per_head(name, monkeypatch):
    """The mixers whose decay is one scalar per head hand the bidirectional op g [2, B, T, H] (both
    directions; no expanded [.., K] copy); per-channel ones g [2, B, T, H, K]. The calls are recorded
    from the mixer itself: one call for both scan directions."""
    import hdla_vision.layers.seed as seed

    shapes = []

    def recording(q, k, v, a, b, g, **kw):
        shapes.append(tuple(g.shape))
        return chunk_generalized_bidirectional(q, k, v, a, b, g, **kw)

    monkeypatch.setattr(seed, "chunk_generalized_bidirectional", recording)
    mixer, x = _bidirectional_case(name)
    mixer(x).sum().backward()
    expected = (2, 1, 9, 2) if DECAY_PER_HEAD[name] else (2, 1, 9, 2, 8)
    assert shapes == [expected]


@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "hdla"])
def test_projections_keep_the_projection_dtype_when_the_norm_runs_in_fp32(name, monkeypatch):
    """Under CUDA autocast F.normalize runs in fp32 (CPU autocast keeps bf16, so the fp32 norm is
    imitated here): q and k must still leave ``projections`` in the projection's dtype, else the op
    runs in q's dtype, fp32 (measured on an H100: gdn_tiny's B1 75x slower than in bf16)."""
    torch.manual_seed(0)
    mixer = create_mixer(name, dim=32, num_heads=2, directions=BIDIRECTIONAL).to(torch.bfloat16)
    normalize = torch.nn.functional.normalize
    monkeypatch.setattr(torch.nn.functional, "normalize", lambda t, *a, **kw: normalize(t.float(), *a, **kw))
    q, k, v = mixer.projections(torch.randn(2, 5, 32, dtype=torch.bfloat16))
    assert (q.dtype, k.dtype, v.dtype) == (torch.bfloat16,) * 3
