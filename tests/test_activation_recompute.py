"""The recomputed stages of the mixers and blocks (issue 12 part 4, hdla_vision/layers/mixer.py): the same
outputs and gradients as saving the activations, and as the definition before them (the block's norm
outside the mixer, timm's Mlp called whole)."""
import collections
import re

import pytest
import timm
import torch
import torch.nn as nn

import hdla_vision  # noqa: F401  registers the timm models
from hdla_vision.layers import create_mixer
from hdla_vision.layers.mixer import activation_recompute, set_activation_recompute
from tests.op_calls import OurOpCalls
from tools.compile_models import TINY

VISION = ("fwd", "bwd")


@pytest.fixture(autouse=True)
def recompute_on_afterwards():
    yield
    set_activation_recompute(True)


def outputs_and_grads(module, x, **kwargs):
    """``module(x, **kwargs)`` and the gradients of ``sum(out^2)`` w.r.t. x and every parameter."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = module(x, **kwargs)
    out.square().sum().backward()
    return out.detach(), {"x": x.grad, **{n: p.grad for n, p in module.named_parameters() if p.grad is not None}}


def assert_same(got, expected, **tol):
    out, grads = got
    out_ref, grads_ref = expected
    assert grads.keys() == grads_ref.keys()
    compare = torch.testing.assert_close if tol else lambda a, b: torch.equal(a, b) or pytest.fail("not bitwise equal")
    compare(out, out_ref, **tol)
    for name in grads_ref:
        compare(grads[name], grads_ref[name], **tol)


@pytest.mark.parametrize("name", TINY)
def test_recomputing_changes_no_bit(name):
    """Every tiny backbone (fp32): output and every gradient bitwise equal with the stages recomputed and with
    their activations saved."""
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, depth=2, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    recomputed = outputs_and_grads(model, x)
    set_activation_recompute(False)
    saved = outputs_and_grads(model, x)
    assert_same(recomputed, saved)
    assert saved[1]["blocks.0.attn.qkv.weight"].abs().max() > 0


def training_step_calls(model, x):
    """One forward and backward of ``model(x).sum()``: (the hdla_vision op calls, how often each Linear was
    entered; a pre-hook: the checkpoint's recomputation stops inside the last layer that saves a tensor)."""
    linear_calls = collections.Counter()
    hooks = [m.register_forward_pre_hook(lambda m, args, n=n: linear_calls.update([n]))
             for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with OurOpCalls() as ops:
        model(x).sum().backward()
    for hook in hooks:
        hook.remove()
    return ops.calls, linear_calls


# the Linear layers inside the recomputed stages: the prologue (qkv, the gates), the output stage's W_g, and the
# MLP after fc1 (fc2 reruns because the checkpoint re-saves its input by calling it)
RECOMPUTED_LINEAR = re.compile(r"blocks\.\d+\.(attn\.(qkv|gate|directions\..+)|mlp\.fc2)")


@pytest.mark.parametrize("name, op", [("hdla_tiny", "chunk_hdla_bidirectional"),
                                      ("gla_tiny", "chunk_generalized_bidirectional"),
                                      ("gdn_tiny", "chunk_generalized_bidirectional"),
                                      ("kda_tiny", "chunk_generalized_bidirectional")])
def test_backward_reruns_no_scan(name, op):
    """A training step (2 blocks) calls the bidirectional op once per block forward and its backward once per
    block, with the stages recomputed and with their activations saved: the recomputation reruns only the
    prologue (its Linear layers, or HDLA's fused prologue op and the GEMMs around it), the output stage's gate
    and fc2, never the scan, W_o, fc1 or the head."""
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, depth=2, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    ops_on, linear_on = training_step_calls(model, x)
    set_activation_recompute(False)
    ops_off, linear_off = training_step_calls(model, x)
    # every mixer's output stage is one op (gated_rms_norm), rerun by the recomputation like HDLA's fused prologue
    scans = {f"hdla_vision::{op}": 2, f"hdla_vision::{op}_backward": 2, "hdla_vision::gated_rms_norm_backward": 2}
    fused = name == "hdla_tiny"  # HDLA's prologue: one op per block, its backward once per block
    prologue = {"hdla_vision::mixer_prologue_backward": 2} if fused else {}
    assert ops_on == dict(scans, **prologue, **({"hdla_vision::mixer_prologue": 4} if fused else {}),
                          **{"hdla_vision::gated_rms_norm": 4})
    assert ops_off == dict(scans, **prologue, **({"hdla_vision::mixer_prologue": 2} if fused else {}),
                           **{"hdla_vision::gated_rms_norm": 2})
    assert set(linear_off.values()) == {1}
    rerun = {n for n, calls in linear_on.items() if calls == 2}
    assert rerun == {n for n in linear_on if RECOMPUTED_LINEAR.fullmatch(n)}
    assert {"blocks.1.attn.gate", "blocks.1.mlp.fc2"} | (set() if fused else {"blocks.1.attn.qkv"}) <= rerun
    assert set(linear_on.values()) == {1, 2}


def test_recomputed_mlp_replays_its_dropout():
    """With dropout inside the recomputed MLP (drop1), the backward replays the forward's mask: the gradients
    equal those of the saved activations for the same seed (and the dropout is really drawn)."""
    model = timm.create_model("hdla_tiny", img_size=32, depth=1, num_classes=10, proj_drop_rate=0.5).train()
    assert model.blocks[0].mlp.drop1.p == 0.5
    x = torch.randn(2, 3, 32, 32)
    runs = {}
    for recompute in (True, False):
        set_activation_recompute(recompute)
        torch.manual_seed(1)
        runs[recompute] = outputs_and_grads(model, x)
    assert_same(runs[True], runs[False])
    torch.manual_seed(2)
    assert not torch.equal(outputs_and_grads(model, x)[0], runs[True][0])


@pytest.mark.parametrize("name", ["hdla", "gla", "gated_deltanet", "kda", "rwkv7", "loglinear_hdla"])
def test_mixer_with_the_blocks_norm_equals_the_mixer_after_it(name):
    """``mixer(x, norm=norm)`` (the norm inside the recomputed stages) against the definition before,
    ``mixer(norm(x))`` with every activation saved, in float64: the same output and gradients (the norm's
    backward now runs once per stage, so the sums may differ in the last bits)."""
    torch.manual_seed(0)
    mixer = create_mixer(name, dim=32, num_heads=2, directions=VISION).double()
    norm = nn.LayerNorm(32, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2), norm.bias.normal_(0.0, 0.2)
    both = nn.ModuleDict(dict(mixer=mixer, norm=norm))
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    both.forward = lambda t: mixer(t, norm=norm)
    inside = outputs_and_grads(both, x)
    set_activation_recompute(False)
    both.forward = lambda t: mixer(norm(t))
    before = outputs_and_grads(both, x)
    assert_same(inside, before, rtol=1e-10, atol=1e-12)
    assert before[1]["norm.weight"].abs().max() > 0


def test_block_equals_the_timm_block_definition():
    """MixerBlock (norm1 inside the mixer, the MLP's activation recomputed) against timm's pre-norm block
    written out, ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))`` with every activation saved, in float64."""
    torch.manual_seed(0)
    block = timm.create_model("hdla_tiny", img_size=32, depth=1, num_classes=10).blocks[0].double()
    x = torch.randn(2, 5, block.norm1.normalized_shape[0], dtype=torch.float64)
    recomputed = outputs_and_grads(block, x)

    def definition(t):
        t = t + block.attn(block.norm1(t))
        return t + block.mlp(block.norm2(t))

    set_activation_recompute(False)
    block.forward = definition
    assert_same(recomputed, outputs_and_grads(block, x), rtol=1e-10, atol=1e-12)


def test_switch_refuses_a_non_bool():
    assert activation_recompute() is True
    with pytest.raises(ValueError, match="enabled must be a bool"):
        set_activation_recompute(1)
