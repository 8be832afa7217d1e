"""The ops as torch.library custom ops (kernels/custom_ops.py) inside models, on CPU tensors (each op's
own opcheck is in tests/ops/):

* ``torch.compile(fullgraph=True)`` of the HDLA mixer, a seed mixer and a small hdla_tiny equals
  eager, forward and gradients;
* the ops are single opaque nodes: no graph break, one node for the mixer's two scans in the forward
  and in the backward graph (the bidirectional op), and a graph whose size does not grow with the
  sequence (the chunk loop is not unrolled into it);
* the path each op takes is a constant of the graph (the kernel family set when it was traced).
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
    assert _path_args(capture.forward, OPS.chunk_hdla_bidirectional.default) == ["form"]  # CPU: the chunk form
    assert _path_args(capture.backward, OPS.chunk_hdla_bidirectional_backward.default) == ["form"]
    return tuple(len(gm.graph.nodes) for gm in (capture.dynamo[0], capture.forward[0], capture.backward[0]))


def test_ops_are_single_nodes_and_the_chunk_loop_is_not_unrolled():
    """One chunk_hdla_bidirectional node (both scan directions) in the forward graph, one backward node
    in the backward graph, and the same graphs at T = 20 (2 chunks of 16) and T = 150 (10 chunks)."""
    short, long = _graph_sizes(20), _graph_sizes(150)
    assert short == long and short[1] < 150, (short, long)


def _path_args(graphs, op) -> list:
    """The ``path`` argument (the last) of each node of ``graphs`` that calls ``op``."""
    return [node.args[-1] for gm in graphs for node in gm.graph.nodes if node.target == op]


def _fake_graph(fn, *inputs):
    """``fn`` traced with fake tensors (no kernel runs) into an FX graph of aten and custom ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*inputs)


def _hdla_inputs(batch=1, seq_len=20, heads=1, dk=16, dirs=None):
    lead = () if dirs is None else (dirs,)
    q, v = torch.randn(batch, seq_len, heads, dk), torch.randn(batch, seq_len, heads, dk)
    k = torch.nn.functional.normalize(torch.randn(batch, seq_len, heads, dk), dim=-1)
    return q, k, v, torch.rand(*lead, batch, seq_len, heads), -torch.rand(*lead, batch, seq_len, heads, dk)


@pytest.mark.parametrize("family", ["chunk16", "chunk64"])
def test_graph_holds_the_kernel_family_as_a_constant(monkeypatch, family):
    """The public ops pick the path and pass it to the custom op, so that a graph traced under one
    HDLA_VISION_KERNELS differs from one traced under another, and the fake x has that family's shape.
    With the path picked inside the op, inductor's cache handed a graph compiled under chunk16 (x [2, B, T,
    H, 2, V]) to a process running chunk64 (h [2, B, H, NT, K, V]), which failed its stride assertion
    (H200, 2026-11-28, benchmarks/results/NOTES.md)."""
    from hdla_vision import kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors on the Triton path (nothing runs: fake tensors)
    monkeypatch.setenv("HDLA_VISION_KERNELS", family)
    single = _fake_graph(lambda *x: kernels.chunk_hdla(*x)[0], *_hdla_inputs())
    both = _fake_graph(lambda *x: kernels.chunk_hdla_bidirectional(*x)[0], *_hdla_inputs(dirs=2))
    q, k, v, beta, g = _hdla_inputs()
    ks, vs, a = k.unsqueeze(-2), v.unsqueeze(-2), torch.randn(1, 20, 1, 1, 16)
    general = _fake_graph(lambda *x: kernels.chunk_generalized(*x)[0], q, ks, vs, a, a, g[..., 0])
    assert _path_args([single], OPS.chunk_hdla.default) == [family]
    assert _path_args([both], OPS.chunk_hdla_bidirectional.default) == [family]
    assert _path_args([general], OPS.chunk_generalized.default) == [family]
    x = [n for n in both.graph.nodes if n.target == OPS.chunk_hdla_bidirectional.default][0].meta["val"][2]
    assert x.shape == ((2, 1, 20, 1, 2, 16) if family == "chunk16" else (2, 1, 1, 1, 16, 16))


def test_a_path_the_inputs_cannot_take_is_refused():
    q, k, v, beta, g = _hdla_inputs()
    with pytest.raises(ValueError, match="path='chunk32' is not a path"):
        OPS.chunk_hdla(q, k, v, beta, g, 1.0, None, False, False, "chunk32")
    with pytest.raises(ValueError, match="path='chunk64' cannot run"):  # CPU tensors, no interpreter
        OPS.chunk_hdla_bidirectional(q, k, v, torch.stack([beta] * 2), torch.stack([g] * 2), 1.0, None, False,
                                     "chunk64")
    o, _, _ = OPS.chunk_hdla(q, k, v, beta, g, 1.0, None, False, False, "form")
    torch.testing.assert_close(o, OPS.chunk_hdla(q, k, v, beta, g, 1.0, None, False, False)[0])


def _backward_functions():
    from hdla_vision.kernels import bidirectional_ops as bidir
    from hdla_vision.kernels import custom_ops as ops

    return [(OPS.chunk_generalized.default, ops._generalized_backward), (OPS.chunk_hdla.default, ops._hdla_backward),
            (OPS.fused_recurrent_hdla.default, ops._fused_backward),
            (OPS.fused_recurrent_generalized.default, ops._fused_generalized_backward),
            (OPS.chunk_hdla_bidirectional.default, bidir._hdla_bidirectional_backward),
            (OPS.fused_recurrent_hdla_bidirectional.default, bidir._fused_recurrent_backward),
            (OPS.chunk_generalized_bidirectional.default, bidir._generalized_bidirectional_backward)]


def test_backward_without_cotangents_returns_one_none_per_input():
    """Each op's registered backward, given no cotangent for any output, returns one None per input of the
    op's schema (autograd refuses another count; the inputs grew by ``path``)."""
    for op, backward in _backward_functions():
        inputs, outputs = len(op._schema.arguments), len(op._schema.returns)
        assert backward(None, *([None] * outputs)) == (None,) * inputs, op


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
