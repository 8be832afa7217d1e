"""The HDLA mixer in its bidirectional (vision) use: registry, input checks, its definition against a
float64 token loop, bidirectionality, and the Triton path (under TRITON_INTERPRET=1) against PyTorch.
Its causal use is checked in tests/test_causal_mixers.py and tests/test_lm.py."""
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from hdla_vision.layers import HDLAMixer, create_mixer, list_mixers

BIDIRECTIONAL = ("fwd", "bwd")


def make_mixer(dim=32, num_heads=2, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    mixer = create_mixer("hdla", dim=dim, num_heads=num_heads, directions=BIDIRECTIONAL, qkv_bias=True)
    with torch.no_grad():  # spread the gates so that beta and lambda vary over their ranges
        for gates in mixer.directions:
            gates["beta"].proj.weight.normal_(0.0, 0.5)
            gates["decay"].logits.up.weight.normal_(0.0, 0.5)
    return mixer.to(dtype)


def projections(mixer, x):
    """q, k, v ``[B, N, H, D]`` and each direction's g ``[B, N, H, D]`` and beta ``[B, N, H]``."""
    q, k, v = mixer.projections(x)
    fwd, bwd = (mixer.features(x, q, k, v, gates) for gates in mixer.directions)
    torch.testing.assert_close(fwd.k, bwd.k, rtol=0, atol=0)  # q, k, v are shared by the directions
    return q, fwd.k, fwd.v, fwd.g, bwd.g, fwd.beta, bwd.beta


def scan_loop(q, k, v, beta, g, reverse):
    """One direction of eq. 27-28 as an explicit float64 token loop: y ``[B, N, H, D]``."""
    batch, seq_len, heads, dk = q.shape
    eye = torch.eye(dk, dtype=q.dtype)
    state = q.new_zeros(batch, heads, dk, v.shape[-1])
    out = torch.zeros_like(v)
    for t in (range(seq_len - 1, -1, -1) if reverse else range(seq_len)):
        kt = k[:, t]
        house = eye - beta[:, t, :, None, None] * kt.unsqueeze(-1) * kt.unsqueeze(-2)  # [B, H, D, D]
        decay = house @ torch.diag_embed(g[:, t].exp()) @ house
        state = decay @ state + kt.unsqueeze(-1) * v[:, t].unsqueeze(-2)
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)
    return out


def test_registered_by_name():
    assert "hdla" in list_mixers()
    assert isinstance(create_mixer("hdla", dim=16, num_heads=2, directions=BIDIRECTIONAL), HDLAMixer)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dim=30, num_heads=4), "multiple of num_heads"),
        (dict(dim=32, num_heads=2, window=3), "unknown arguments"),
        (dict(dim=32, num_heads=2, decay_rank=0), "decay_rank"),
        (dict(dim=32, num_heads=2, min_memory=1.0), "min_memory"),
        (dict(dim=32, num_heads=2, directions=("bwd",)), "directions"),
        (dict(dim=32, num_heads=2, short_conv_size=4), "short_conv_size"),  # causal conv, bidirectional mixer
        (dict(dim=32, num_heads=2, gate_act="relu"), "gate_act"),
        (dict(dim=32, num_heads=2, log_linear=1), "log_linear must be a bool"),
        (dict(dim=32, num_heads=2, log_linear=True, num_levels=1), "num_levels must be an int >= 2"),
        (dict(dim=32, num_heads=2, log_linear=True, num_levels=4.0), "num_levels must be an int >= 2"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HDLAMixer(**dict(dict(directions=BIDIRECTIONAL), **kwargs))


def test_loglinear_names_are_log_linear_only():
    """``loglinear_hdla`` is HDLAMixer with ``log_linear=True``; asked for False it names the linear mixer."""
    mixer = create_mixer("loglinear_hdla", dim=16, num_heads=2, directions=BIDIRECTIONAL)
    assert isinstance(mixer, HDLAMixer) and mixer.log_linear and mixer.mixer_name == "loglinear_hdla"
    assert not create_mixer("hdla", dim=16, num_heads=2, directions=BIDIRECTIONAL).log_linear
    with pytest.raises(ValueError, match="log_linear=False: .* use 'hdla'"):
        create_mixer("loglinear_hdla", dim=16, num_heads=2, directions=BIDIRECTIONAL, log_linear=False)


def test_bad_input_shape_raises():
    mixer = HDLAMixer(dim=32, num_heads=2, directions=BIDIRECTIONAL)
    with pytest.raises(ValueError, match=r"\[B, N, 32\]"):
        mixer(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="bidirectional"):
        mixer(torch.randn(2, 5, 32), attention_mask=torch.ones(2, 5))


def test_gate_ranges():
    mixer = make_mixer()
    x = torch.randn(2, 9, 32, dtype=torch.float64) * 3
    q, k, v, g_fwd, g_bwd, beta_fwd, beta_bwd = projections(mixer, x)
    assert torch.allclose(k.norm(dim=-1), torch.ones_like(k[..., 0]))
    for beta in (beta_fwd, beta_bwd):
        assert beta.shape == (2, 9, 2) and (beta > 0).all() and (beta < 2).all()
    for g in (g_fwd, g_bwd):
        assert g.dtype == torch.float64 and (g < 0).all()
    assert not torch.allclose(g_fwd, g_bwd)  # per-direction decays
    assert not torch.allclose(beta_fwd, beta_bwd)


def test_gates_fp32_for_bf16_inputs():
    mixer = HDLAMixer(dim=32, num_heads=2, directions=BIDIRECTIONAL).to(torch.bfloat16)
    *_, g_fwd, g_bwd, beta_fwd, beta_bwd = projections(mixer, torch.randn(1, 5, 32, dtype=torch.bfloat16))
    assert {g_fwd.dtype, g_bwd.dtype, beta_fwd.dtype, beta_bwd.dtype} == {torch.float32}


@pytest.mark.parametrize("seq_len", [1, 7, 37])
def test_mixer_equals_definition(seq_len):
    """Forward scan + reversed scan - own write, against the float64 loop; then norm, gate, proj."""
    mixer = make_mixer()
    x = torch.randn(2, seq_len, 32, dtype=torch.float64)
    q, k, v, g_fwd, g_bwd, beta_fwd, beta_bwd = projections(mixer, x)
    own = (q * k).sum(-1, keepdim=True) * v
    y_ref = scan_loop(q, k, v, beta_fwd, g_fwd, False) + scan_loop(q, k, v, beta_bwd, g_bwd, True) - own
    torch.testing.assert_close(mixer.mix(x), y_ref, rtol=1e-9, atol=1e-10)

    rms = y_ref * torch.rsqrt(y_ref.pow(2).mean(-1, keepdim=True) + mixer.norm_eps) * mixer.norm.weight
    gated = rms.reshape(2, seq_len, 32) * F.silu(mixer.gate(x))
    torch.testing.assert_close(mixer(x), mixer.proj(gated), rtol=1e-9, atol=1e-10)


def test_own_write_counted_once():
    """At the ends of the sequence one scan holds only the token's own write, so the mixer output
    there equals the other scan alone; counting the own write twice would break this."""
    mixer = make_mixer()
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    q, k, v, g_fwd, g_bwd, beta_fwd, beta_bwd = projections(mixer, x)
    y = mixer.mix(x)
    torch.testing.assert_close(y[:, 0], scan_loop(q, k, v, beta_bwd, g_bwd, True)[:, 0])
    torch.testing.assert_close(y[:, -1], scan_loop(q, k, v, beta_fwd, g_fwd, False)[:, -1])
    own = (q * k).sum(-1, keepdim=True) * v
    assert own[:, 0].abs().max() > 1e-3 and own[:, -1].abs().max() > 1e-3  # not vacuous


def test_bidirectional_gradients():
    """A token's output depends on tokens before and after it."""
    mixer = make_mixer(dtype=torch.float32)
    x = torch.randn(1, 12, 32, requires_grad=True)
    i = 5
    mixer(x)[:, i].sum().backward()  # the output projection's channel sum: a real function of x
    per_token = x.grad[0].abs().sum(-1)
    floor = 1e-3 * per_token[i]  # far above rounding noise (~1e-7 of it)
    assert (per_token[:i] > floor).all(), "no dependence on earlier tokens"
    assert (per_token[i + 1:] > floor).all(), "no dependence on later tokens"


def test_backward_scan_reaches_first_token():
    """The first token reads the last one only through the reversed scan."""
    mixer = make_mixer(dtype=torch.float32)
    with torch.no_grad():
        mixer.directions[1]["decay"].logits.up.bias.fill_(-30.0)  # backward scan forgets at once: lambda ~ 1e-13
    x = torch.randn(1, 8, 32, requires_grad=True)
    mixer(x)[:, 0].sum().backward()
    assert x.grad[0, -1].abs().max() < 1e-8
    mixer.zero_grad()
    x.grad = None
    with torch.no_grad():
        mixer.directions[1]["decay"].logits.up.bias.fill_(8.0)  # lambda ~ 1: long memory
    mixer(x)[:, 0].sum().backward()
    assert x.grad[0, -1].abs().max() > 1e-4


def test_decay_initialisation_spans_memory_range():
    mixer = HDLAMixer(dim=64, num_heads=2, directions=BIDIRECTIONAL, min_memory=2.0, max_memory=256.0)
    fwd_bias, bwd_bias = (gates["decay"].logits.up.bias for gates in mixer.directions)
    lam = torch.sigmoid(fwd_bias).view(2, 32)
    memory = 1.0 / (1.0 - lam)
    torch.testing.assert_close(memory[:, 0], torch.full((2,), 2.0), rtol=1e-4, atol=0)
    torch.testing.assert_close(memory[:, -1], torch.full((2,), 256.0), rtol=1e-3, atol=0)
    torch.testing.assert_close(fwd_bias, bwd_bias)


INTERPRET_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from hdla_vision.layers import create_mixer
    from hdla_vision.kernels.ops import use_triton
    torch.manual_seed(0)
    mixer = create_mixer("hdla", dim=64, num_heads=2, directions=("fwd", "bwd"), qkv_bias=True)
    x = torch.randn(1, 19, 64, requires_grad=True)
    assert use_triton(x), "TRITON_INTERPRET=1 must route CPU tensors to Triton"
    y = mixer(x)
    y.backward(torch.ones_like(y))
    torch.save({"y": y.detach(), "dx": x.grad, "dqkv": mixer.qkv.weight.grad}, sys.argv[1])
    """
)


@pytest.mark.interpret
def test_triton_interpret_matches_pytorch(tmp_path):
    """The mixer on the Triton path (TRITON_INTERPRET=1, set before triton is imported, so in a
    subprocess) equals the PyTorch chunk path, forward and backward."""
    try:
        importlib.import_module("hdla_vision.kernels.hdla.chunk")
    except ImportError as err:
        pytest.skip(f"hdla_vision.kernels.hdla.chunk (the Triton HDLA kernel) cannot be imported yet: {err}")
    out = tmp_path / "triton.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRET_SCRIPT, str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    triton_result = torch.load(out, weights_only=True)

    assert os.environ.get("TRITON_INTERPRET", "0") != "1"
    torch.manual_seed(0)
    mixer = create_mixer("hdla", dim=64, num_heads=2, directions=("fwd", "bwd"), qkv_bias=True)
    x = torch.randn(1, 19, 64, requires_grad=True)
    y = mixer(x)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(triton_result["y"], y.detach(), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(triton_result["dx"], x.grad, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(triton_result["dqkv"], mixer.qkv.weight.grad, rtol=1e-3, atol=1e-4)
