"""The bidirectional ops ``chunk_hdla_bidirectional`` / ``chunk_generalized_bidirectional`` (kernels/README.md
§9) and the vision mixers that run on them:

* on the chunk64 kernels under ``TRITON_INTERPRET=1`` (both directions in one launch; the checks of
  tests/bidirectional_checks.py in one subprocess) and on the PyTorch chunk form (CPU), the op equals
  the forward scan + the reversed scan - the reversed scan's own write on the float64 token loops: y,
  both final states and every gradient, fp32 < 1e-4 (on chunk64 also with fast-forgetting gates, whose
  diagonal blocks take the levels in both scans, kernels/generalized/diag_levels.py);
* bad arguments raise ValueError naming the argument;
* every bidirectional mixer's op path equals its definition (:meth:`two_scans`), forward and gradients;
* ``torch.compile(fullgraph=True)`` traces a mixer as one op node forward and one backward.

Everything but the interpreted checks runs on the CPU path; in a process started with
``TRITON_INTERPRET=1`` CPU tensors go to the interpreted (chunk16) kernels instead, minutes per test,
so those tests skip there and only the interpreted checks run.
"""
import os
from functools import partial

import pytest
import torch

from hdla_vision.kernels import chunk_generalized_bidirectional, chunk_hdla_bidirectional
from hdla_vision.layers import create_mixer
from tests.bidirectional_oracle import bidirectional_problem, compare_bidirectional
from tests.graph_capture import GraphCapture, count_nodes
from tests.interpreted import run_interpreted_checks
from tests.oracle import rel_err

TOL = 1e-4
OPS = torch.ops.hdla_vision
cpu_path = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                              reason="the CPU path (PyTorch chunk form); this process interprets the kernels")
CHECKS = "tests/bidirectional_checks.py"
INTERPRETED = ["test_hdla_bidirectional_matches_float64_loop", "test_generalized_bidirectional_matches_float64_loop",
               "test_fast_gates_take_the_levels_in_both_directions", "test_sliced_backward_matches_float64_loop",
               "test_fake_outputs_match_the_fused_path",
               "test_chunk16_runs_the_two_scans", "test_chunk16_generalized_combines_the_directions[shared_kv]",
               "test_chunk16_generalized_combines_the_directions[stacked_k]", "test_combine_kernels_equal_their_definition"]


@pytest.fixture(scope="module")
def interpreted_outcomes():
    """``{check name: PASSED / FAILED / ...}`` and the subprocess's output."""
    return run_interpreted_checks(CHECKS)


@pytest.mark.interpret
@pytest.mark.parametrize("name", INTERPRETED)
def test_chunk64_interpreted(interpreted_outcomes, name):
    outcomes, log = interpreted_outcomes
    assert outcomes.get(name) == "PASSED", f"{name}: {outcomes.get(name, 'not run')}\n{log}"


def _assert_close(errors, expected_names):
    assert set(expected_names) <= set(errors), errors
    bad = {name: err for name, err in errors.items() if not err < TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


# ----------------------------------------------------------------------------- the op on the CPU
@cpu_path
def test_hdla_equals_the_two_scans_on_the_chunk_form():
    """Batch 1, T = 37 (not a multiple of the chunk), initial states, gates to -20, beta at 0 and 2."""
    p = bidirectional_problem("hdla", 1, 37, 2, 8, 6, g_min=-20.0, beta_ends=True)
    errors = compare_bidirectional(chunk_hdla_bidirectional, "hdla", p, scale=0.7)
    _assert_close(errors, ["y", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dinitial_state"])


# (stacked inputs, r_kv, r_ab, decay per head, initial states)
GENERALIZED = {
    "rab2_stacked_kab_scalar": (("k", "a", "b"), 1, 2, True, True),
    "rab1_stacked_ka_shared_vb": (("k", "a"), 1, 1, False, True),
    "rab0_shared_k_noh0": ((), 1, 0, False, False),  # GLA: only g differs by direction
    "rkv2_stacked_v": (("v", "b"), 2, 1, False, True),
}


@cpu_path
@pytest.mark.parametrize("case", list(GENERALIZED))
def test_generalized_equals_the_two_scans_on_the_chunk_form(case):
    stacked, r_kv, r_ab, per_head, h0 = GENERALIZED[case]
    p = bidirectional_problem("generalized", 2, 37, 2, 8, 6, stacked=stacked, r_kv=r_kv, r_ab=r_ab, g_min=-20.0,
                              h0=h0, per_head_g=per_head)
    errors = compare_bidirectional(chunk_generalized_bidirectional, "generalized", p, scale=0.7)
    names = ["y", "final_state", "dq", "dk", "dv", "dg"] + (["da", "db"] if r_ab else [])
    _assert_close(errors, names + (["dinitial_state"] if h0 else []))


@cpu_path
def test_outputs_and_final_states():
    """y in q's dtype, the final states ``[2, B, H, K, V]`` only when asked for."""
    p = {n: None if x is None else x.float() for n, x in bidirectional_problem("hdla", 2, 9, 3, 4, 5).items()}
    args = (p["q"], p["k"], p["v"], p["beta"], p["g"])
    y, state = chunk_hdla_bidirectional(*args, initial_state=p["initial_state"], output_final_state=True)
    assert y.shape == (2, 9, 3, 5) and y.dtype == torch.float32 and state.shape == (2, 2, 3, 4, 5)
    assert chunk_hdla_bidirectional(*args)[1] is None


# ----------------------------------------------------------------------------- argument checks
def _hdla_args():
    p = {n: None if x is None else x.float() for n, x in bidirectional_problem("hdla", 2, 9, 1, 4, 4).items()}
    return dict(q=p["q"], k=p["k"], v=p["v"], beta=p["beta"], g=p["g"], initial_state=p["initial_state"])


def _generalized_args():
    p = bidirectional_problem("generalized", 2, 9, 1, 4, 4, stacked=("k",))
    return {n: None if x is None else x.float() for n, x in p.items()}


@pytest.mark.parametrize("change, match", [
    (lambda a: dict(beta=a["beta"][0]), r"beta must have shape \[2, B, T, H\]"),
    (lambda a: dict(g=a["g"][1]), r"g must have shape \[2, B, T, H, K\]"),
    (lambda a: dict(initial_state=a["initial_state"][0]), r"initial_state must have shape \[2, B, H, K, V\]"),
    (lambda a: dict(k=torch.stack([a["k"], a["k"]])), r"k must have shape \[B, T, H, K\]"),
    (lambda a: dict(v=a["v"][:, :5]), r"v must have shape \[B, T, H, V\]"),
    (lambda a: dict(k=a["k"].double()), "k has dtype torch.float64; expected q's dtype"),
    (lambda a: dict(g=a["g"].abs()), "g is a log-decay and must be <= 0"),
])
def test_hdla_bad_arguments_raise(change, match):
    args = _hdla_args()
    with pytest.raises(ValueError, match=match):
        chunk_hdla_bidirectional(**dict(args, **change(args)))


@pytest.mark.parametrize("change, match", [
    (lambda a: dict(k=torch.cat([a["k"], a["k"][:1]])), r"k must have shape .* or \[2, B, T, H, r_kv, K\]"),
    (lambda a: dict(v=a["v"][..., 0, :]), r"v must have shape \[B, T, H, r, D\] \(shared\)"),
    (lambda a: dict(a=a["a"][:, :5]), r"a must have shape \[B, T, H, r_ab, K\]"),
    (lambda a: dict(b=torch.cat([a["b"]] * 2, dim=-2)), r"b must have shape .*same r_ab as a"),
    (lambda a: dict(g=a["g"][0]), r"g must have shape \[2, B, T, H, K\]"),
    (lambda a: dict(initial_state=a["initial_state"][1]), r"initial_state must have shape \[2, B, H, K, V\]"),
    (lambda a: dict(a=a["a"].half()), "a has dtype torch.float16; expected q's dtype"),
])
def test_generalized_bad_arguments_raise(change, match):
    args = _generalized_args()
    with pytest.raises(ValueError, match=match):
        chunk_generalized_bidirectional(**dict(args, **change(args)))


# ----------------------------------------------------------------------------- the mixers
BIDIRECTIONAL_MIXERS = ["hdla", "hdla_authors", "gla", "deltanet", "gated_deltanet", "gated_deltaproduct", "kda",
                        "rwkv7", "hih_deltanet", "hih_gated_deltanet"]


def _mix_and_grads(mixer, x, path):
    """y of ``path`` (bidirectional_scan or two_scans) and the gradients of x and every parameter."""
    mixer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    q, k, v = mixer.projections(x)
    fwd, bwd = (mixer.features(x, q, k, v, gates) for gates in mixer.directions)
    y = getattr(mixer, path)(q, fwd, bwd)
    y.square().sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}


@cpu_path
@pytest.mark.parametrize("name", BIDIRECTIONAL_MIXERS)
def test_mixer_op_path_equals_its_definition(name):
    """``bidirectional_scan`` (the op) against ``two_scans`` (forward scan + reversed scan - own write):
    y and the gradients of x and every parameter, equal to float64 rounding."""
    torch.manual_seed(0)
    mixer = create_mixer(name, dim=32, num_heads=2, directions=("fwd", "bwd")).double()
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    y, dx, grads = _mix_and_grads(mixer, x, "bidirectional_scan")
    y_ref, dx_ref, grads_ref = _mix_and_grads(mixer, x, "two_scans")
    assert rel_err(y, y_ref) < 1e-12 and rel_err(dx, dx_ref) < 1e-12
    assert grads.keys() == grads_ref.keys() and len(grads) > 3
    bad = {n: rel_err(grads[n], grads_ref[n]) for n in grads if not rel_err(grads[n], grads_ref[n]) < 1e-12}
    assert not bad, bad


@cpu_path
def test_mixer_forward_calls_the_op(monkeypatch):
    """The mixer's forward runs its sum through the bidirectional op, not two scans."""
    import hdla_vision.layers.hdla as hdla_layer

    calls = []
    real = hdla_layer.chunk_hdla_bidirectional
    monkeypatch.setattr(hdla_layer, "chunk_hdla_bidirectional", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(hdla_layer, "chunk_hdla", None)  # a call to the single-direction op would fail
    create_mixer("hdla", dim=16, num_heads=2, directions=("fwd", "bwd"))(torch.randn(1, 5, 16))
    assert calls == [1]


@cpu_path
@pytest.mark.parametrize("name", ["hdla", "hdla_authors"])
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_hdla_fused_prologue_equals_the_unfused_definition(name, qkv_bias):
    """HDLA's ``mix`` (three GEMMs and the fused prologue op, layers/hdla.py) against the base class's
    (the projections, gate modules and activations one by one): y and the gradients of x and every
    parameter, equal to float64 rounding; the forward runs the prologue op once."""
    from hdla_vision.layers.mixer import LinearAttentionMixer

    torch.manual_seed(0)
    mixer = create_mixer(name, dim=32, num_heads=2, directions=("fwd", "bwd"), qkv_bias=qkv_bias).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    runs = []
    for mix in (mixer.mix, partial(LinearAttentionMixer.mix, mixer)):
        mixer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        y = mix(leaf)
        y.square().sum().backward()
        runs.append((y.detach(), leaf.grad, {n: p.grad.clone() for n, p in mixer.named_parameters()
                                             if p.grad is not None}))
    (y, dx, grads), (y_ref, dx_ref, grads_ref) = runs
    assert rel_err(y, y_ref) < 1e-12 and rel_err(dx, dx_ref) < 1e-12
    assert grads.keys() == grads_ref.keys() and len(grads) > 8
    bad = {n: rel_err(grads[n], grads_ref[n]) for n in grads if not rel_err(grads[n], grads_ref[n]) < 1e-12}
    assert not bad, bad


# ----------------------------------------------------------------------------- torch.compile
@cpu_path
@pytest.mark.parametrize("name, op", [("hdla", "chunk_hdla_bidirectional"),
                                      ("kda", "chunk_generalized_bidirectional")])
def test_compiled_mixer_is_one_op_node_and_equals_eager(name, op):
    """fullgraph=True: one graph, one bidirectional node in the forward graph and one backward node in the
    backward graph (no single-direction op left), the same y and input gradient as eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mixer = create_mixer(name, dim=32, num_heads=2, directions=("fwd", "bwd"))
    x = torch.randn(2, 37, 32)
    capture = GraphCapture()
    results = []
    for fn in (mixer, torch.compile(mixer, backend=capture, fullgraph=True)):
        leaf = x.clone().requires_grad_()
        y = fn(leaf)
        y.square().sum().backward()
        results.append((y.detach(), leaf.grad))
    assert len(capture.dynamo) == len(capture.forward) == len(capture.backward) == 1
    assert count_nodes(capture.forward, getattr(OPS, op).default) == 1
    assert count_nodes(capture.backward, getattr(OPS, op + "_backward").default) == 1
    single = "chunk_hdla" if name == "hdla" else "chunk_generalized"
    assert count_nodes(capture.forward, getattr(OPS, single).default) == 0
    (y_eager, dx_eager), (y_compiled, dx_compiled) = results
    torch.testing.assert_close(y_compiled, y_eager)
    torch.testing.assert_close(dx_compiled, dx_eager)


@cpu_path
def test_opcheck_on_the_chunk_form():
    """Schema, autograd registration, fake implementations and AOT dispatch of both ops (CPU path)."""
    p = {n: None if x is None else x.float().requires_grad_() for n, x in bidirectional_problem("hdla", 1, 9, 1, 4, 4).items()}
    torch.library.opcheck(OPS.chunk_hdla_bidirectional, (p["q"], p["k"], p["v"], p["beta"], p["g"], 1.0,
                                                         p["initial_state"], True))
    p = bidirectional_problem("generalized", 1, 9, 1, 4, 4, stacked=("k", "b"), per_head_g=True, h0=False)
    p = {n: None if x is None else x.float().requires_grad_() for n, x in p.items()}
    torch.library.opcheck(OPS.chunk_generalized_bidirectional, (p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], 0.5,
                                                                None, False))
