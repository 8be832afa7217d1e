"""chunk_delta_rule (kernels/delta_rule, kernels/README.md §12) against the float64 loop: the generalized loop with
a = beta k, b = e^g k and the write key write * k, and HDLA's own loop through its two steps per token (steps.py);
output, final state and every gradient, on the PyTorch form, the interpreter and CUDA."""
import pytest
import torch
import torch.nn.functional as F

from hdla_vision.kernels import chunk_hdla, chunk_hdla_bidirectional, naive_generalized, naive_hdla
from hdla_vision.kernels.utils import KERNEL_FAMILY_ENV
from hdla_vision.kernels.delta_rule import chunk as delta_chunk
from hdla_vision.kernels.delta_rule.chunk import MAX_HEAD_DIM, chunk_delta_rule
from hdla_vision.kernels.delta_rule.steps import hdla_steps
from tests.backends import CUDA_TOL, FP32_TOL, backend_cases, backends, on_backend
from tests.bidirectional_oracle import bidirectional_problem, compare_bidirectional
from tests.oracle import compare_with_loop, hdla_problem, rel_err, with_resets, worst


def delta_problem(batch, seq_len, heads, dk, dv, g_min=-3.0, h0=True, write="random", beta_ends=False, resets=0.0,
                  seed=0, per_head=False):
    """Random float64 inputs: unit k, beta in [0, 2] (with ``beta_ends``, 0 and 2 at the first steps), g in [g_min, 0]
    (a fraction ``resets`` of -inf; ``per_head``: one per head, ``[B, T, H]``), write scales random in [0, 1], ones
    or zeros."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    uniform = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    beta = 2 * uniform(batch, seq_len, heads)
    if beta_ends:
        beta[:, :3] = 0.0
        beta[:, 3:6] = 2.0
    writes = dict(random=uniform(batch, seq_len, heads), ones=torch.ones(batch, seq_len, heads, dtype=torch.float64),
                  zeros=torch.zeros(batch, seq_len, heads, dtype=torch.float64))
    return dict(q=rnd(batch, seq_len, heads, dk), k=F.normalize(rnd(batch, seq_len, heads, dk), dim=-1),
                v=rnd(batch, seq_len, heads, dv), beta=beta,
                g=with_resets(uniform(batch, seq_len, heads, *(() if per_head else (dk,))) * g_min, resets, gen),
                write=writes[write],
                initial_state=rnd(batch, heads, dk, dv) if h0 else None)


def reference(p, scale, reverse=False):
    """The generalized float64 loop on the delta rule's factors."""
    k = p["k"]
    g = p["g"] if p["g"].dim() == 4 else p["g"].unsqueeze(-1).expand(k.shape)  # per head: dg sums over K
    a = (p["beta"].unsqueeze(-1) * k).unsqueeze(3)
    b = (g.exp() * k).unsqueeze(3)
    return naive_generalized(p["q"], (p["write"].unsqueeze(-1) * k).unsqueeze(3), p["v"].unsqueeze(3), a, b, g,
                             scale=scale, initial_state=p["initial_state"], output_final_state=True, reverse=reverse)


NAMES = ("q", "k", "v", "beta", "g", "write", "initial_state")


def _errors(p, backend, dtype, scale=0.5, reverse=False, recompute=False, precision=None):
    """Relative errors of the output, the final state and every gradient (random cotangents on both outputs), against
    the float64 loop on the same inputs: rounded to ``dtype`` (g at least fp32, as the mixers' gates are)."""
    names = [n for n in NAMES if p[n] is not None]
    gate_dtype = torch.promote_types(dtype, torch.float32)
    leaves = {n: p[n].to(gate_dtype if n == "g" else dtype).requires_grad_() for n in names}
    run = on_backend(leaves, backend)
    o, s = chunk_delta_rule(**{n: run.get(n) for n in NAMES}, scale=scale, output_final_state=True, reverse=reverse,
                            recompute=recompute, precision=precision)
    exact = {n: leaves[n].detach().double().clone().requires_grad_() for n in names}
    o_ref, s_ref = reference({**p, **exact}, scale, reverse)
    gen = torch.Generator().manual_seed(1)
    do, ds = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (o_ref, s_ref))
    got = torch.autograd.grad((o.double().cpu() * do).sum() + (s.double().cpu() * ds).sum(), list(leaves.values()))
    ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), list(exact.values()))
    errors = {"o": rel_err(o.double().cpu(), o_ref), "state": rel_err(s.double().cpu(), s_ref)}
    errors.update({f"d{n}": rel_err(a.double().cpu(), b) for n, a, b in zip(names, got, ref)})
    return errors


SMALL = [  # (name, problem kwargs): lengths around the 64-step chunk, batch 1, -20 gates and resets, beta at 0 and 2
    ("T1_b1", dict(batch=1, seq_len=1, heads=2, dk=16, dv=8)),
    ("T17_no_h0", dict(batch=2, seq_len=17, heads=2, dk=16, dv=8, h0=False)),
    ("T64_ones", dict(batch=1, seq_len=64, heads=1, dk=32, dv=16, write="ones")),
    ("T130_gates-20_resets_beta_ends", dict(batch=2, seq_len=130, heads=1, dk=16, dv=20, g_min=-20.0, resets=0.05,
                                            beta_ends=True)),
    ("T65_no_write", dict(batch=1, seq_len=65, heads=2, dk=16, dv=8, write="zeros")),
    # K = 48: two 32-column blocks in the chunk kernels, the second half past K
    ("T70_d48_gates-20", dict(batch=1, seq_len=70, heads=1, dk=48, dv=24, g_min=-20.0)),
    # one log-decay per head (the kernels' scalar specialisation), with -20 gates, resets and two K blocks
    ("T130_per_head_gates-20_resets", dict(batch=2, seq_len=130, heads=1, dk=16, dv=8, g_min=-20.0, resets=0.05,
                                           per_head=True)),
    ("T70_d48_per_head", dict(batch=1, seq_len=70, heads=2, dk=48, dv=24, per_head=True, beta_ends=True)),
]
LARGE = [("T300_d64", dict(batch=2, seq_len=300, heads=3, dk=64, dv=64, g_min=-20.0, beta_ends=True)),
         ("T200_d128", dict(batch=1, seq_len=200, heads=2, dk=128, dv=128)),
         ("T300_d64_per_head", dict(batch=2, seq_len=300, heads=3, dk=64, dv=64, g_min=-20.0, per_head=True)),
         ("T200_d128_per_head", dict(batch=1, seq_len=200, heads=2, dk=128, dv=128, per_head=True))]


def _case_id(case):
    return case[0]


@pytest.mark.parametrize("backend,case", backend_cases(_case_id, torch=SMALL, interpreter=SMALL, cuda=LARGE),
                         indirect=["backend"])
def test_matches_the_float64_loop(backend, case):
    """fp32 inputs on the CPU (exact products: < 1e-4), bf16 on the GPU (tf32 products, its default there)."""
    errors = _errors(delta_problem(**case[1]), backend, torch.bfloat16 if backend == "cuda" else torch.float32)
    tol = CUDA_TOL if backend == "cuda" else FP32_TOL
    assert worst(errors) < tol, errors  # NaN fails too


@pytest.mark.parametrize("backend", backends("cuda"), indirect=True)
def test_fp32_inputs_take_exact_products_on_the_gpu(backend):
    """fp32 inputs on the GPU: exact fp32 products by default (tf32 put mixers' gate-weight gradients 1-3e-2 off)."""
    errors = _errors(delta_problem(1, 200, 2, 64, 64, g_min=-20.0, beta_ends=True), backend, torch.float32)
    assert worst(errors) < 1e-3, errors


RECOMPUTE_CASES = [case for case in SMALL if case[0] in ("T130_gates-20_resets_beta_ends", "T70_d48_per_head")]
# the interpreter's casts to bf16 truncate (the GPU rounds to nearest), which about doubles the bf16 path's error there
EMULATED_BF16_TOL = 2e-2


@pytest.mark.parametrize("precision,recompute", [("bf16", False), ("bf16", True), ("bf16_dc", False)],
                         ids=["bf16", "bf16-recompute", "bf16_dc"])
@pytest.mark.parametrize("backend,case", backend_cases(_case_id, interpreter=RECOMPUTE_CASES, cuda=LARGE),
                         indirect=["backend"])
def test_bf16_state_path_matches_the_float64_loop(backend, case, precision, recompute):
    """``precision="bf16"``: the state path (S, O, dO, dS) on bf16 operands with Aqk, w, kg, qg stored in bf16, P and
    dC on tf32 (``bf16_dc``: dC's products with U, dU, dO and the states on bf16 operands too); bf16 inputs on the
    GPU under 1e-2 of the float64 loop. Under the interpreter (fp32 inputs, the operands rounded to bf16 and
    multiplied in fp32, since its bf16 dot is wrong) it checks the path's layout and indexing: a misplaced term is
    off by O(1)."""
    errors = _errors(delta_problem(**case[1]), backend, torch.bfloat16 if backend == "cuda" else torch.float32,
                     recompute=recompute, precision=precision)
    assert worst(errors) < (CUDA_TOL if backend == "cuda" else EMULATED_BF16_TOL), errors


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
def test_bf16_state_path_stores_its_terms_in_half_the_space(backend):
    """With ``precision="bf16"`` Aqk, w, kg and qg take half their fp32 space in the saved buffer, and the fake
    implementation gives the same size."""
    from hdla_vision.kernels import custom_ops
    from hdla_vision.kernels.delta_rule.terms import HALF_TERMS, saved_layout, saved_numel

    p = delta_problem(1, 70, 2, 16, 8)
    args = [p[n].float() for n in ("q", "k", "v", "beta", "g", "write")]
    saved = custom_ops.chunk_delta_rule_op(*args, 0.5, None, False, "bf16", False)[2]
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = custom_ops.chunk_delta_rule_op(*(mode.from_tensor(a) for a in args), 0.5, None, False, "bf16", False)[2]
    half_numel = sum(torch.Size(shape).numel() for name, shape in saved_layout(1, 70, 2, 16, 8) if name in HALF_TERMS)
    assert fake.shape == saved.shape == (saved_numel(1, 70, 2, 16, 8) - half_numel // 2,)


@pytest.mark.parametrize("backend,case", backend_cases(_case_id, interpreter=RECOMPUTE_CASES, cuda=LARGE),
                         indirect=["backend"])
def test_recompute_mode_matches_the_float64_loop(backend, case):
    """``recompute=True``: the forward saves only the states entering each chunk and the backward remakes the other
    terms (P again, forming U = u~ - w h from those states); the gradients are the float64 loop's as before."""
    errors = _errors(delta_problem(**case[1]), backend, torch.bfloat16 if backend == "cuda" else torch.float32,
                     recompute=True)
    assert worst(errors) < (CUDA_TOL if backend == "cuda" else FP32_TOL), errors


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
def test_recompute_mode_saves_the_states_alone(backend):
    """The saved buffer of the recompute mode is the states ``[B*H, N, K, V]`` (fp32), and the fake implementation
    gives its size: what a training step keeps per call."""
    from hdla_vision.kernels import custom_ops
    from hdla_vision.kernels.delta_rule.terms import saved_numel

    p = delta_problem(1, 70, 2, 16, 8)
    args = [p[n].float() for n in ("q", "k", "v", "beta", "g", "write")]
    sizes = {}
    for recompute in (False, True):
        saved = custom_ops.chunk_delta_rule_op(*args, 0.5, None, False, None, recompute)[2]
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = custom_ops.chunk_delta_rule_op(*(mode.from_tensor(a) for a in args), 0.5, None, False, None,
                                                  recompute)[2]
        assert fake.shape == saved.shape
        sizes[recompute] = saved.numel()
    assert sizes[True] == 2 * 2 * 16 * 8 < sizes[False] == saved_numel(1, 70, 2, 16, 8)


@pytest.mark.parametrize("backend", backends("torch", "interpreter"), indirect=True)
def test_reversed_scan_matches_the_float64_loop(backend):
    p = delta_problem(2, 70, 1, 16, 8, g_min=-20.0, beta_ends=True)
    errors = _errors(p, backend, torch.float32, reverse=True)
    assert worst(errors) < FP32_TOL, errors


@pytest.mark.parametrize("backend,case", backend_cases(_case_id, torch=[("T33", (33, 16))], interpreter=[("T33", (33, 16))],
                                                       cuda=[("T300", (300, 64))]), indirect=["backend"])
def test_runs_hdla_through_two_steps_per_token(backend, case):
    """HDLA (its own float64 loop, Householder products) from the delta rule over 2T steps, -20 gates, resets, beta at
    0 and 2: the second step of each token is the token's output; every gradient flows back through the steps."""
    seq_len, dk = case[1]
    p = hdla_problem(2, seq_len, 2, dk, 16, g_min=-20.0, resets=0.05)
    p["beta"][0, :4] = 0.0
    p["beta"][1, :4] = 2.0
    names = ("q", "k", "v", "beta", "g", "initial_state")
    leaves = {n: p[n].float().requires_grad_() for n in names}
    run = on_backend(leaves, backend)
    steps = hdla_steps(*(run[n] for n in names[:5]))
    o, s = chunk_delta_rule(*steps, scale=0.5, initial_state=run["initial_state"], output_final_state=True)
    exact = {n: p[n].clone().requires_grad_() for n in names}
    o_ref, s_ref = naive_hdla(**exact, scale=0.5, output_final_state=True)
    gen = torch.Generator().manual_seed(2)
    do, ds = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (o_ref, s_ref))
    got = torch.autograd.grad((o[:, 1::2].double().cpu() * do).sum() + (s.double().cpu() * ds).sum(),
                              list(leaves.values()))
    ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), list(exact.values()))
    errors = {"o": rel_err(o[:, 1::2].double().cpu(), o_ref), "state": rel_err(s.double().cpu(), s_ref)}
    errors.update({f"d{n}": rel_err(a.double().cpu(), b) for n, a, b in zip(names, got, ref)})
    tol = CUDA_TOL if backend == "cuda" else FP32_TOL
    assert worst(errors) < tol, errors


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
def test_batches_past_a_grid_axis_run_in_slices(backend, monkeypatch):
    """More batch-head pairs than a grid axis holds run in batch slices, with the same outputs and gradients."""
    from hdla_vision.kernels import utils
    from hdla_vision.kernels.delta_rule import chunk as chunk_module

    calls = []
    forward = chunk_module.delta_rule_forward
    monkeypatch.setattr(chunk_module, "delta_rule_forward", lambda *a: calls.append(a[0].shape) or forward(*a))
    monkeypatch.setattr(utils, "MAX_GRID_BATCH_HEADS", 2)  # one batch element (two heads) per slice
    errors = _errors(delta_problem(3, 20, 2, 16, 8), backend, torch.float32)
    assert worst(errors) < FP32_TOL, errors
    assert [shape[0] for shape in calls] == [1, 1, 1]


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
def test_parallel_kernels_take_their_own_value_blocks(backend, monkeypatch):
    """O and dO (``LAUNCH["BV_O"]``) and dC's loops over V (``"BV_C"``) on V blocks other than the serial passes'
    (here 32 against 16, V = 40: two blocks against three, the last partly past V) give the float64 loop's outputs
    and gradients."""
    monkeypatch.setitem(delta_chunk.LAUNCH, "BV", {64: 16, 128: 16})
    monkeypatch.setitem(delta_chunk.LAUNCH, "BV_O", {64: 32, 128: 32})
    monkeypatch.setitem(delta_chunk.LAUNCH, "BV_C", {64: 32, 128: 32})
    errors = _errors(delta_problem(1, 70, 1, 16, 40), backend, torch.float32)
    assert worst(errors) < FP32_TOL, errors


GROUP_CASES = [  # groups of two chunks: the last group short; K and V over one block of BV = 32, both partly past
    ("T300_d48_v40_gates-20_beta_ends", dict(batch=2, seq_len=300, heads=1, dk=48, dv=40, g_min=-20.0, beta_ends=True)),
    ("T130_per_head_no_h0", dict(batch=1, seq_len=130, heads=2, dk=16, dv=8, h0=False, per_head=True)),
]


@pytest.mark.parametrize("backend,case", backend_cases(_case_id, interpreter=GROUP_CASES, cuda=LARGE[:2]),
                         indirect=["backend"])
def test_two_level_scan_matches_the_float64_loop(backend, case, monkeypatch):
    """The serial passes as a two-level scan (``LAUNCH["GROUP"]``: here two chunks per group): each group's map
    (its image of zero and its transition, from the identity's columns) in parallel, the groups' starts serially,
    then each group's chunks from its start; forward and backward, with and without an initial state, equal to the
    float64 loop (output, final state, every gradient)."""
    monkeypatch.setitem(delta_chunk.LAUNCH, "GROUP", {64: 2, 128: 2})
    assert delta_chunk.group_size(5, 64, delta_chunk.LAUNCH["GROUP_PROGRAMS"]) == 5  # enough programs: one pass
    errors = _errors(delta_problem(**case[1]), backend, torch.bfloat16 if backend == "cuda" else torch.float32)
    assert worst(errors) < (CUDA_TOL if backend == "cuda" else FP32_TOL), errors


@pytest.mark.parametrize("name,change,message", [
    ("k", lambda p: p.update(k=p["k"][..., :-1]), "k must be"),
    ("g", lambda p: p.update(g=p["g"][:, :-1]), "g must be"),
    ("v", lambda p: p.update(v=p["v"][:, :-1]), "v must be"),
    ("positive g", lambda p: p["g"].__setitem__((0, 0, 0, 0), 0.5), "must be <= 0"),
    ("beta", lambda p: p.update(beta=p["beta"].unsqueeze(-1)), "beta must be"),
    ("write", lambda p: p.update(write=p["write"][:, :-1]), "write must be"),
    ("initial_state", lambda p: p.update(initial_state=p["initial_state"][..., :-1]), "initial_state must be"),
])
def test_bad_input_raises(name, change, message):
    p = delta_problem(1, 5, 1, 8, 4)
    change(p)
    with pytest.raises(ValueError, match=message):
        chunk_delta_rule(**p)


def test_triton_path_refuses_wide_heads(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    p = delta_problem(1, 3, 1, MAX_HEAD_DIM + 16, 4)
    with pytest.raises(ValueError, match="K up to 128"):
        chunk_delta_rule(**{n: None if x is None else x.float() for n, x in p.items()})


# ----------------------------------------------------------------------------- HDLA's ops on the delta family
@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
def test_chunk_hdla_on_the_delta_family(backend, reverse, monkeypatch):
    """``HDLA_VISION_KERNELS=delta``: chunk_hdla on the delta rule's kernels, output, final state and every
    gradient against HDLA's float64 loop (-20 gates, initial state)."""
    monkeypatch.setenv(KERNEL_FAMILY_ENV, "delta")
    seq_len, dk = (40, 16) if backend == "interpreter" else (300, 64)
    problem = on_backend(hdla_problem(2, seq_len, 2, dk, 16, g_min=-20.0), backend)
    errors = compare_with_loop(chunk_hdla, "hdla", problem, scale=0.5, reverse=reverse)
    assert worst(errors) < (CUDA_TOL if backend == "cuda" else FP32_TOL), errors


@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
def test_chunk_hdla_bidirectional_on_the_delta_family(backend, monkeypatch):
    """Both directions on the delta rule's kernels: y = forward + reversed - the own write, the final states and
    every gradient against the float64 loops (beta at 0 and 2)."""
    monkeypatch.setenv(KERNEL_FAMILY_ENV, "delta")
    seq_len, dk = (33, 16) if backend == "interpreter" else (196, 64)
    problem = bidirectional_problem("hdla", 2, seq_len, 2, dk, 16, g_min=-20.0, beta_ends=True)
    errors = compare_bidirectional(chunk_hdla_bidirectional, "hdla", problem, scale=0.5,
                                   device="cuda" if backend == "cuda" else "cpu")
    assert worst(errors) < (CUDA_TOL if backend == "cuda" else FP32_TOL), errors


def test_delta_family_leaves_float64_and_the_cpu_form_alone(monkeypatch):
    """Without Triton (or in float64) the delta setting changes nothing: the HDLA ops take their usual path."""
    from hdla_vision.kernels.ops import on_delta_rule

    monkeypatch.setenv(KERNEL_FAMILY_ENV, "delta")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not on_delta_rule(torch.zeros(1, 2, 1, 16))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert on_delta_rule(torch.zeros(1, 2, 1, 16)) and not on_delta_rule(torch.zeros(1, 2, 1, 16, dtype=torch.float64))
    assert not on_delta_rule(torch.zeros(1, 2, 1, MAX_HEAD_DIM + 1))


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_custom_op_schema_fake_and_autograd(backend, recompute):
    """``torch.library.opcheck`` of the registered op (schema, fake implementation: the saved terms' buffer size
    without running a kernel, autograd registration, AOT dispatch) on one small case with an initial state, with
    every term saved and in the recompute mode."""
    from hdla_vision.kernels import custom_ops

    p = delta_problem(1, 70, 1, 16, 8)
    args = [p[n].float().requires_grad_() for n in ("q", "k", "v", "beta", "g", "write")]
    torch.library.opcheck(custom_ops.chunk_delta_rule_op,
                          (*args, 0.5, p["initial_state"].float().requires_grad_(), True, None, recompute))


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
def test_compiled_fullgraph_equals_eager(backend, monkeypatch):
    """``torch.compile(fullgraph=True)`` (aot_eager: the fake implementations trace forward and backward) of HDLA
    on the delta family, both directions, equals eager: one graph, no break."""
    monkeypatch.setenv(KERNEL_FAMILY_ENV, "delta")
    calls = []
    forward = delta_chunk.delta_rule_forward
    monkeypatch.setattr(delta_chunk, "delta_rule_forward", lambda *a: calls.append(1) or forward(*a))
    p = hdla_problem(1, 40, 2, 16, 8, g_min=-20.0)
    names = ["q", "k", "v", "beta", "g", "initial_state"]

    def loss(q, k, v, beta, g, h0):
        o, s = chunk_hdla(q, k, v, beta, g, 0.5, h0, output_final_state=True)
        y = chunk_hdla_bidirectional(q, k, v, torch.stack([beta, beta.flip(1)]), torch.stack([g, g.flip(1)]), 0.5)[0]
        return (o * o).sum() + s.sum() + (y * y).sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        leaves = [p[n].float().requires_grad_() for n in names]
        calls.clear()
        value = fn(*leaves)
        results.append((value, torch.autograd.grad(value, leaves)))
        assert len(calls) == 3, calls  # the op ran on the delta family: one direction, then both
    (eager, eager_grads), (compiled, compiled_grads) = results
    torch.testing.assert_close(compiled, eager)
    for c, e in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(c, e)
