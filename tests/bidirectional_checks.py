"""The bidirectional ops on the chunk64 kernels (``HDLA_VISION_KERNELS=chunk64``: both directions in one
launch per stage, kernels/README.md §9) under ``TRITON_INTERPRET=1`` on CPU in fp32, against the float64
token loops (forward scan + reversed scan - the reversed scan's own write): y, both final states and
every gradient to a relative error < 1e-4 (T not a multiple of the chunk, batch 1, initial states, gates
down to -20, HDLA's beta at 0 and 2; stacked and shared inputs, a decay per head); the fake
implementations against the real outputs (``torch.library.opcheck``'s fake-tensor test).

Run by tests/test_bidirectional.py in a pytest subprocess started with ``TRITON_INTERPRET=1`` (Triton
decides at decoration time whether a kernel is interpreted). Not collected on its own (no ``test_`` prefix)."""
import pytest
import torch

from hdla_vision.kernels import bidirectional_ops, chunk_generalized_bidirectional, chunk_hdla_bidirectional
from tests.bidirectional_oracle import bidirectional_problem, compare_bidirectional

TOL = 1e-4


@pytest.fixture
def fused_launches(monkeypatch):
    """The chunk64 family on CPU tensors (interpreted); yields the list of fused output launches (one
    entry per ``fwd.chunk_output_bidir`` call), so that a check knows the fused path ran."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from hdla_vision.kernels.generalized import fwd

    assert isinstance(tl.cumsum, InterpretedFunction), "start this module's process with TRITON_INTERPRET=1"
    monkeypatch.setenv("HDLA_VISION_KERNELS", "chunk64")
    launches = []
    real = fwd.chunk_output_bidir
    monkeypatch.setattr(fwd, "chunk_output_bidir", lambda *args, **kw: launches.append(1) or real(*args, **kw))
    return launches


def _assert_close(errors, expected_names):
    assert set(expected_names) <= set(errors), errors
    bad = {name: err for name, err in errors.items() if not err < TOL}  # NaN fails too
    assert not bad, f"relative errors above {TOL}: {bad}"


@pytest.mark.interpret
def test_hdla_bidirectional_matches_float64_loop(fused_launches):
    """Batch 1, T = 40 (chunks of 32: the reversed scan's first chunk starts with 24 identity steps),
    initial states, g uniform in [-20, 0], beta at 0 and 2 on two thirds of the tokens."""
    p = bidirectional_problem("hdla", 1, 40, 1, 8, 6, g_min=-20.0, beta_ends=True)
    errors = compare_bidirectional(chunk_hdla_bidirectional, "hdla", p, scale=0.7)
    assert fused_launches == [1]
    _assert_close(errors, ["y", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dinitial_state"])


@pytest.mark.interpret
def test_generalized_bidirectional_matches_float64_loop(fused_launches):
    """r_ab = 1 with k, a stacked by direction, v and b shared, a decay per head, batch 2, T = 40."""
    p = bidirectional_problem("generalized", 2, 40, 1, 8, 6, stacked=("k", "a"), per_head_g=True)
    errors = compare_bidirectional(chunk_generalized_bidirectional, "generalized", p, scale=0.7)
    assert fused_launches == [1]
    _assert_close(errors, ["y", "final_state", "dq", "dk", "dv", "da", "db", "dg", "dinitial_state"])


def _leaves(problem):
    return {n: None if x is None else x.float().requires_grad_() for n, x in problem.items()}


@pytest.mark.interpret
def test_fake_outputs_match_the_fused_path(fused_launches):
    """The fake implementations (x = h [2, B, H, NT, K, V] on the fused path) against real outputs."""
    p = _leaves(bidirectional_problem("hdla", 1, 20, 1, 8, 4))
    args = (p["q"], p["k"], p["v"], p["beta"], p["g"], 1.0, p["initial_state"], True)
    torch.library.opcheck(bidirectional_ops.chunk_hdla_bidirectional_op, args, test_utils=("test_faketensor",))
    _, _, x = bidirectional_ops.chunk_hdla_bidirectional_op(*args)
    assert tuple(x.shape) == (2, 1, 1, 1, 8, 4) and x.dtype == torch.float32
    p = _leaves(bidirectional_problem("generalized", 1, 20, 1, 8, 4, stacked=("k",), r_ab=0, h0=False))
    args = (p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], 0.5, None, False)
    torch.library.opcheck(bidirectional_ops.chunk_generalized_bidirectional_op, args, test_utils=("test_faketensor",))
    assert len(fused_launches) >= 2


@pytest.mark.interpret
def test_chunk16_runs_the_two_scans(monkeypatch):
    """On the chunk16 family the op is the two single-direction kernels' calls and the correction
    (the unfused path, x the two directions' X reads stacked), same semantics: HDLA at T = 20."""
    monkeypatch.setenv("HDLA_VISION_KERNELS", "chunk16")
    p = bidirectional_problem("hdla", 1, 20, 1, 8, 4, g_min=-20.0, beta_ends=True)
    errors = compare_bidirectional(chunk_hdla_bidirectional, "hdla", p, scale=0.7)
    _assert_close(errors, ["y", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dinitial_state"])
    leaves = _leaves(p)
    _, _, x = bidirectional_ops.chunk_hdla_bidirectional_op(leaves["q"], leaves["k"], leaves["v"], leaves["beta"],
                                                            leaves["g"], 1.0, None, False)
    assert tuple(x.shape) == (2, 1, 20, 1, 2, 4)  # each direction's X = S^T B reads, [B, T, H, 2, V]
