"""Every vision backbone (its mixer and its block) under ``torch.compile(fullgraph=True)`` on the CPU.

* each of our ``*_tiny`` timm models (class token in the middle of the scan, so the block's
  insert / split of the class token is traced too) compiles to one graph, and its output and every
  parameter's gradient equal eager (``tools.compile_models.check_model``, which the device script
  runs on CUDA): backend ``"eager"`` (dynamo's capture alone; fullgraph makes a graph break an
  error), one model through AOTAutograd (``"aot_eager"``), whose backward graph holds the ops'
  backward nodes; inductor is tests/test_custom_ops.py's;
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
from tools.compile_models import TINY, check_model, passed

SMALL = dict(img_size=16, patch_size=8, embed_dim=32, num_heads=2, depth=1, num_classes=5, class_token=True,
             global_pool="token")
EXACT = 1e-6


def _small_model(name):
    torch.manual_seed(0)
    return timm.create_model(name, **SMALL).eval()  # eval: drop path off (its masks are random)


def test_every_tiny_model_is_listed():
    assert len(TINY) == 12 and {"hdla_tiny", "gla_tiny", "loglinear_gdn_tiny"} <= set(TINY), TINY


@pytest.mark.parametrize("name", TINY)
def test_model_compiles_to_one_graph_equal_to_eager(name):
    row = check_model(_small_model(name), torch.randn(2, 3, 16, 16), backend="eager")
    assert passed(row, EXACT), row


def test_model_through_aot_autograd_equals_eager():
    """AOTAutograd traces the forward and the backward (the ops' backward custom ops) of hdla_tiny."""
    row = check_model(_small_model("hdla_tiny"), torch.randn(2, 3, 16, 16), backend="aot_eager")
    assert passed(row, EXACT), row


class _DataDependentBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x.mean((1, 2)))
        return y if y.sum() > 0 else -y  # a branch on a tensor's value: a graph break


def test_the_check_reports_a_graph_break():
    row = check_model(_DataDependentBranch(), torch.randn(2, 3, 4, 4), backend="eager")
    assert not passed(row, EXACT) and row["error"].startswith("Unsupported"), row


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
