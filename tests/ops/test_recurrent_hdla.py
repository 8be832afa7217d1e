"""HDLA's token recurrence with its Triton backward (kernels/hdla/fused_recurrent.py), and the chunk
ops' recurrent path through it (kernels/README.md §11), on the Triton backends (tests/backends.py):
the output, the final state and every gradient against the float64 loop (V split over several
programs, head dims that are not powers of 2, T = 1, reversed scans, initial states, gates to -20,
beta at 0 and 2, resets); which op a chunk_hdla / chunk_hdla_bidirectional call runs, with and without
gradients; the bidirectional recurrence (both directions in one launch each way) against its definition,
every gradient included; opcheck; torch.compile."""
import pytest
import torch
from torch._dynamo.utils import counters

from hdla_vision.kernels import chunk_hdla, chunk_hdla_bidirectional, naive_hdla, utils
from hdla_vision.kernels.bidirectional_ops import (fused_recurrent_hdla_bidirectional_backward_op,
                                                   fused_recurrent_hdla_bidirectional_op)
from tests.backends import CUDA_TOL, backend_cases, backends, on_backend
from tests.ops.compiled import assert_compiled_equals_eager
from tests.op_calls import OurOpCalls
from tests.oracle import LoopCase, case_name, compare_with_loop, hdla_problem, hdla_recurrence, rel_err

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def recurrence_at_test_sizes(monkeypatch):
    """The small problems here walk a handful of sequences, fewer than RECURRENT_MIN_SEQUENCES: let the
    recurrence run them (test_which_op_chunk_hdla_runs checks the limit itself)."""
    monkeypatch.setattr(utils, "RECURRENT_MIN_SEQUENCES", 1)


def _beta_ends(problem: dict) -> dict:
    """beta exactly 0 on every third token and 2 on the next (the ends of its range)."""
    beta = problem["beta"].clone()
    beta[:, 0::3], beta[:, 1::3] = 0.0, 2.0
    return {**problem, "beta": beta}


def _case(name, batch, seq_len, heads, dk, dv, g_min=-3.0, h0=True, resets=0.0, dtype=F32, tol=1e-4, **op):
    problem = dict(batch=batch, seq_len=seq_len, heads=heads, dk=dk, dv=dv, g_min=g_min, h0=h0, resets=resets)
    return LoopCase(name, problem, op, dtype, tol)


INTERPRETER_CASES = [  # CHECKPOINT_EVERY = 4 and V-blocks of 16: T not a multiple of 4, V over several blocks
    _case("B2_T23_H2_K16_V40", 2, 23, 2, 16, 40, scale=0.5),
    _case("B1_T1_no_h0", 1, 1, 1, 16, 16, h0=False),
    _case("B1_T9_K24_rev_gates-20_beta_0_2", 1, 9, 1, 24, 16, g_min=-20.0, reverse=True),
    _case("B1_T14_rev_resets_beta_0_2", 1, 14, 2, 16, 8, resets=0.15, reverse=True),
]
CUDA_CASES = [
    _case("vision_bf16", 2, 196, 3, 64, 64, dtype=BF16, tol=CUDA_TOL),
    _case("vision_bf16_rev_gates-20_beta_0_2", 2, 196, 3, 64, 64, g_min=-20.0, dtype=BF16, tol=CUDA_TOL, reverse=True),
    _case("K128_V96_bf16", 1, 77, 2, 128, 96, dtype=BF16, tol=CUDA_TOL),
    _case("K256_fp32_beta_0_2", 1, 33, 1, 256, 256, tol=CUDA_TOL),
    _case("K16_V32_fp32_resets", 2, 50, 2, 16, 32, resets=0.1, tol=CUDA_TOL),
]


@pytest.mark.parametrize("backend,case", backend_cases(case_name, interpreter=INTERPRETER_CASES, cuda=CUDA_CASES),
                         indirect=["backend"])
def test_recurrence_matches_float64_loop(backend, case):
    """Output, final state and every gradient (the Triton backward) against the float64 token loop; in the
    cases named ``beta_0_2`` beta is exactly 0 on every third token and 2 on the next."""
    problem = hdla_problem(**case.problem)
    inputs = on_backend(_beta_ends(problem) if case.name.endswith("beta_0_2") else problem, backend)
    errors = compare_with_loop(hdla_recurrence, "hdla", inputs, dtype=case.dtype, **case.op)
    assert all(err < case.tol for err in errors.values()), errors  # NaN fails


def _grad_inputs(backend, batch=2, seq_len=11, heads=2, dk=16, dv=16, requires_grad=False):
    p = on_backend({n: x.float() for n, x in hdla_problem(batch, seq_len, heads, dk, dv).items()}, backend)
    return {n: x.requires_grad_(requires_grad) for n, x in p.items()}


def _calls(fn, **kw):
    """The hdla_vision ops ``fn(**kw)`` calls, without the namespace."""
    with OurOpCalls() as ops:
        fn(**kw)
    return {name.removeprefix("hdla_vision::") for name in ops.calls}


@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
def test_which_op_chunk_hdla_runs(backend, monkeypatch):
    """Under the auto setting the recurrence runs up to RECURRENT_MAX_TOKENS tokens without gradients and up
    to RECURRENT_TRAIN_MAX_TOKENS with them, above RECURRENT_SHORT_TOKENS tokens only for at least
    RECURRENT_MIN_SEQUENCES sequences (batch x heads x directions); a longer sequence, fewer sequences past the
    short length, a wider head or a named kernel family run the chunk op."""
    monkeypatch.delenv(utils.KERNEL_FAMILY_ENV, raising=False)
    p = _grad_inputs(backend)
    seq_len = p["q"].shape[1]
    with torch.no_grad():
        assert _calls(chunk_hdla, **p) == {"fused_recurrent_hdla"}
        for name, value in (("RECURRENT_MAX_TOKENS", seq_len - 1), ("RECURRENT_MAX_HEAD_DIM", p["q"].shape[-1] - 1)):
            with monkeypatch.context() as patch:
                patch.setattr(utils, name, value)
                assert _calls(chunk_hdla, **p) == {"chunk_hdla"}, name
        with monkeypatch.context() as patch:
            patch.setattr(utils, "RECURRENT_TRAIN_MAX_TOKENS", seq_len - 1)  # the training limit: not without grad
            assert _calls(chunk_hdla, **p) == {"fused_recurrent_hdla"}
        with monkeypatch.context() as patch:
            patch.setenv(utils.KERNEL_FAMILY_ENV, "chunk64")
            assert _calls(chunk_hdla, **p) == {"chunk_hdla"}
    p["v"].requires_grad_()
    assert _calls(chunk_hdla, **p) == {"fused_recurrent_hdla"}
    for name in ("RECURRENT_TRAIN_MAX_TOKENS", "RECURRENT_MAX_HEAD_DIM"):
        with monkeypatch.context() as patch:
            patch.setattr(utils, name, seq_len - 1 if name == "RECURRENT_TRAIN_MAX_TOKENS" else p["q"].shape[-1] - 1)
            assert _calls(chunk_hdla, **p) == {"chunk_hdla"}, name
    with monkeypatch.context() as patch:
        patch.setattr(utils, "RECURRENT_MAX_TOKENS", seq_len - 1)  # the inference limit: not with grad
        assert _calls(chunk_hdla, **p) == {"fused_recurrent_hdla"}
    sequences = p["q"].shape[0] * p["q"].shape[2]
    with monkeypatch.context() as patch:
        patch.setattr(utils, "RECURRENT_MIN_SEQUENCES", sequences + 1)
        assert _calls(chunk_hdla, **p) == {"fused_recurrent_hdla"}  # a short sequence: the walk at any batch
        patch.setattr(utils, "RECURRENT_SHORT_TOKENS", seq_len - 1)  # longer: too few sequences walked at once
        assert _calls(chunk_hdla, **p) == {"chunk_hdla"}
        with torch.no_grad():
            assert _calls(chunk_hdla, **p) == {"chunk_hdla"}
    both = {n: x.requires_grad_() for n, x in _bidirectional_inputs(backend).items()}
    assert _calls(chunk_hdla_bidirectional, **both) == {"fused_recurrent_hdla_bidirectional"}
    with monkeypatch.context() as patch:
        patch.setattr(utils, "RECURRENT_TRAIN_MAX_TOKENS", both["q"].shape[1] - 1)
        assert _calls(chunk_hdla_bidirectional, **both) == {"chunk_hdla_bidirectional"}
    both_sequences = 2 * both["q"].shape[0] * both["q"].shape[2]  # both directions count
    with monkeypatch.context() as patch:
        patch.setattr(utils, "RECURRENT_SHORT_TOKENS", both["q"].shape[1] - 1)
        patch.setattr(utils, "RECURRENT_MIN_SEQUENCES", both_sequences)
        assert _calls(chunk_hdla_bidirectional, **both) == {"fused_recurrent_hdla_bidirectional"}
        patch.setattr(utils, "RECURRENT_MIN_SEQUENCES", both_sequences + 1)
        assert _calls(chunk_hdla_bidirectional, **both) == {"chunk_hdla_bidirectional"}


def test_cpu_without_interpreter_keeps_the_chunk_form():
    """Plain CPU tensors: no Triton, so no recurrence; the chunk op (its PyTorch form) runs."""
    with torch.no_grad():
        assert _calls(chunk_hdla, **_grad_inputs("torch")) == {"chunk_hdla"}


def _bidirectional_inputs(backend, batch=2, seq_len=13, heads=2, dk=16, dv=24, dtype=F32, g_min=-3.0):
    p = hdla_problem(batch, seq_len, heads, dk, dv, g_min=g_min)
    second = hdla_problem(batch, seq_len, heads, dk, dv, seed=1, g_min=g_min)  # the reversed scan's gates
    p.update({n: torch.stack([p[n], second[n]]) for n in ("beta", "g", "initial_state")})
    return on_backend({n: x.to(dtype) if n != "initial_state" else x.float() for n, x in p.items()}, backend)


def _bidirectional_reference(p, scale):
    """The definition: forward scan + reversed scan - the own write, in float64."""
    d = {n: x.double() for n, x in p.items()}
    o_f, s_f = naive_hdla(d["q"], d["k"], d["v"], d["beta"][0], d["g"][0], scale, d["initial_state"][0], True)
    o_b, s_b = naive_hdla(d["q"], d["k"], d["v"], d["beta"][1], d["g"][1], scale, d["initial_state"][1], True,
                          reverse=True)
    own = scale * (d["q"] * d["k"]).sum(-1, keepdim=True) * d["v"]
    return o_f + o_b - own, torch.stack([s_f, s_b])


@pytest.mark.parametrize("backend,case", backend_cases(
    lambda c: c[0], interpreter=[("T13_V24", dict(), F32, 1e-4)],
    cuda=[("vision_bf16_gates-20", dict(seq_len=196, heads=3, dk=64, dv=64, g_min=-20.0), BF16, CUDA_TOL),
          ("T1024_fp32", dict(batch=1, seq_len=1024, heads=1, dk=64, dv=64), F32, CUDA_TOL)]),
    indirect=["backend"])
def test_bidirectional_inference_equals_its_definition(backend, case):
    """chunk_hdla_bidirectional under no_grad runs both recurrences in one op: y (own write counted once)
    and both final states against the float64 loops."""
    _, shape, dtype, tol = case
    p = _bidirectional_inputs(backend, dtype=dtype, **shape)
    with torch.no_grad(), OurOpCalls() as ops:
        y, states = chunk_hdla_bidirectional(**p, scale=0.5, output_final_state=True)
    assert set(ops.calls) == {"hdla_vision::fused_recurrent_hdla_bidirectional"}
    y_ref, s_ref = _bidirectional_reference(p, 0.5)
    assert y.dtype == dtype and states.dtype == dtype
    assert rel_err(y, y_ref) < tol and rel_err(states, s_ref) < tol


@pytest.mark.parametrize("backend,case", backend_cases(
    lambda c: c[0], interpreter=[("T13_V24_beta_0_2", dict(), F32, 1e-4),
                                 ("T6_K24_gates-20", dict(batch=1, seq_len=6, dk=24, dv=16, g_min=-20.0), F32, 1e-4)],
    cuda=[("vision_bf16_gates-20", dict(seq_len=196, heads=3, dk=64, dv=64, g_min=-20.0), BF16, CUDA_TOL),
          ("T300_V96_bf16", dict(batch=1, seq_len=300, heads=2, dk=64, dv=96), BF16, CUDA_TOL),
          ("T77_K128_fp32", dict(batch=1, seq_len=77, heads=1, dk=128, dv=64), F32, CUDA_TOL)]),
    indirect=["backend"])
def test_bidirectional_recurrence_gradients_equal_its_definition(backend, case):
    """The recurrent bidirectional op with its backward (one launch for both directions): y, both final
    states and the gradients of q, k, v, both betas and gates and both initial states against autograd
    through the float64 definition; in the cases named ``beta_0_2`` beta is exactly 0 on every third token
    and 2 on the next."""
    name, shape, dtype, tol = case
    p = _bidirectional_inputs(backend, dtype=dtype, **shape)
    if name.endswith("beta_0_2"):
        p["beta"][:, :, 0::3], p["beta"][:, :, 1::3] = 0.0, 2.0
    leaves = {n: x.detach().requires_grad_() for n, x in p.items()}
    y, states = fused_recurrent_hdla_bidirectional_op(*(leaves[n] for n in ("q", "k", "v", "beta", "g")), 0.5,
                                                       leaves["initial_state"])
    refs = {n: x.detach().double().requires_grad_() for n, x in p.items()}
    y_ref, s_ref = _bidirectional_reference(refs, 0.5)
    dy, dstates = torch.randn_like(y_ref), torch.randn_like(s_ref)
    torch.autograd.backward([y, states], [dy.to(y.dtype), dstates.float()])
    torch.autograd.backward([y_ref, s_ref], [dy, dstates])
    errors = {"y": rel_err(y, y_ref), "states": rel_err(states, s_ref)}
    errors.update({f"d{n}": rel_err(leaves[n].grad, refs[n].grad) for n in leaves})
    assert all(err < tol for err in errors.values()), errors  # NaN fails


@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
@pytest.mark.parametrize("every", [1, 2, 3, 8])
def test_any_checkpoint_interval_gives_the_float64_gradients(backend, every, monkeypatch):
    """The backward with a checkpoint every ``every`` tokens (``CHECKPOINT_EVERY``, a launch setting that
    benchmarks.recurrent's --bwd-configs times): every state stored (1), segments that do not divide T = 13 (2,
    3, 8), reversed, gates to -20, beta at 0 and 2, against the float64 loop."""
    from hdla_vision.kernels.hdla import fused_recurrent as rec

    monkeypatch.setattr(rec, "CHECKPOINT_EVERY", every)
    problem = _beta_ends(hdla_problem(batch=1, seq_len=13, heads=2, dk=16, dv=24, g_min=-20.0, h0=True))
    tol = 1e-4 if backend == "interpreter" else CUDA_TOL
    errors = compare_with_loop(hdla_recurrence, "hdla", on_backend(problem, backend), dtype=F32, reverse=True)
    assert all(err < tol for err in errors.values()), errors  # NaN fails


@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
@pytest.mark.parametrize("dirs", [1, 2])
def test_backward_in_batch_slices_equals_one_launch(backend, dirs, monkeypatch):
    """A batch whose transient exceeds the scratch budget runs the backward in slices of the batch (here a
    budget of two elements: slices of 2 and 1) with the gradients of one launch, initial states and state
    cotangents included (one direction reversed, and both directions)."""
    from hdla_vision.kernels.generalized import bwd
    from hdla_vision.kernels.hdla import fused_recurrent as rec

    p = _bidirectional_inputs(backend, batch=3, seq_len=6, heads=1, dk=8, dv=20, g_min=-20.0)
    q, k, v = p["q"], p["k"], p["v"]
    if dirs == 2:
        gates, h0 = (p["beta"], p["g"]), p["initial_state"]

        def backward():
            return rec.triton_fused_recurrent_hdla_bidirectional_backward(do, dht, q, k, v, *gates, 0.5, h0)
    else:
        gates, h0 = (p["beta"][1], p["g"][1]), p["initial_state"][1]

        def backward():
            return rec.triton_fused_recurrent_hdla_backward(do, dht, q, k, v, *gates, 0.5, h0, reverse=True)
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    whole = backward()
    per_element = rec.transient_bytes_per_batch(6, 1, 8, 20, dirs)
    monkeypatch.setattr(bwd, "scratch_budget_bytes", lambda: 2 * per_element)
    monkeypatch.setattr(rec, "_backward_occupancy", lambda *args: (0, 0))  # the budget alone, on CUDA too
    assert [s.stop - s.start for s in bwd.scratch_batch_slices(3, per_element)] == [2, 1]
    sliced = backward()
    assert len(sliced) == len(whole) == 6
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), sliced, whole):
        assert a.shape == b.shape and rel_err(a, b) < 1e-6, name  # NaN fails


@pytest.mark.parametrize("backend", backends("cuda"), indirect=True)
@pytest.mark.parametrize("h0", [True, False])
def test_bidirectional_recurrence_opcheck(backend, h0):
    """opcheck of the recurrent bidirectional op and of its backward op."""
    p = _bidirectional_inputs(backend, seq_len=5, dk=8, dv=4)
    p = {n: x.requires_grad_() for n, x in p.items()}
    args = (p["q"], p["k"], p["v"], p["beta"], p["g"], 0.5, p["initial_state"] if h0 else None)
    torch.library.opcheck(fused_recurrent_hdla_bidirectional_op, args)
    y, states = fused_recurrent_hdla_bidirectional_op(*args)
    plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    torch.library.opcheck(fused_recurrent_hdla_bidirectional_backward_op,
                          (torch.randn_like(y), torch.randn_like(states), *plain[:5], 0.5, plain[6]))


@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
def test_compiled_inference_equals_eager(backend):
    """The inference path under torch.compile(fullgraph=True): one graph, the eager result."""
    p = _bidirectional_inputs(backend)

    def both(q, k, v, beta, g, initial_state):
        y, _ = chunk_hdla_bidirectional(q, k, v, beta, g, initial_state=initial_state)
        o, s = chunk_hdla(q, k, v, beta[0], g[0], initial_state=initial_state[0], output_final_state=True)
        return y, o, s

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        eager = both(**p)
        compiled = torch.compile(both, fullgraph=True)(**p)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
def test_compiled_training_equals_eager(backend, monkeypatch):
    """Training on the recurrent path under torch.compile(fullgraph=True): one graph, the eager output,
    states and gradients of every input."""
    monkeypatch.delenv(utils.KERNEL_FAMILY_ENV, raising=False)
    p = _bidirectional_inputs(backend, seq_len=7, dk=8, dv=8)
    with OurOpCalls() as ops:
        chunk_hdla_bidirectional(**{n: x.detach().requires_grad_() for n, x in p.items()})
    assert set(ops.calls) == {"hdla_vision::fused_recurrent_hdla_bidirectional"}
    assert_compiled_equals_eager(lambda **kw: chunk_hdla_bidirectional(**kw, scale=0.5, output_final_state=True), p)


@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
@pytest.mark.parametrize("parts,outputs", [(8, 1), (4, 2), (1, 2)])
def test_sum_parts_sums_each_group_of_partials(backend, parts, outputs):
    """The backward's epilogue: fp32 partials [outputs * parts, ...] summed per group of consecutive parts
    and cast (more elements than one program's block, a size that is not a multiple of it)."""
    from hdla_vision.kernels.hdla.fused_recurrent import SUM_PARTS_BLOCK, sum_parts

    x = on_backend({"x": torch.randn(outputs * parts, 3, SUM_PARTS_BLOCK // 2 + 5)}, backend)["x"]
    want = x.view(outputs, parts, *x.shape[1:]).sum(1)
    got = sum_parts(x, parts, BF16)
    assert got.dtype == BF16 and got.shape == want.shape
    assert rel_err(got.float(), want) < 4e-3  # bf16 rounding of the fp32 sums
    assert rel_err(sum_parts(x, parts, F32), want) < 1e-6  # fp32: the same sums, maybe in another order


@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
def test_grouped_sum_parts_equal_one_launch_per_job(backend):
    """The backward's epilogue in one launch: five jobs of different sizes, part counts, output counts and
    dtypes give the bits of one launch each (the same fp32 sums in the same order), and wrong job counts
    are refused."""
    from hdla_vision.kernels.hdla.fused_recurrent import SUM_PARTS_BLOCK, sum_parts, sum_parts_grouped

    shapes = [(6, 2, SUM_PARTS_BLOCK + 3), (6, 5), (4, 3, 7), (2, 2, 40), (1, 9)]
    xs = on_backend({f"x{i}": torch.randn(*shape) for i, shape in enumerate(shapes)}, backend)
    jobs = [(xs["x0"], 6, BF16), (xs["x1"], 3, F32), (xs["x2"], 2, BF16), (xs["x3"], 1, F32), (xs["x4"], 1, BF16)]
    grouped = sum_parts_grouped(jobs)
    for (x, parts, dtype), got in zip(jobs, grouped):
        assert got.dtype == dtype and got.shape == (x.shape[0] // parts, *x.shape[1:])
        assert torch.equal(got, sum_parts(x, parts, dtype))
        want = x.view(-1, parts, *x.shape[1:]).sum(1)
        if dtype == BF16:  # each element the fp32 sum cast once to bf16: within one ulp (2^-7 relative; the
            # interpreter's cast truncates, the GPU's rounds to nearest)
            assert bool(((got.float() - want).abs() <= 2.0 ** -7 * want.abs() + 1e-6).all())
        else:
            assert rel_err(got, want) < 1e-6
    with pytest.raises(ValueError, match="jobs: 1 to 5"):
        sum_parts_grouped(jobs + jobs[:1])
