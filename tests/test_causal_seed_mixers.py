"""The seed mixers in the causal LM: build by name, train step, cached greedy decoding, left padding."""
import pytest
import torch

from hdla_vision.layers import create_mixer, list_mixers
from hdla_vision.lm import HDLACache, HDLAConfig, HDLAForCausalLM, cache_of
from tests.test_lm import greedy_by_full_forward

SEED_MIXERS = {  # name -> mixer_kwargs
    "gla": {},
    "deltanet": {},
    "kda": {},
    "rwkv7": {},
    "hih_deltanet": {"groups": 4},
    "hih_gated_deltanet": {"groups": 2, "mask": "data"},
}


def tiny_model(mixer, seed=0, short_conv_size=4):
    torch.manual_seed(seed)
    # a large init std gives a random model whose greedy continuations vary (a stronger test)
    config = HDLAConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16,
                        short_conv_size=short_conv_size, mixer=mixer, mixer_kwargs=SEED_MIXERS[mixer],
                        initializer_range=0.3)
    return HDLAForCausalLM(config).eval()


def test_seed_mixers_are_registered():
    assert set(SEED_MIXERS) <= set(list_mixers())


@pytest.mark.parametrize("mixer", SEED_MIXERS)
def test_forward_backward_reach_every_parameter(mixer):
    model = tiny_model(mixer).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids, use_cache=False)
    assert out.logits.shape == (2, 12, 64) and torch.isfinite(out.loss)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"parameters without a finite gradient: {missing}"
    mixer_grads = [p.grad.abs().sum() for n, p in model.named_parameters() if ".mixer." in n]
    assert all(g > 0 for g in mixer_grads)


@pytest.mark.parametrize("mixer", SEED_MIXERS)
def test_cached_greedy_generate_equals_full_forward_argmax(mixer):
    model = tiny_model(mixer)
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    steps = 8
    out = model.generate(prompt, max_new_tokens=steps, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy_by_full_forward(model, prompt, steps))
    cache = cache_of(out)
    assert isinstance(cache, HDLACache) and cache.get_seq_length() == 7 + steps - 1
    assert cache.layers[0].recurrent_states[0].shape == (2, 2, 16, 16)


@pytest.mark.parametrize("mixer", SEED_MIXERS)
def test_prefill_then_steps_match_full_forward_logits(mixer):
    """One chunked prefill, then decoding steps on the cached state, give the full-forward logits."""
    model = tiny_model(mixer)
    ids = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(2))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :10], use_cache=True)
    cache, logits = cache_of(out), [out.logits]
    for t in range(10, 14):
        logits.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mixer", SEED_MIXERS)
def test_left_padding_leaves_the_unpadded_logits_unchanged(mixer):
    model = tiny_model(mixer)
    gen = torch.Generator().manual_seed(4)
    long_prompt, short_prompt = torch.randint(1, 64, (1, 9), generator=gen), torch.randint(1, 64, (1, 6), generator=gen)
    pad = torch.randint(1, 64, (1, 3), generator=gen)  # arbitrary pad content: the mask alone must hide it
    batch = torch.cat([long_prompt, torch.cat([pad, short_prompt], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    logits = model(batch, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(logits[0], model(long_prompt, use_cache=False).logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[1, 3:], model(short_prompt, use_cache=False).logits[0], rtol=1e-5, atol=1e-5)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out[1, 3:], model.generate(short_prompt, max_new_tokens=5, do_sample=False)[0])


@pytest.mark.parametrize("kwargs, match", [({"groups": 3}, "groups"), ({"mask": "dynamic"}, "mask")])
def test_head_in_head_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_mixer("hih_deltanet", dim=32, num_heads=2, head_dim=16, directions=("fwd",), **kwargs)


@pytest.mark.parametrize("mixer", SEED_MIXERS)
def test_right_padding_keeps_the_state_after_the_last_real_token(mixer):
    """Pad steps are identity steps: no decay, no write, so the cached state is that of the real tokens."""
    model = tiny_model(mixer)
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 64, (1, 9), generator=gen), torch.randint(0, 64, (1, 5), generator=gen)
    batch = torch.cat([a, torch.cat([b, torch.randint(0, 64, (1, 4), generator=gen)], 1)])
    mask = torch.ones_like(batch)
    mask[1, 5:] = 0
    out = model(batch, attention_mask=mask, use_cache=True)
    torch.testing.assert_close(out.logits[1, :5], model(b, use_cache=False).logits[0], rtol=1e-5, atol=1e-5)
    ref = cache_of(model(b, use_cache=True))
    for layer, ref_layer in zip(cache_of(out).layers, ref.layers):
        torch.testing.assert_close(layer.recurrent_states[0][1], ref_layer.recurrent_states[0][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", [*SEED_MIXERS, "gated_deltanet", "gated_deltaproduct"])
def test_generate_decodes_with_the_fused_recurrent_op(mixer, monkeypatch):
    """Every mixer on chunk_generalized decodes with fused_recurrent_generalized, never the float64 reference loop."""
    import hdla_vision.kernels as kernels
    import hdla_vision.kernels.generalized.naive as naive
    import hdla_vision.layers.seed as seed

    def reference_loop_called(*args, **kwargs):
        raise AssertionError("naive_generalized called while decoding")

    for module in (kernels, naive, seed):  # seed: in case it imports the loop by name again
        monkeypatch.setattr(module, "naive_generalized", reference_loop_called, raising=False)
    steps, op = [], seed.fused_recurrent_generalized
    monkeypatch.setattr(seed, "fused_recurrent_generalized", lambda *a, **kw: steps.append(a[0].shape[1]) or op(*a, **kw))
    torch.manual_seed(0)
    config = HDLAConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16,
                        short_conv_size=4, mixer=mixer, mixer_kwargs=SEED_MIXERS.get(mixer, {}), initializer_range=0.3)
    model = HDLAForCausalLM(config).eval()
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    out = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert steps == [1] * (2 * 4)  # 2 layers x 4 decoding steps after the prefill
    monkeypatch.undo()
    assert torch.equal(out, greedy_by_full_forward(model, prompt, 5))
