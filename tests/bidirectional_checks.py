"""The bidirectional ops on the chunk64 kernels (``HDLA_VISION_KERNELS=chunk64``: both directions in one
launch per stage, kernels/README.md §9) under ``TRITON_INTERPRET=1`` on CPU in fp32, against the float64
token loops (forward scan + reversed scan - the reversed scan's own write): y, both final states and
every gradient to a relative error < 1e-4 (T not a multiple of the chunk, batch 1, initial states, gates
down to -20, HDLA's beta at 0 and 2; stacked and shared inputs, a decay per head; fast-forgetting channels,
whose diagonal blocks take the levels of kernels/generalized/diag_levels.py in both scans, each path
recorded); the fake
implementations against the real outputs (``torch.library.opcheck``'s fake-tensor test).

Run by tests/test_bidirectional.py in a pytest subprocess started with ``TRITON_INTERPRET=1`` (Triton
decides at decoration time whether a kernel is interpreted). Not collected on its own (no ``test_`` prefix)."""
import pytest
import torch

from hdla_vision.kernels import bidirectional_ops, chunk_generalized_bidirectional, chunk_hdla_bidirectional
from tests.bidirectional_oracle import bidirectional_problem, compare_bidirectional
from tests.chunk64_ops_checks import count_b2_launches

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


@pytest.fixture
def diag_paths(monkeypatch):
    """The path each diagonal 16-token block took (kernels/generalized/diag_levels.py: 1 one product, 2..5
    by levels) in the fused launches: ``f1`` F1's ``diag_path [2B, H, NT, C/16]`` (batches direction-major),
    ``gram`` B2's S2 / S2b ``[2 B H NT, 4, C/16, K tiles]`` and ``gram_vjp`` S5a / S5b ``[4, 2 B H NT, C/16,
    K tiles]`` (blocks direction-major: the reversed scan's after the forward's)."""
    from hdla_vision.kernels.generalized import bwd, fwd

    taken = {}
    real_prepare, real_vjp = fwd.chunk_prepare, bwd.chunk_vjp

    def prepare(*args, **kw):
        prep = real_prepare(*args, **dict(kw, record_path=True))
        taken["f1"] = prep["diag_path"]
        return prep

    def vjp(*args, **kw):
        return real_vjp(*args, **dict(kw, diag_paths=taken))

    monkeypatch.setattr(fwd, "chunk_prepare", prepare)
    monkeypatch.setattr(bwd, "chunk_vjp", vjp)
    return taken


def _assert_levels_in_both_directions(paths, grams):
    """Some diagonal block of each direction took the levels (path >= 2) in F1 and in B2's Grams ``grams``
    (0 M_QK, 1 M_QA, 2 L_AB, 3 L_KB), forward and VJP."""
    f1, gram, gram_vjp = paths["f1"], paths["gram"], paths["gram_vjp"]
    for d in (0, 1):
        half = lambda x, n: x.narrow(0, d * (n // 2), n // 2)  # noqa: E731  direction d's batches / blocks
        assert (half(f1, f1.shape[0]) >= 2).any(), f"F1, direction {d}: {f1.flatten().tolist()}"
        for gid in grams:
            assert (half(gram[:, gid], gram.shape[0]) >= 2).any(), f"S2b, Gram {gid}, direction {d}"
            assert (half(gram_vjp[gid], gram_vjp.shape[1]) >= 2).any(), f"S5b, Gram {gid}, direction {d}"


def _assert_close(errors, expected_names):
    assert set(expected_names) <= set(errors), errors
    bad = {name: err for name, err in errors.items() if not err < TOL}  # NaN fails too
    assert not bad, f"relative errors above {TOL}: {bad}"


@pytest.mark.interpret
def test_hdla_bidirectional_matches_float64_loop(fused_launches, diag_paths):
    """Batch 1, T = 40 (chunks of 32: the reversed scan's first chunk starts with 24 identity steps),
    initial states, g uniform in [-20, 0] (diagonal blocks by levels in both directions), beta at 0 and 2
    on two thirds of the tokens."""
    p = bidirectional_problem("hdla", 1, 40, 1, 8, 6, g_min=-20.0, beta_ends=True)
    errors = compare_bidirectional(chunk_hdla_bidirectional, "hdla", p, scale=0.7)
    assert fused_launches == [1]
    _assert_close(errors, ["y", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dinitial_state"])
    _assert_levels_in_both_directions(diag_paths, grams=(0, 1, 2, 3))


@pytest.mark.interpret
def test_hdla_bidirectional_f1_single_gram(fused_launches, monkeypatch):
    """F1 from HDLA's six base Grams ($HDLA_VISION_F1_GRAM=1) in the launch of both directions: mild gates (every
    diagonal block factored, the earlier row blocks' terms well above the tolerance), T = 70 over chunks of 32."""
    monkeypatch.setenv("HDLA_VISION_F1_GRAM", "1")
    p = bidirectional_problem("hdla", 1, 70, 1, 16, 8, g_min=-0.3)
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


@pytest.mark.interpret
def test_fast_gates_take_the_levels_in_both_directions(fused_launches, diag_paths):
    """The benchmarks' fast-forgetting channels: log lambda = -20 per step on every fourth channel (both
    directions), mild gates in [-1, 0] elsewhere; r_ab = 1 with k, a stacked, batch 1, T = 40. The
    diagonal blocks of F1 and of all four B2 Grams take the levels in both scans, the reversed one's
    M_QK strictly lower (kernels/README.md §9), and the op still equals the float64 loops."""
    p = bidirectional_problem("generalized", 1, 40, 1, 8, 6, stacked=("k", "a"), g_min=-1.0)
    p["g"][..., ::4] = -20.0
    errors = compare_bidirectional(chunk_generalized_bidirectional, "generalized", p, scale=0.7)
    assert fused_launches == [1]
    _assert_close(errors, ["y", "final_state", "dq", "dk", "dv", "da", "db", "dg", "dinitial_state"])
    _assert_levels_in_both_directions(diag_paths, grams=(0, 1, 2, 3))


@pytest.mark.interpret
def test_sliced_backward_matches_float64_loop(fused_launches, monkeypatch):
    """The fused backward in batch slices (B2's scratch budget forced to 1 byte: one batch element per
    slice): the direction-stacked inputs and states sliced per direction, batch 2, r_ab = 1."""
    batches = count_b2_launches(monkeypatch)
    p = bidirectional_problem("generalized", 2, 40, 1, 8, 6, stacked=("k", "a"))
    errors = compare_bidirectional(chunk_generalized_bidirectional, "generalized", p, scale=0.7)
    assert fused_launches == [1] and batches == [1, 1], (fused_launches, batches)
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


@pytest.mark.parametrize("stacked", [("a", "b"), ("k", "a")], ids=["shared_kv", "stacked_k"])
def test_chunk16_generalized_combines_the_directions(monkeypatch, stacked):
    """The unfused path of the generalized op on chunk16: with k and v shared the two directions are summed
    and the own write subtracted by the combine kernels (bidirectional_combine.py), with k stacked by
    PyTorch; both against the float64 loops, r_kv = 2 (two writes per token), T = 21."""
    monkeypatch.setenv("HDLA_VISION_KERNELS", "chunk16")
    calls = []
    real = bidirectional_ops._combine_grads
    monkeypatch.setattr(bidirectional_ops, "_combine_grads", lambda *a: calls.append(1) or real(*a))
    p = bidirectional_problem("generalized", 1, 21, 2, 8, 12, stacked=stacked, r_kv=2, r_ab=1, g_min=-20.0)
    errors = compare_bidirectional(chunk_generalized_bidirectional, "generalized", p, scale=0.6)
    _assert_close(errors, ["y", "final_state", "dq", "dk", "dv", "da", "db", "dg", "dinitial_state"])
    assert calls == ([1] if stacked == ("a", "b") else [])


def test_combine_kernels_equal_their_definition():
    """combine_outputs / combine_grads against own_write, own_write_vjp and the sums in float64: r = 1 and
    2, head dims that are not powers of two, fp32 and bf16 inputs (rounded once)."""
    from hdla_vision.kernels.bidirectional_combine import combine_grads, combine_outputs

    gen = torch.Generator().manual_seed(0)
    for r, dk, dv, dtype, tol in ((1, 8, 12, torch.float32, 1e-6), (2, 12, 20, torch.float32, 1e-6),
                                  (1, 16, 16, torch.bfloat16, 1e-2)):
        shape = (2, 19, 3)
        q, dy, o_f, o_b = (torch.randn(*shape, n, generator=gen) for n in (dk, dv, dv, dv))
        k, v = torch.randn(*shape, r, dk, generator=gen), torch.randn(*shape, r, dv, generator=gen)
        grads = [(torch.randn(*shape, dk, generator=gen), torch.randn(*shape, r, dk, generator=gen),
                  torch.randn(*shape, r, dv, generator=gen)) for _ in range(2)]
        cast = [t.to(dtype) for t in (q, k, v, dy, o_f, o_b)]
        y = combine_outputs(cast[4], cast[5], cast[0], cast[1], cast[2], 0.7)
        exact = [t.double() for t in cast]
        y_ref = exact[4] + exact[5] - bidirectional_ops.own_write(exact[0], exact[1], exact[2], 0.7)
        assert y.dtype == dtype and ((y.double() - y_ref).norm() / y_ref.norm()).item() < tol
        parts = [tuple(t.to(dtype) for t in g) for g in grads]
        got = combine_grads(cast[3], cast[0], cast[1], cast[2], parts[0], parts[1], 0.7)
        own = bidirectional_ops.own_write_vjp(exact[3], exact[0], exact[1], exact[2], 0.7)
        for i, out in enumerate(got):
            ref = parts[0][i].double() + parts[1][i].double() - own[i]
            assert out.dtype == dtype and ((out.double() - ref).norm() / ref.norm()).item() < tol, i
