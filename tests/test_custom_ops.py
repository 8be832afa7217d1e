"""The ops as torch.library custom ops (kernels/custom_ops.py) inside models, on CPU tensors (each op's
own opcheck is in tests/ops/):

* ``torch.compile(fullgraph=True)`` of the HDLA mixer, a seed mixer and a small hdla_tiny equals
  eager, forward and gradients;
* the ops are single opaque nodes: no graph break, one node for the mixer's two scans in the forward
  and in the backward graph (the bidirectional op), and a graph whose size does not grow with the
  sequence (the chunk loop is not unrolled into it).
"""
import pytest
import timm
import torch

import hdla_vision  # noqa: F401  registers the timm models
from hdla_vision.layers import create_mixer
from tests.graph_capture import GraphCapture, count_nodes

OPS = torch.ops.hdla_vision


# ----------------------------------------------------------------------------- graphs
def _hdla_mixer(seed=0):
    torch.manual_seed(seed)
    return create_mixer("hdla", dim=32, num_heads=2, directions=("fwd", "bwd"))


def test_hdla_mixer_has_no_graph_break():
    mixer = _hdla_mixer()
    explanation = torch._dynamo.explain(mixer)(torch.randn(2, 37, 32))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


def _graph_sizes(seq_len: int):
    """Compile the HDLA mixer at one sequence length, run forward and backward; return the node
    counts of the dynamo, AOT forward and AOT backward graphs, after checking the op nodes."""
    torch._dynamo.reset()
    capture = GraphCapture()
    compiled = torch.compile(_hdla_mixer(), backend=capture, fullgraph=True)
    compiled(torch.randn(1, seq_len, 32, requires_grad=True)).sum().backward()
    assert len(capture.dynamo) == len(capture.forward) == len(capture.backward) == 1
    assert count_nodes(capture.forward, OPS.chunk_hdla_bidirectional.default) == 1  # both scan directions
    assert count_nodes(capture.backward, OPS.chunk_hdla_bidirectional_backward.default) == 1
    return tuple(len(gm.graph.nodes) for gm in (capture.dynamo[0], capture.forward[0], capture.backward[0]))


def test_ops_are_single_nodes_and_the_chunk_loop_is_not_unrolled():
    """One chunk_hdla_bidirectional node (both scan directions) in the forward graph, one backward node
    in the backward graph, and the same graphs at T = 20 (2 chunks of 16) and T = 150 (10 chunks)."""
    short, long = _graph_sizes(20), _graph_sizes(150)
    assert short == long and short[1] < 150, (short, long)


def _assert_compiled_equals_eager(module, inputs, rtol=1e-5, atol=1e-5):
    """Forward and the gradients of the input and of every parameter: eager against
    ``torch.compile(fullgraph=True)`` (inductor on the CPU)."""
    def run(fn):
        module.zero_grad(set_to_none=True)
        x = inputs.clone().requires_grad_()
        y = fn(x)
        y.square().mean().backward()
        return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    y_ref, dx_ref, grads_ref = run(module)
    y, dx, grads = run(torch.compile(module, fullgraph=True))
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(dx, dx_ref, rtol=rtol, atol=atol)
    assert grads.keys() == grads_ref.keys() and len(grads) > 5
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_compiled_hdla_mixer_equals_eager():
    torch._dynamo.reset()
    _assert_compiled_equals_eager(_hdla_mixer(), torch.randn(2, 37, 32))


def test_compiled_seed_mixer_equals_eager():
    """Gated DeltaNet: chunk_generalized with a per-head g [B, T, H], both directions."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mixer = create_mixer("gated_deltanet", dim=32, num_heads=2, directions=("fwd", "bwd"))
    _assert_compiled_equals_eager(mixer, torch.randn(2, 37, 32))


def test_compiled_small_hdla_tiny_equals_eager():
    """The whole backbone (patch embedding, block, head) at one block and 4 tokens: about 30 s of cold
    inductor compilation on 2 CPU cores (benchmarks/compile_time.py times depth 2)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = timm.create_model("hdla_tiny", img_size=32, depth=1, num_classes=5).eval()  # eval: no drop path
    _assert_compiled_equals_eager(model, torch.randn(2, 3, 32, 32), rtol=1e-4, atol=1e-5)


ONE_COPY_SCRIPT = """
import sys
import torch
from torch._library.custom_ops import OPDEFS
{imports}
import hdla_vision.kernels as installed
assert sys.modules["kernels"] is installed
assert sys.modules["kernels.custom_ops"] is installed.custom_ops
for name in ("chunk_generalized", "chunk_hdla", "fused_recurrent_hdla", "fused_recurrent_generalized"):
    assert OPDEFS["hdla_vision::" + name] is getattr(installed.custom_ops, name + "_op"), name
for name in ("chunk_generalized_bidirectional", "chunk_hdla_bidirectional"):
    assert OPDEFS["hdla_vision::" + name] is getattr(installed.bidirectional_ops, name + "_op"), name
q, k = torch.randn(1, 5, 1, 4), torch.nn.functional.normalize(torch.randn(1, 5, 1, 4), dim=-1)
o, _ = installed.chunk_hdla(q, k, torch.randn(1, 5, 1, 4), torch.rand(1, 5, 1), -torch.rand(1, 5, 1, 4))
assert o.shape == (1, 5, 1, 4)
print("ONE-COPY-OK")
"""


@pytest.mark.parametrize("imports", ["import hdla_vision.kernels\nimport kernels", "import kernels"])
def test_top_level_kernels_import_is_the_installed_package(imports):
    """From the checkout's root ``kernels/`` is importable as ``kernels`` too, and transformers imports
    it (its probe for the Hugging Face package). It must be the installed package under another
    name: a second copy defines the custom ops again and torch frees the first copy's registrations,
    which its op objects still use (a segfault in ``generate`` under the Triton interpreter)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", ONE_COPY_SCRIPT.format(imports=imports)], cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ONE-COPY-OK" in result.stdout, result.stdout + result.stderr
