"""Every vision backbone (its mixer and its block) under ``torch.compile(fullgraph=True)`` on the CPU.

* each of our ``*_tiny`` timm models (class token in the middle of the scan, so the block's
  insert / split of the class token is traced too) compiles to one graph, and its output and every
  parameter's gradient equal eager: backend ``"eager"`` (dynamo's capture alone; fullgraph makes a
  graph break an error), one model through AOTAutograd (``"aot_eager"``), whose backward graph
  holds the ops' backward nodes; inductor is tests/test_custom_ops.py's;
* a dynamic batch stays one graph: the ops' batch slicing (``kernels.utils.batch_slices``) used to
  iterate over the batch size and specialise every compiled graph to one batch (a recompile per size);
* bad input still raises ValueError naming the argument under compile.

Models are cut to one block of width 32 on 16-pixel images (4 patches): tracing, not arithmetic,
is the cost.
"""
import re

import pytest
import timm
import torch
from torch._dynamo.utils import counters

import hdla_vision  # noqa: F401  registers the timm models
from hdla_vision.layers import create_mixer
from tools.timm_suite import OUR_MODULES

TINY = sorted(name for name in timm.list_models(module=list(OUR_MODULES)) if name.endswith("_tiny"))
SMALL = dict(img_size=16, patch_size=8, embed_dim=32, num_heads=2, depth=1, num_classes=5, class_token=True,
             global_pool="token")


def _outputs_and_grads(module, fn, x):
    """``fn(x)`` and the gradients of x and of every parameter for the loss ``mean(fn(x)^2)``."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = fn(x)
    y.square().mean().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_one_graph_equal_to_eager(module, x, backend):
    torch._dynamo.reset()
    counters.clear()
    y_ref, dx_ref, grads_ref = _outputs_and_grads(module, module, x)
    y, dx, grads = _outputs_and_grads(module, torch.compile(module, backend=backend, fullgraph=True), x)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(module.parameters()))
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _small_model(name):
    torch.manual_seed(0)
    return timm.create_model(name, **SMALL).eval()  # eval: drop path off (its masks are random)


def test_every_tiny_model_is_listed():
    assert len(TINY) == 12 and {"hdla_tiny", "gla_tiny", "loglinear_gdn_tiny"} <= set(TINY), TINY


@pytest.mark.parametrize("name", TINY)
def test_model_compiles_to_one_graph_equal_to_eager(name):
    _assert_one_graph_equal_to_eager(_small_model(name), torch.randn(2, 3, 16, 16), backend="eager")


def test_model_through_aot_autograd_equals_eager():
    """AOTAutograd traces the forward and the backward (the ops' backward custom ops) of hdla_tiny."""
    _assert_one_graph_equal_to_eager(_small_model("hdla_tiny"), torch.randn(2, 3, 16, 16), backend="aot_eager")


def test_dynamic_batch_is_one_graph():
    """Batch 2 compiles a static graph; batch 3 the dynamic one, which batches 4 and 7 reuse."""
    torch.manual_seed(0)
    mixer = create_mixer("hdla", dim=32, num_heads=2, directions=("fwd", "bwd"))
    compiled = torch.compile(mixer, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    for batch in (2, 3, 4, 7):
        x = torch.randn(batch, 5, 32)
        y = compiled(x)
        torch.testing.assert_close(y, mixer(x), rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def _exception_chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def test_bad_input_raises_under_compile():
    """The shape checks run while dynamo traces (shapes only), before any op: a compiled mixer refuses a
    wrong width with the eager ValueError; under fullgraph dynamo reports it as an ``Unsupported``
    error ("Observed exception") raised from that ValueError."""
    torch.manual_seed(0)
    mixer = create_mixer("gated_deltanet", dim=32, num_heads=2, directions=("fwd", "bwd"))
    message = r"x must have shape \[B, N, 32\], got \[2, 5, 31\]"
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=message):
        torch.compile(mixer, backend="eager")(torch.randn(2, 5, 31))
    torch._dynamo.reset()
    with pytest.raises(Exception) as raised:
        torch.compile(mixer, backend="eager", fullgraph=True)(torch.randn(2, 5, 31))
    assert any(re.search(message, str(error)) for error in _exception_chain(raised.value)), raised.value
