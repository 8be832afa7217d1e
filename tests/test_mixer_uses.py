"""One class per mixer serves the vision backbone (``directions=("fwd", "bwd")``) and the causal LM
(``directions=("fwd",)``): for every registered mixer the two models build the same gate modules from
the same arguments, the causal mixer decodes token by token exactly as its chunked forward, and the
bidirectional mixer is the causal forward scan plus the causal scan of the reversed sequence (with the
backward gates) minus the backward own write."""
import pytest
import timm
import torch

import hdla_vision  # noqa: F401  registers the timm models
from hdla_vision.layers import RECURRENT_MAX_TOKENS, create_mixer, list_mixers
from hdla_vision.lm import HDLAConfig, HDLAForCausalLM

# options that differ from each mixer's defaults, so that the check covers them
OPTIONS = {"hdla": {"decay_rank": 4}, "hdla_authors": {"decay_rank": 4, "gate_rank": 2}, "gla": {"decay_rank": 4},
           "kda": {"min_memory": 3.0, "max_memory": 64.0}, "rwkv7": {"decay_rank": 4},
           "gated_deltaproduct": {"num_householder": 3}, "gated_deltanet": {"beta_range": 2.0},
           "hih_deltanet": {"groups": 2}, "hih_gated_deltanet": {"groups": 2, "mask": "data"}}
DIM, HEADS = 32, 2


def test_every_mixer_has_a_case():
    assert set(OPTIONS) | {"deltanet"} == set(list_mixers())


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
        {"proj.bias"} if name == "hdla_authors" else {"gate.bias", "proj.bias"})


class ListCache:
    """A recurrent state and a conv window kept in the test (the methods of ``layers.mixer.MixerCache``)."""

    def __init__(self):
        self.state, self.window = None, None

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
        cache = ListCache()
        pieces = [mixer(x[:, :6], cache=cache), mixer(x[:, 6:7], cache=cache), mixer(x[:, 7:8], cache=cache),
                  mixer(x[:, 8:], cache=cache)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)
    assert cache.state.dtype == torch.float32 and cache.state.shape == (2, HEADS, DIM // HEADS, DIM // HEADS)


@pytest.mark.parametrize("name", list_mixers())
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
