"""One class per mixer serves the vision backbone (``directions=("fwd", "bwd")``) and the causal LM
(``directions=("fwd",)``): for every registered mixer the two models build the same gate modules from
the same arguments, the causal mixer decodes token by token exactly as its chunked forward, and the
bidirectional mixer is the causal forward scan plus the causal scan of the reversed sequence (with the
backward gates) minus the backward own write. The log-linear mixers (``loglinear_<name>``) are covered
by the same checks; their bidirectional sum is checked against the float64 log-linear loops, the
backward scan on the forward scan's absolute bucket grid with its level-0 weight 0."""
import math

import pytest
import timm
import torch

import hdla_vision  # noqa: F401  registers the timm models
from hdla_vision.kernels import naive_loglinear_generalized, naive_loglinear_hdla
from hdla_vision.layers import HDLAMixer, RECURRENT_MAX_TOKENS, create_mixer, list_mixers

from hdla_vision.lm import HDLAConfig, HDLAForCausalLM

# options that differ from each mixer's defaults, so that the check covers them
LINEAR_OPTIONS = {"hdla": {"decay_rank": 4}, "hdla_authors": {"decay_rank": 4, "gate_rank": 2}, "gla": {"decay_rank": 4},
                  "kda": {"min_memory": 3.0, "max_memory": 64.0}, "rwkv7": {"decay_rank": 4},
                  "gated_deltaproduct": {"num_householder": 3}, "gated_deltanet": {"beta_range": 2.0},
                  "hih_deltanet": {"groups": 2}, "hih_gated_deltanet": {"groups": 2, "mask": "data"},
                  "deltanet": {}}
# the log-linear mixers with 4 levels: the 12-token sequences below reach level 4, so the top level is shared
OPTIONS = dict(LINEAR_OPTIONS, **{f"loglinear_{name}": dict(options, num_levels=4)
                                  for name, options in LINEAR_OPTIONS.items()})
LOG_LINEAR = sorted(name for name in OPTIONS if name.startswith("loglinear_"))
DIM, HEADS = 32, 2


def test_every_mixer_has_a_case():
    assert set(OPTIONS) == set(list_mixers())


def layout(module: torch.nn.Module):
    """Module types by name, and parameter shapes by name."""
    return ([(name, type(m).__name__) for name, m in module.named_modules()],
            [(name, tuple(p.shape)) for name, p in module.named_parameters()])


def vision_and_causal_mixers(name):
    options = OPTIONS.get(name, {})
    vision = timm.create_model("hdla_tiny", img_size=32, depth=1, embed_dim=DIM, num_heads=HEADS, mixer=name,
                               mixer_kwargs=options).blocks[0].attn
    config = HDLAConfig(vocab_size=16, hidden_size=DIM, num_hidden_layers=1, num_heads=HEADS, head_dim=DIM // HEADS,
                        mixer=name, mixer_kwargs=options, intermediate_size=32)
    causal = HDLAForCausalLM(config).model.layers[0].mixer
    return vision, causal


@pytest.mark.parametrize("name", list_mixers())
def test_vision_and_causal_models_build_the_same_gate_modules(name):
    vision, causal = vision_and_causal_mixers(name)
    assert type(vision) is type(causal)
    assert (len(vision.directions), len(causal.directions)) == (2, 1)
    assert layout(vision.directions[0]) == layout(vision.directions[1]) == layout(causal.directions[0])
    assert len(layout(causal.directions[0])[1]) > 0
    # outside the gates the two uses differ only in what each model sets: the backbone's output gate
    # and projection have biases (timm's blocks), the LM's not
    vision_params, causal_params = dict(layout(vision)[1]), dict(layout(causal)[1])
    assert {n: s for n, s in vision_params.items() if not n.startswith("directions.1.")
            and n not in ("gate.bias", "proj.bias")} == causal_params
    assert {n for n in vision_params if n in ("gate.bias", "proj.bias")} == (
        {"proj.bias"} if name in ("hdla_authors", "loglinear_hdla_authors") else {"gate.bias", "proj.bias"})


class ListCache:
    """A recurrent state and a conv window kept in the test (the methods of ``layers.mixer.MixerCache``)."""

    def __init__(self):
        self.state, self.window, self.tokens = None, None, 0

    def position(self):
        return self.tokens

    def recurrent_state(self):
        return self.state

    def set_recurrent_state(self, state):
        self.state = state

    def conv_input(self, seq, width):
        previous = seq.new_zeros(*seq.shape[:2], width) if self.window is None else self.window
        full = torch.cat([previous, seq], dim=-1)
        self.window = full[..., -width:]
        return full


def spread_gates(mixer, seed=0):
    """Random gate weights of a visible size, so that every gate matters in the comparisons."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if name.startswith("directions."):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return mixer


@pytest.mark.parametrize("name", list_mixers())
def test_causal_decoding_equals_the_chunked_forward(name):
    """Prefill of 6 tokens (chunk op on a fresh state), then 1-token steps and one of
    RECURRENT_MAX_TOKENS tokens (decoding op on the cached state): the full chunked forward's outputs."""
    torch.manual_seed(0)
    mixer = spread_gates(create_mixer(name, dim=DIM, num_heads=HEADS, directions=("fwd",), short_conv_size=3,
                                      **OPTIONS.get(name, {})))
    x = torch.randn(2, 6 + 2 + RECURRENT_MAX_TOKENS, DIM)
    with torch.no_grad():
        full = mixer(x)
        cache, pieces = ListCache(), []
        for start, stop in ((0, 6), (6, 7), (7, 8), (8, x.shape[1])):
            pieces.append(mixer(x[:, start:stop], cache=cache))
            cache.tokens = stop  # the owner of the cache advances it once the layer ran
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)
    levels = (OPTIONS[name]["num_levels"],) if name in LOG_LINEAR else ()
    assert cache.state.dtype == torch.float32 and cache.state.shape == (2, HEADS, *levels, DIM // HEADS, DIM // HEADS)


@pytest.mark.parametrize("name", sorted(LINEAR_OPTIONS))
def test_bidirectional_is_the_causal_scans_of_both_orders_minus_the_own_write(name):
    """The vision mixer's scan sum equals the causal mixer (its gates = the forward ones) on x plus the
    causal mixer (its gates = the backward ones) on the reversed x, reversed back, minus the token's
    own write through the backward gates, for the same weights, in float64."""
    torch.manual_seed(1)
    options = OPTIONS.get(name, {})
    both = spread_gates(create_mixer(name, dim=16, num_heads=2, directions=("fwd", "bwd"), **options)).double()
    forward, backward = (create_mixer(name, dim=16, num_heads=2, directions=("fwd",), **options).double()
                         for _ in range(2))
    shared = {k: v for k, v in both.state_dict().items() if not k.startswith("directions.")}
    for causal, direction in ((forward, 0), (backward, 1)):
        gates = {k.replace(f"directions.{direction}.", "directions.0.", 1): v for k, v in both.state_dict().items()
                 if k.startswith(f"directions.{direction}.")}
        causal.load_state_dict({**shared, **gates}, strict=True)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    flip = lambda t: t.flip(1)  # noqa: E731
    with torch.no_grad():
        q, k, v = both.projections(x)
        own = both.own_write(q, both.features(x, q, k, v, both.directions[1]))
        expected = forward.causal_mix(x, None, None) + flip(backward.causal_mix(flip(x), None, None)) - own
        torch.testing.assert_close(both.mix(x), expected, rtol=1e-9, atol=1e-10)
        assert own.abs().max() > 1e-6


def loglinear_loop(mixer, q, feats, level_scales, offset=0):
    """The float64 log-linear loop of ``mixer``'s family on its recurrence inputs."""
    if isinstance(mixer, HDLAMixer):
        return naive_loglinear_hdla(q, *feats, level_scales, offset=offset)[0]
    k, v, a, b = mixer.kernel_inputs(q, feats)
    return naive_loglinear_generalized(q, k, v, a, b, feats.g, level_scales, mixer.scale, offset=offset)[0]


def front_padded(t, count):
    """``t [B, N, ...]`` after ``count`` all-zero tokens (identity steps: no write, no decay, no read)."""
    return torch.cat([t.new_zeros(t.shape[0], count, *t.shape[2:]), t], dim=1)


# one mixer per kind of recurrence input: HDLA's (k, v, beta, g); the generalized op's at rank r_ab = 3
# with a decay per head, and at rank 0 with a decay per key channel (the float64 loops are slow)
LOOP_CASES = ["loglinear_hdla", "loglinear_gated_deltaproduct", "loglinear_gla"]


@pytest.mark.parametrize("name", LOOP_CASES)
def test_loglinear_bidirectional_is_both_scans_on_one_grid(name):
    """The log-linear vision mixer's scan sum is the float64 log-linear loop forward, plus the loop on
    the reversed sequence placed at the end of the power-of-two span P = 16 >= N = 11 (behind
    P - N identity tokens), so that reversed position P-1-t complements t and every pair keeps its
    forward level bit_length(t XOR s); the backward level-0 weight is 0 (own write once). The
    other log-linear mixers share this code (``loglinear_mix``, and ``loglinear_scan`` of
    HDLAMixer or GeneralizedMixer): test_constant_lambda_is_c_times_the_linear_mixer runs each."""
    torch.manual_seed(2)
    mixer = spread_gates(create_mixer(name, dim=16, num_heads=2, directions=("fwd", "bwd"), **OPTIONS[name])).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    pad = 16 - 11
    with torch.no_grad():
        q, k, v = mixer.projections(x)
        fwd, bwd = (mixer.features(x, q, k, v, gates) for gates in mixer.directions)
        scales_fwd, scales_bwd = (gates["levels"](x) for gates in mixer.directions)
        scales_bwd[..., 0] = 0
        expected_fwd = loglinear_loop(mixer, q, fwd, scales_fwd)
        reversed_bwd = type(bwd)(*(front_padded(t.flip(1), pad) for t in bwd))
        expected_bwd = loglinear_loop(mixer, front_padded(q.flip(1), pad), reversed_bwd,
                                      front_padded(scales_bwd.flip(1), pad))[:, pad:].flip(1)
        torch.testing.assert_close(mixer.mix(x), expected_fwd + expected_bwd, rtol=1e-9, atol=1e-10)
        assert scales_fwd[..., 0].abs().min() > 1e-3 and expected_bwd.abs().max() > 1e-3


def constant_level_scales(mixer, c):
    """Set every lambda head so that lambda = c on inputs whose channel 0 is 1: W_lambda reads
    channel 0 alone, and L = softplus^-1(c)."""
    with torch.no_grad():
        for gates in mixer.directions:
            head = gates["levels"]
            head.proj.weight.zero_()
            head.proj.weight[:, 0] = 1.0
            head.level_gain.fill_(math.log(math.expm1(c)))


@pytest.mark.parametrize("name", LOG_LINEAR)
def test_constant_lambda_is_c_times_the_linear_mixer(name):
    """lambda = c on every level: the log-linear scan output (before the output norm, which would
    divide c out) is c times the linear mixer's with the same weights, in both uses (the vision
    mixer's backward level 0 is 0, and the linear one subtracts its own write)."""
    torch.manual_seed(3)
    c = 0.37
    linear_name = name.removeprefix("loglinear_")
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    x[..., 0] = 1.0
    for directions in (("fwd",), ("fwd", "bwd")):
        loglinear = spread_gates(create_mixer(name, dim=16, num_heads=2, directions=directions, **OPTIONS[name]))
        linear = create_mixer(linear_name, dim=16, num_heads=2, directions=directions, **LINEAR_OPTIONS[linear_name])
        missing, unexpected = linear.load_state_dict(loglinear.state_dict(), strict=False)
        assert not missing and unexpected and all(".levels." in key for key in unexpected)
        loglinear, linear = loglinear.double(), linear.double()
        constant_level_scales(loglinear, c)  # in float64: lambda = c exactly
        with torch.no_grad():
            if len(directions) == 2:
                got, expected = loglinear.mix(x), linear.mix(x)
            else:
                got, expected = loglinear.causal_mix(x, None, None), linear.causal_mix(x, None, None)
        torch.testing.assert_close(got, c * expected, rtol=1e-9, atol=1e-10)
