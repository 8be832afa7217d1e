"""The HDLA causal LM: config round trip, save/load, cached greedy decoding, padding and packing."""
import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, DynamicCache

from hdla_vision.layers import HDLAMixer, create_mixer, list_mixers
from hdla_vision.layers.gates import BetaGate, LevelScales, RWKV7Gates, VectorLogDecay
from hdla_vision.lm import CACHE_NAME, HDLACache, HDLAConfig, HDLAForCausalLM, HDLAModel, cache_of

MIXERS = ["hdla", "gated_deltanet", "gated_deltaproduct"]


def tiny_config(mixer="hdla", short_conv_size=0, **kw):
    # a large init std gives a random model whose greedy continuations vary (a stronger test)
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16,
                short_conv_size=short_conv_size, mixer=mixer, initializer_range=0.3)
    base.update(kw)
    return HDLAConfig(**base)


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    return HDLAForCausalLM(tiny_config(**kw)).eval()


def greedy_by_full_forward(model, input_ids, steps):
    seq = input_ids
    for _ in range(steps):
        nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def test_mixers_are_registered_and_built_causal():
    assert set(MIXERS) <= set(list_mixers())
    model = tiny_model(mixer="hdla")
    mixer = model.model.layers[1].mixer
    assert isinstance(mixer, HDLAMixer) and mixer.directions_used == ("fwd",) and len(mixer.directions) == 1
    assert mixer.qkv.bias is None and mixer.proj.bias is None and mixer.gate.bias is None
    assert (mixer.dim, mixer.head_dim, mixer.norm_eps) == (32, 16, model.config.rms_norm_eps)
    assert type(mixer) is type(create_mixer("hdla", **model.config.mixer_arguments()))


def test_config_round_trip_and_auto_classes(tmp_path):
    config = tiny_config(mixer="gated_deltaproduct", mixer_kwargs={"num_householder": 3}, short_conv_size=4)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, HDLAConfig) and loaded.model_type == "hdla"
    assert loaded.to_diff_dict() == config.to_diff_dict()
    assert loaded.mixer == "gated_deltaproduct" and loaded.short_conv_size == 4 and loaded.head_dim_v == 16
    assert loaded.mixer_kwargs == {"num_householder": 3}
    assert loaded.layer_types == ["linear_attention"] * 2
    assert isinstance(AutoModel.from_config(loaded), HDLAModel)
    model = AutoModelForCausalLM.from_config(loaded)
    assert isinstance(model, HDLAForCausalLM)
    assert model.model.layers[0].mixer.num_householder == 3


@pytest.mark.parametrize("kwargs", [dict(num_heads=0), dict(gate_act="relu"), dict(short_conv_size=1),
                                    dict(hidden_size=32.0), dict(mixer_kwargs={"directions": ("fwd", "bwd")})])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        tiny_config(**kwargs)


def test_unknown_mixer_name_raises():
    with pytest.raises(ValueError, match="unknown mixer"):
        HDLAForCausalLM(tiny_config(mixer="no_such_mixer"))


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_from_pretrained_safetensors(tmp_path, tie):
    model = tiny_model(tie_word_embeddings=tie, short_conv_size=3)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, HDLAForCausalLM)
    for (name, p), (_, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(p, p2, rtol=0, atol=0, msg=name)
    x = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(model(x).logits, loaded(x).logits, rtol=0, atol=0)


DETERMINISTIC_GATES = (VectorLogDecay, BetaGate, RWKV7Gates, LevelScales)


@pytest.mark.parametrize("mixer", ["hdla", "hdla_authors", "gla", "kda", "rwkv7", "loglinear_hdla"])
def test_gates_start_at_their_initial_values(mixer):
    """A fresh LM's gates hold GateModule.initial_values, as the mixer built alone does; transformers' init once
    skipped the gate modules without parameters of their own, so HDLA, GLA and KDA started with every decay
    bias at 0 (lambda = 1/2) instead of the multi-timescale start (issue 13)."""
    model = tiny_model(mixer=mixer, initializer_range=0.02)
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, DETERMINISTIC_GATES):
            for key, value in module.initial_values().items():
                torch.testing.assert_close(module.get_parameter(key).detach(), value, rtol=0, atol=0,
                                           msg=f"{name}.{key}")
                checked += 1
    assert checked > 0
    if mixer in ("hdla", "gla", "kda"):
        bias = model.model.layers[0].mixer.directions[0]["decay"].logits.up.bias
        assert bool((bias != 0).float().mean() > 0.9)  # not lambda = 1/2 everywhere (0 only at the 2-token channels)


def test_data_dependent_head_in_head_mask_gets_its_random_start():
    model = tiny_model(mixer="hih_gated_deltanet", mixer_kwargs={"mask": "data"}, initializer_range=0.02)
    assert model.model.layers[0].mixer.directions[0]["mask"].proj.bias.abs().sum() > 0


def test_loaded_gate_values_are_not_reinitialised(tmp_path):
    model = tiny_model(mixer="hdla")
    bias = model.model.layers[0].mixer.directions[0]["decay"].logits.up.bias
    with torch.no_grad():
        bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded.model.layers[0].mixer.directions[0]["decay"].logits.up.bias, bias,
                               rtol=0, atol=0)


FRESH_PROCESS_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

path = Path(sys.argv[1])
try:
    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)
    raise SystemExit("loaded without the remote-code entry point")
except ValueError as err:
    assert "trust_remote_code=True" in str(err), err
model = AutoModelForCausalLM.from_pretrained(path).eval()  # stdin answers transformers' remote-code prompt: y
assert type(model).__module__ == "hdla_vision.lm.modeling_hdla", type(model)
again = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
expected = load_file(str(path.parent / "expected.safetensors"))
for loaded in (model, again):
    assert torch.equal(loaded(expected["input_ids"]).logits, expected["logits"])
model.save_pretrained(path.parent / "resaved")
print("RESAVED", json.dumps(sorted(p.name for p in (path.parent / "resaved").iterdir())))
"""


def test_saved_model_reloads_in_a_fresh_process_without_importing_hdla_vision(tmp_path):
    """Only transformers is imported; the saved auto_map finds the classes in the installed package."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import save_file

    from hdla_vision.lm.configuration_hdla import AUTO_MAP

    model = tiny_model(short_conv_size=3)
    model.save_pretrained(tmp_path / "saved")
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        save_file({"input_ids": x, "logits": model(x).logits}, str(tmp_path / "expected.safetensors"))
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["auto_map"] == AUTO_MAP
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS_SCRIPT, str(tmp_path / "saved")], input="y\n",
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    resaved = json.loads(result.stdout.split("RESAVED ")[-1])  # the remote-code prompt shares stdout
    assert resaved == ["config.json", "generation_config.json", "hdla_vision_auto.py", "model.safetensors"]
    assert json.loads((tmp_path / "resaved" / "config.json").read_text())["auto_map"] == AUTO_MAP


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("short_conv_size", [0, 4])
def test_cached_greedy_generate_equals_full_forward_argmax(mixer, short_conv_size):
    model = tiny_model(mixer=mixer, short_conv_size=short_conv_size)
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    steps = 10
    out = model.generate(prompt, max_new_tokens=steps, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy_by_full_forward(model, prompt, steps))
    cache = cache_of(out)
    assert isinstance(cache, HDLACache) and cache.get_seq_length() == 7 + steps - 1
    # constant memory: one [B, H, K, V] fp32 state per layer, whatever the number of tokens
    assert cache.layers[0].recurrent_states[0].shape == (2, 2, 16, 16)
    assert cache.layers[0].recurrent_states[0].dtype == torch.float32


def test_beam_search_reorders_the_states():
    """Beam scores (sum of log-probs / length) equal those of a full forward on the returned sequences."""
    model = tiny_model(short_conv_size=4)
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(8))
    out = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, return_dict_in_generate=True,
                         output_scores=True)
    logprobs = torch.log_softmax(model(out.sequences, use_cache=False).logits.float(), -1)
    new = out.sequences[:, 7:]
    score = logprobs[:, 6:-1].gather(-1, new[..., None]).squeeze(-1).sum(-1) / new.shape[1]
    torch.testing.assert_close(out.sequences_scores, score, rtol=1e-4, atol=1e-4)


def test_prefill_then_steps_match_full_forward_logits():
    """Cache continuation: one prefill forward then token-by-token decoding gives the full-forward logits."""
    model = tiny_model(short_conv_size=4)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(2))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :16], use_cache=True)
    cache, logits = cache_of(out), [out.logits]
    for t in range(16, 21):
        step = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        logits.append(step.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-4, atol=1e-4)


def test_user_cache_continues_generation():
    model = tiny_model()
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    cache = HDLACache(config=model.config)
    first = model.generate(prompt, max_new_tokens=3, do_sample=False, **{CACHE_NAME: cache})
    more = model.generate(first, max_new_tokens=3, do_sample=False, **{CACHE_NAME: cache})
    assert torch.equal(more, greedy_by_full_forward(model, prompt, 6))


@pytest.mark.parametrize("mixer", MIXERS)
def test_left_padding_generates_like_the_unpadded_prompt(mixer):
    model = tiny_model(mixer=mixer, short_conv_size=4)
    gen = torch.Generator().manual_seed(4)
    long_prompt, short_prompt = torch.randint(1, 64, (1, 8), generator=gen), torch.randint(1, 64, (1, 5), generator=gen)
    batch = torch.cat([long_prompt, torch.cat([torch.zeros(1, 3, dtype=torch.long), short_prompt], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    alone_long = model.generate(long_prompt, max_new_tokens=6, do_sample=False)
    alone_short = model.generate(short_prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(out[0], alone_long[0])
    assert torch.equal(out[1, 3:], alone_short[0])


@pytest.mark.parametrize("mixer", MIXERS)
def test_padding_never_leaks_between_sequences(mixer):
    """Right padding: real-token logits equal the unpadded run; changing pad content changes nothing."""
    model = tiny_model(mixer=mixer, short_conv_size=4)
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 64, (1, 11), generator=gen), torch.randint(0, 64, (1, 6), generator=gen)
    batch = torch.cat([a, torch.cat([b, torch.randint(0, 64, (1, 5), generator=gen)], 1)])
    mask = torch.ones_like(batch)
    mask[1, 6:] = 0
    logits = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(logits[0], model(a).logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[1, :6], model(b).logits[0], rtol=1e-5, atol=1e-5)
    batch2 = batch.clone()
    batch2[1, 6:] = (batch2[1, 6:] + 7) % 64
    torch.testing.assert_close(model(batch2, attention_mask=mask).logits[1, :6], logits[1, :6], rtol=0, atol=0)
    # the cache after a right-padded prefill holds the state after the last real token
    out = model(batch, attention_mask=mask, use_cache=True)
    ref = model(b, use_cache=True)
    state, ref_state = cache_of(out).layers[1].recurrent_states[0], cache_of(ref).layers[1].recurrent_states[0]
    torch.testing.assert_close(state[1], ref_state[0], rtol=1e-5, atol=1e-5)


def test_packed_sequences_never_see_each_other():
    model = tiny_model(short_conv_size=4)
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, 64, (1, n), generator=gen) for n in (5, 9, 3)]
    packed = torch.cat(seqs, dim=1)
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    logits = model(packed, cu_seqlens=cu).logits
    assert logits.shape == (1, 17, 64)
    for s, start in zip(seqs, cu[:-1].tolist()):
        torch.testing.assert_close(logits[0, start:start + s.shape[1]], model(s).logits[0], rtol=1e-5, atol=1e-5)
    # perturbing the first sequence leaves the others bit-identical
    packed2 = packed.clone()
    packed2[0, :5] = (packed2[0, :5] + 1) % 64
    logits2 = model(packed2, cu_seqlens=cu).logits
    assert not torch.allclose(logits2[0, :5], logits[0, :5])
    torch.testing.assert_close(logits2[0, 5:], logits[0, 5:], rtol=0, atol=0)
    # the loss ignores the cross-boundary predictions: equals the mean over the per-sequence losses' tokens
    loss = model(packed, labels=packed, cu_seqlens=cu).loss
    per_seq = [model(s, labels=s).loss * (s.shape[1] - 1) for s in seqs]
    torch.testing.assert_close(loss, sum(per_seq) / (17 - 3), rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_value_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.randint(0, 64, (1, 6)), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="input_ids"):
        model()
    with pytest.raises(ValueError, match="past_key_values"):
        model(torch.randint(0, 64, (1, 3)), cache=object(), use_cache=True)


def test_training_step_reduces_loss():
    model = tiny_model(short_conv_size=4, initializer_range=0.02).train()
    ids = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(7))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.grad is not None for n, p in model.named_parameters() if "decay" in n or "beta" in n)


# ------------------------------------------------------------------------- log-linear mixers
LOG_LINEAR = ["loglinear_hdla", "loglinear_gated_deltanet"]


@pytest.mark.parametrize("mixer", LOG_LINEAR)
def test_loglinear_cached_decoding_equals_the_full_forward(mixer):
    """HDLAConfig(mixer="loglinear_..."): the cache holds the Fenwick levels [B, H, L, K, V] and the
    absolute position (HDLACache's token count). Prefill, 1-token steps (the decoding step), a
    6-token continuation (the chunk op from the cache at its offset) and more steps give the full
    forward's logits; with 4 levels the 19 tokens share the top level. Greedy generate() equals
    greedy decoding by full forwards."""
    model = tiny_model(mixer=mixer, short_conv_size=4, mixer_kwargs={"num_levels": 4})
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(9))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :7], use_cache=True)
    cache, logits = cache_of(out), [out.logits]
    for start, stop in ((7, 8), (8, 9), (9, 15), (15, 16), (16, 19)):
        logits.append(model(ids[:, start:stop], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 19
    assert cache.layers[0].recurrent_states[0].shape == (2, 2, 4, 16, 16)
    prompt = ids[:, :5]
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, greedy_by_full_forward(model, prompt, 6))


def test_loglinear_refuses_what_would_shift_the_bucket_grid():
    """Left padding (and any padding with a cache) would move a row off its absolute positions, and a
    cache that does not count tokens cannot give them: ValueErrors naming the argument. Right padding
    without a cache is exact."""
    model = tiny_model(mixer="loglinear_hdla")
    gen = torch.Generator().manual_seed(10)
    a, b = torch.randint(1, 64, (1, 7), generator=gen), torch.randint(1, 64, (1, 4), generator=gen)
    left = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    left_mask = torch.ones_like(left)
    left_mask[1, :3] = 0
    with pytest.raises(ValueError, match=r"attention_mask: .*left padding"):
        model(left, attention_mask=left_mask, use_cache=False)
    with pytest.raises(ValueError, match=r"attention_mask: .*left padding"):
        model.generate(left, attention_mask=left_mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    right = torch.cat([a, torch.cat([b, torch.zeros(1, 3, dtype=torch.long)], 1)])
    right_mask = torch.ones_like(right)
    right_mask[1, 4:] = 0
    with pytest.raises(ValueError, match="attention_mask: .*padding with a cache"):
        model(right, attention_mask=right_mask, use_cache=True)
    logits = model(right, attention_mask=right_mask, use_cache=False).logits
    torch.testing.assert_close(logits[1, :4], model(b, use_cache=False).logits[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"cache \(past_key_values\): .*HDLACache"):
        model(a, cache=DynamicCache(config=model.config), use_cache=True)


INTERPRET_SCRIPT = """
import os, sys
assert os.environ["TRITON_INTERPRET"] == "1"
import torch
import hdla_vision.lm as lm
from hdla_vision.kernels.generalized import fused_recurrent as generalized_decoding
from hdla_vision.kernels.hdla import fused_recurrent as hdla_decoding

mixer = sys.argv[1]
module, name = ((hdla_decoding, "triton_fused_recurrent_hdla") if mixer == "hdla"
                else (generalized_decoding, "triton_fused_recurrent_generalized"))
launches, kernel = [], getattr(module, name)
setattr(module, name, lambda *args: launches.append(args[0].shape[1]) or kernel(*args))
torch.manual_seed(0)
config = lm.HDLAConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=16,
                       short_conv_size=4, initializer_range=0.3, mixer=mixer)
model = lm.HDLAForCausalLM(config).eval()
prompt = torch.randint(0, 64, (1, 20))
out = model.generate(prompt, max_new_tokens=3, do_sample=False)
generate_launches = list(launches)  # the reference below runs the same ops (the recurrence for HDLA)
seq = prompt
for _ in range(3):
    seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
assert torch.equal(out, seq), (out, seq)
# one decoding launch per new token after the first; HDLA's prefill (inference, 20 tokens) runs the same
# recurrence (kernels/README.md §11), the generalized mixers' prefill the chunk kernels
assert generate_launches == ([20, 1, 1] if mixer == "hdla" else [1, 1]), generate_launches
print("LM-INTERPRET-OK")
"""


@pytest.mark.interpret
@pytest.mark.parametrize("mixer", ["hdla", "gated_deltaproduct"])
def test_generate_on_the_triton_path_under_interpreter(mixer):
    """The GPU code path (Triton prefill + Triton decoding kernel) on the CPU, in a fresh process."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", INTERPRET_SCRIPT, mixer], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "LM-INTERPRET-OK" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mixer", MIXERS)
def test_cuda_generate_and_bf16_training_step(mixer):
    model = tiny_model(mixer=mixer, short_conv_size=4).cuda()
    prompt = torch.randint(0, 64, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, greedy_by_full_forward(model, prompt, 8))
    model.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(prompt, labels=prompt).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_cache_argument_under_either_name():
    """The cache goes in as ``cache`` or as ``past_key_values`` (its name before transformers 5.24) with the
    same result, never as both, and comes back under the installed transformers' field name."""
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(5))
    logits = []
    for name in ("cache", "past_key_values"):
        cache = HDLACache(config=model.config)
        model(ids[:, :5], **{name: cache}, use_cache=True)
        out = model(ids[:, 5:], **{name: cache}, use_cache=True)
        assert cache_of(out) is cache and cache.get_seq_length() == 7
        logits.append(out.logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="cache / past_key_values"):
        model(ids, cache=HDLACache(config=model.config), past_key_values=HDLACache(config=model.config))
