"""chunk_loglinear_hdla and chunk_loglinear_generalized (kernels/loglinear, kernels/README.md §7)
against the float64 loops written from the definition: the output, the final levels and every
gradient; the special cases that are the linear op; splitting a sequence; bad input raising
ValueError before any launch. They run the linear chunk ops, so their values are checked on the
"torch" and "cuda" backends (tests/backends.py); under the interpreter a single small case costs
4-8 s (O(log T) chunk-op calls), so there only the input checks run (the chunk ops themselves are
checked there in test_chunk_hdla.py / test_chunk_generalized.py). The bucket grid
(kernels/loglinear/levels.py) is checked first. The decoding steps are test_fused_recurrent_loglinear.py."""
import warnings

import pytest
import torch

from hdla_vision.kernels import chunk_generalized, chunk_hdla, chunk_loglinear_generalized, chunk_loglinear_hdla
from hdla_vision.kernels.loglinear import chunk as chunk_module
from hdla_vision.kernels.loglinear.levels import initial_level, merge_target, token_level
from hdla_vision.kernels.generalized.torch_chunk import ChunkTerms
from hdla_vision.kernels.loglinear.torch_chunk import _across_chunks, intra_levels
from tests.backends import CUDA_TOL, backend_cases, backends, on_backend
from tests.oracle import (LOGLINEAR_GENERALIZED_BAD_INPUT, LOGLINEAR_OPS, UNBOUNDED, LoopCase, bad_loglinear_problem,
                          case_name, compare_with_definition, loglinear_problem, loglinear_tokens, rel_err,
                          worst)


# ----------------------------------------------------------------------------- the bucket grid
def test_level_table_matches_the_papers_mask_for_t8():
    """Log-linear paper eq. 4's matrix for T = 8 (the level of every s <= t)."""
    expected = [[0], [1, 0], [2, 2, 0], [2, 2, 1, 0], [3, 3, 3, 3, 0], [3, 3, 3, 3, 1, 0], [3, 3, 3, 3, 2, 2, 0],
                [3, 3, 3, 3, 2, 2, 1, 0]]
    assert [[token_level(t, s, UNBOUNDED) for s in range(t + 1)] for t in range(8)] == expected


def test_levels_are_the_greedy_fenwick_partition():
    """The paper's footnote-7 partition: peel the lowest power of two off the prefix [0, t) again
    and again; the bucket peeled off at r, [r - 2^lssb(r), r), is level lssb(r) + 1, of 2^(level-1)
    tokens, and the levels of [0, t) are then exactly the set bits of t (bit_length(t) + 1 levels
    with level 0)."""
    for t in range(1, 130):
        rest, levels_seen = t, []
        while rest:
            size = rest & -rest
            level = size.bit_length()
            assert {token_level(t, s, UNBOUNDED) for s in range(rest - size, rest)} == {level}, (t, rest)
            assert size == 2 ** (level - 1)
            levels_seen.append(level)
            rest -= size
        assert levels_seen == [b + 1 for b in range(t.bit_length()) if t >> b & 1], t


def test_level_cap_and_the_cache_level():
    assert token_level(100, 3, 4) == 3 and token_level(5, 4, 4) == 1
    assert merge_target(0, 5) == 4 and merge_target(12, 9) == 3 and merge_target(64, 4) == 3
    for offset in (1, 5, 8, 13):
        for t in range(offset, offset + 40):  # a level's tokens stay together: the cache level is theirs
            for s in range(offset):
                own = token_level(offset - 1, s, UNBOUNDED)
                assert initial_level(t, offset, own, UNBOUNDED) == token_level(t, s, UNBOUNDED)
    assert initial_level(7, 0, 1, 5) == 4  # a cache at position 0: everything on the top level


# ----------------------------------------------------------------------------- against the definition
def _case(kind, name, seq_len, num_levels, offset=0, reverse=False, scale=None, **problem):
    problem = dict(kind=kind, seq_len=seq_len, num_levels=num_levels, **problem)
    op = dict(offset=offset, reverse=reverse, **({} if scale is None else dict(scale=scale)))
    return LoopCase(f"{kind}_{name}", problem, op)


HDLA_CASES = [
    _case("hdla", "T1_L3", 1, 3, scale=0.5),
    _case("hdla", "T7_unbounded", 7, UNBOUNDED, scale=0.5),
    _case("hdla", "T33_L4_rev", 33, 4, reverse=True, scale=0.5),
    _case("hdla", "T64_unbounded_gates-20", 64, UNBOUNDED, g_min=-20.0, scale=0.5),
    _case("hdla", "T33_L5_offset11_h0", 33, 5, offset=11, h0=True, scale=0.5),
    _case("hdla", "T15_L3_h0", 15, 3, h0=True, g_min=-1.0, scale=0.5),
    _case("hdla", "T17_L6_offset1000_h0", 17, 6, offset=1000, h0=True, scale=0.5),
]
GENERALIZED_CASES = [
    _case("generalized", "T33_unbounded_rab0", 33, UNBOUNDED, r_ab=0),  # GLA-like: rank 0, vector decay
    _case("generalized", "T7_L3_rab0_rev", 7, 3, r_ab=0, reverse=True),
    _case("generalized", "T64_L5_rab1_scalar", 64, 5, scalar_decay=True),  # Gated-DeltaNet-like
    _case("generalized", "T33_L4_rab1_scalar_offset6_h0", 33, 4, scalar_decay=True, offset=6, h0=True),
    _case("generalized", "T17_L6_rkv2_rab3_offset3_h0", 17, 6, r_kv=2, r_ab=3, offset=3, h0=True),
]
RESET_CASES = [  # g = -inf (a full reset of a channel) inside the blocks and before a cache is read
    _case(kind, "T29_L4_resets_offset3_h0", 29, 4, offset=3, h0=True, resets=0.2, seed=3)
    for kind in ("hdla", "generalized")
]
def _on_cuda(cases):
    """The cases on CUDA: fp32 with the kernels' TF32 products (CUDA_TOL)."""
    return [case._replace(tol=CUDA_TOL) for case in cases]


@pytest.mark.parametrize("backend,case", backend_cases(
    case_name, torch=HDLA_CASES + GENERALIZED_CASES + RESET_CASES, cuda=_on_cuda(HDLA_CASES + GENERALIZED_CASES + RESET_CASES)),
    indirect=["backend"])
def test_chunk_matches_definition(backend, case):
    """Output, final levels and every gradient (level_scales and the cache included), fp32."""
    kind = case.problem["kind"]
    inputs = on_backend(loglinear_problem(**case.problem), backend)
    assert torch.isinf(inputs["g"]).any() == (case.problem.get("resets", 0) > 0)
    errors = compare_with_definition(kind, inputs, dtype=case.dtype, **case.op)
    assert worst(errors) < case.tol, errors  # NaN fails too


@pytest.mark.parametrize("backend", backends("torch"), indirect=True)
@pytest.mark.parametrize("kind", ["hdla", "generalized"])
def test_float64_is_exact(backend, kind):
    p = loglinear_problem(kind, 21, 4, h0=True)
    errors = compare_with_definition(kind, p, dtype=torch.float64, offset=9)
    assert worst(errors) < 1e-11, errors


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_bf16_inputs_return_bf16(backend):
    p = loglinear_problem("hdla", 20, 4, h0=True)
    p = {n: x.bfloat16() for n, x in p.items()}
    p["level_scales"] = p["level_scales"].float()  # weights may stay fp32 under bf16, like the gates
    o, s = chunk_loglinear_hdla(**on_backend(p, backend), output_final_state=True, offset=3)
    assert o.dtype == s.dtype == torch.bfloat16 and torch.isfinite(o.float()).all()


# ----------------------------------------------------------------------------- the one chunk form (torch_chunk.py)
CHUNK_FORM_CASES = [  # from token 0, no cache, no final state: the calls the one chunk form takes
    *(_case("hdla", f"T{t}_unbounded", t, UNBOUNDED, scale=0.5) for t in (1, 15, 16, 17, 33, 64, 65, 129)),
    _case("hdla", "T64_L3", 64, 3, scale=0.5),
    _case("hdla", "T40_L6_rev_gates-20", 40, 6, reverse=True, g_min=-20.0, scale=0.5),
    _case("hdla", "T29_L4_resets", 29, 4, resets=0.2, seed=3),
    _case("generalized", "T33_unbounded_rab0", 33, UNBOUNDED, r_ab=0),
    _case("generalized", "T65_L5_rab1_scalar_rev", 65, 5, scalar_decay=True, reverse=True),
    _case("generalized", "T40_L6_rkv2_rab3", 40, 6, r_kv=2, r_ab=3),
    _case("generalized", "T29_L4_resets", 29, 4, resets=0.2, seed=3),
    _case("hdla", "T33_L5_offset11", 33, 5, offset=11, scale=0.5),  # no cache: any offset
    _case("hdla", "T40_unbounded_offset1000", 40, UNBOUNDED, offset=1000, scale=0.5),
    _case("generalized", "T37_L6_rkv2_rab3_offset3", 37, 6, r_kv=2, r_ab=3, offset=3),
    _case("generalized", "T50_unbounded_rab0_offset64", 50, UNBOUNDED, r_ab=0, offset=64),
    # mild gates: the chunk maps and the levels across chunks weigh in (at -3 per token a chunk's map is ~0)
    _case("hdla", "T129_unbounded_mild", 129, UNBOUNDED, g_min=-0.05, scale=0.5),
    _case("generalized", "T100_L7_rab2_mild_offset7", 100, 7, r_ab=2, g_min=-0.05, offset=7),
]


@pytest.fixture
def only_chunk_form(monkeypatch):
    """Fail any call that would run the per-level linear-op calls instead of the one chunk form."""
    def refuse(*args, **kwargs):
        raise AssertionError("the per-level path ran")
    monkeypatch.setattr(chunk_module, "_chunk_loglinear", refuse)
    monkeypatch.delenv(chunk_module.PATH_ENV, raising=False)


@pytest.mark.parametrize("backend", backends("torch"), indirect=True)
@pytest.mark.parametrize("case", CHUNK_FORM_CASES, ids=case_name)
def test_one_chunk_form_matches_definition(backend, case, only_chunk_form):
    """Output and every gradient (level_scales included) against the float64 loop, fp32."""
    errors = compare_with_definition(case.problem["kind"], loglinear_problem(**case.problem), final_state=False,
                                     **case.op)
    assert worst(errors) < case.tol, errors  # NaN fails too


def test_chunk_form_runs_eagerly_once_the_compiler_fails(only_chunk_form, compiled_chunk_form, monkeypatch):
    """A backend that fails to compile the graph costs a warning, once; the call and every later one run the eager
    form, exactly."""
    attempts = []

    def failing_backend(graph_module, example_inputs):
        attempts.append(graph_module)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(chunk_module, "COMPILE_BACKEND", failing_backend)
    monkeypatch.setattr(chunk_module, "_compile_failed", [])
    for seq_len in (9, 17):
        p = loglinear_problem("hdla", seq_len, UNBOUNDED)
        p.pop("initial_state")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            errors = compare_with_definition("hdla", {**p, "initial_state": None}, final_state=False)
        assert worst(errors) < 1e-4, (seq_len, errors)
        failures = [w for w in caught if "the compiler failed (RuntimeError)" in str(w.message)]
        assert len(failures) == (1 if seq_len == 9 else 0)
    assert len(attempts) == 1  # the second shape did not try again


@pytest.mark.parametrize("backend", backends("cuda"), indirect=True)
@pytest.mark.parametrize("kind,dtype", [("hdla", torch.bfloat16), ("hdla", torch.float32),
                                        ("generalized", torch.bfloat16)])
def test_one_chunk_form_on_cuda(backend, kind, dtype, only_chunk_form, monkeypatch):
    """The default form on CUDA (auto: the one chunk form), eager, against the float64 loop at a realistic size:
    three chunks and a tail, head dims 64, gates to -20, output and every gradient."""
    monkeypatch.setenv(chunk_module.COMPILE_ENV, "0")
    p = loglinear_problem(kind, 3 * 64 + 17, UNBOUNDED, batch=2, heads=3, dk=64, dv=64, r_ab=2, g_min=-20.0)
    p.pop("initial_state")
    errors = compare_with_definition(kind, on_backend({**p, "initial_state": None}, backend), dtype=dtype,
                                     final_state=False)
    assert worst(errors) < CUDA_TOL, errors


# ----------------------------------------------------------------------------- the chunk form compiled (COMPILE_ENV)
@pytest.fixture
def compiled_chunk_form(monkeypatch, request):
    """The one chunk form through ``torch.compile`` (``chunk.COMPILE_ENV`` on), with a backend that keeps each graph
    dynamo hands it: on the "cuda" backend inductor compiles it, elsewhere it runs as traced (no inductor build on
    CPU). The list of graphs."""
    from torch._dynamo.backends.registry import lookup_backend

    on_cuda = "backend" in request.fixturenames and request.getfixturevalue("backend") == "cuda"
    inner = lookup_backend("inductor") if on_cuda else None
    graphs = []

    def keep_graph(graph_module, example_inputs):
        graphs.append(graph_module)
        return inner(graph_module, example_inputs) if inner else graph_module.forward

    torch._dynamo.reset()
    monkeypatch.setenv(chunk_module.COMPILE_ENV, "1")
    monkeypatch.setattr(chunk_module, "COMPILE_BACKEND", keep_graph)
    yield graphs
    torch._dynamo.reset()


COMPILED_NAMES = ("hdla_T16_unbounded", "hdla_T40_L6_rev_gates-20", "hdla_T33_L5_offset11", "hdla_T129_unbounded_mild",
                  "generalized_T40_L6_rkv2_rab3", "generalized_T50_unbounded_rab0_offset64")
COMPILED_CASES = [case for case in CHUNK_FORM_CASES if case.name in COMPILED_NAMES]


def test_compiled_cases_exist():
    assert len(COMPILED_CASES) == len(COMPILED_NAMES)


@pytest.mark.parametrize("backend", backends("torch"), indirect=True)
@pytest.mark.parametrize("case", COMPILED_CASES, ids=case_name)
def test_compiled_chunk_form_matches_definition(backend, case, only_chunk_form, compiled_chunk_form):
    """Output and every gradient against the float64 loop through one traced graph (fullgraph, static shapes: each
    case's shapes and offset a graph of their own)."""
    errors = compare_with_definition(case.problem["kind"], loglinear_problem(**case.problem), final_state=False,
                                     **case.op)
    assert worst(errors) < case.tol, errors
    assert len(compiled_chunk_form) == 1  # the call took the compiled form, in one graph


def test_compiled_chunk_form_stays_eager_inside_a_trace(compiled_chunk_form):
    """Inside a caller's compilation the op hands its trace the chunk form itself (no nested torch.compile)."""
    q = torch.zeros(1)
    assert chunk_module.chunk_form(q) is not chunk_module.chunk_form_loglinear
    seen = []
    torch.compile(lambda: seen.append(chunk_module.chunk_form(q)), backend="eager", fullgraph=False)()
    assert seen == [chunk_module.chunk_form_loglinear]


def test_compile_setting_is_checked(monkeypatch):
    monkeypatch.setenv(chunk_module.COMPILE_ENV, "yes")
    with pytest.raises(ValueError, match="HDLA_VISION_LOGLINEAR_COMPILE must be 0 or 1"):
        chunk_module.chunk_form(torch.zeros(1))


def test_compiled_by_default_on_cuda_only(monkeypatch):
    """Unset, the setting compiles the chunk form for CUDA tensors and leaves CPU calls eager."""
    monkeypatch.delenv(chunk_module.COMPILE_ENV, raising=False)
    assert chunk_module.chunk_form(torch.zeros(1)) is chunk_module.chunk_form_loglinear
    assert chunk_module.chunk_form(torch.zeros(1, device="meta")) is chunk_module.chunk_form_loglinear
    if torch.cuda.is_available():
        assert chunk_module.chunk_form(torch.zeros(1, device="cuda")) is not chunk_module.chunk_form_loglinear


def test_compiled_chunk_form_runs_eagerly_past_the_recompile_limit(only_chunk_form, compiled_chunk_form):
    """Shapes past dynamo's recompile limit (which fullgraph makes a hard error) run the eager form, exactly."""
    with torch._dynamo.config.patch(recompile_limit=2):  # (monkeypatch's undo would delete the config entry)
        for seq_len in (5, 9, 17):  # three shapes, three levels counts
            p = loglinear_problem("hdla", seq_len, UNBOUNDED)
            p.pop("initial_state")
            errors = compare_with_definition("hdla", {**p, "initial_state": None}, final_state=False)
            assert worst(errors) < 1e-4, (seq_len, errors)
    assert len(compiled_chunk_form) == 2  # the first two shapes compiled, the third ran eagerly


@pytest.mark.parametrize("backend", backends("cuda"), indirect=True)
@pytest.mark.parametrize("kind,dtype", [("hdla", torch.bfloat16), ("hdla", torch.float32),
                                        ("generalized", torch.bfloat16)])
def test_compiled_chunk_form_on_cuda(backend, kind, dtype, only_chunk_form, compiled_chunk_form):
    """The chunk form compiled by inductor against the float64 loop, as test_one_chunk_form_on_cuda."""
    p = loglinear_problem(kind, 3 * 64 + 17, UNBOUNDED, batch=2, heads=3, dk=64, dv=64, r_ab=2, g_min=-20.0)
    p.pop("initial_state")
    errors = compare_with_definition(kind, on_backend({**p, "initial_state": None}, backend), dtype=dtype,
                                     final_state=False)
    assert worst(errors) < CUDA_TOL, errors
    assert len(compiled_chunk_form) == 1  # inductor compiled the call's one graph


# ----------------------------------------------------------------------------- no gradient: F1's terms (triton_chunk.py)
TRITON_TERMS_CASES = [  # the linear op's F1 gives each chunk's terms (C = 16 or 32 here: several chunks)
    _case("hdla", "T33_unbounded_offset11", 33, UNBOUNDED, offset=11, scale=0.5),
    _case("hdla", "T40_L6_rev_gates-20", 40, 6, reverse=True, g_min=-20.0, scale=0.5),
    _case("hdla", "T29_L4_resets", 29, 4, resets=0.2, seed=3),
    _case("generalized", "T33_unbounded_rab0", 33, UNBOUNDED, r_ab=0),
    _case("generalized", "T65_L5_rab1_scalar_rev", 65, 5, scalar_decay=True, reverse=True),
    _case("generalized", "T37_L6_rkv2_rab3_offset3", 37, 6, r_kv=2, r_ab=3, offset=3),
    # mild gates (log lambda >= -0.05): states cross several chunks, so the chunk maps (N) and the levels across
    # chunks weigh in the output (at -3 per token a chunk's map is ~e^-48 and only the last chunk's writes count)
    _case("hdla", "T129_unbounded_mild", 129, UNBOUNDED, g_min=-0.05, scale=0.5),
    _case("generalized", "T100_L7_rab2_mild_offset7", 100, 7, r_ab=2, g_min=-0.05, offset=7),
    _case("generalized", "T129_L6_rab1_scalar_mild_rev", 129, 6, scalar_decay=True, g_min=-0.05, reverse=True),
    # offsets of several chunks: the call starts inside segments of chunks (triton_chunk.segment_states' cut chains)
    _case("generalized", "T150_unbounded_rab1_mild_offset45", 150, UNBOUNDED, r_ab=1, g_min=-0.05, offset=45),
    _case("hdla", "T90_L7_mild_offset100", 90, 7, g_min=-0.05, offset=100, scale=0.5),
]


@pytest.fixture
def only_triton_terms(monkeypatch):
    """Fail any call that would take the per-level calls or the PyTorch terms instead of F1's terms."""
    def refuse(*args, **kwargs):
        raise AssertionError("another path than F1's terms ran")
    monkeypatch.setattr(chunk_module, "_chunk_loglinear", refuse)
    monkeypatch.setattr(chunk_module, "chunk_form_loglinear", refuse)
    # the interpreter's auto setting runs the levels; patched, not by $HDLA_VISION_LOGLINEAR, which the interpreter
    # subprocess (started from this fixture's test) would inherit for every later test
    monkeypatch.setattr(chunk_module, "one_chunk_form", lambda *args: True)


def _no_grad_output(kind, p, dtype=torch.float32, **op):
    """The chunk op's output without gradients on ``p`` cast to ``dtype``, and the float64 loop's."""
    chunk, loop, _ = LOGLINEAR_OPS[kind]
    ref, _ = loop(**p, **op)
    with torch.no_grad():
        o, final = chunk(**{n: None if x is None else x.to(dtype) for n, x in p.items()}, **op)
    assert final is None and o.dtype == dtype
    return o, ref


# the chains where they differ from the doubling's work: states across several chunks (mild gates), calls that start
# inside segments (offsets of several chunks), levels that share the last weight (skipped chains), reversed
CHAINS_CASES = ("hdla_T40_L6_rev_gates-20", "hdla_T129_unbounded_mild", "generalized_T100_L7_rab2_mild_offset7",
                "generalized_T129_L6_rab1_scalar_mild_rev", "generalized_T150_unbounded_rab1_mild_offset45",
                "hdla_T90_L7_mild_offset100")
TRITON_TERMS_PARAMS = ([pytest.param(case, "doubling", id=f"doubling-{case.name}") for case in TRITON_TERMS_CASES]
                       + [pytest.param(case, "chains", id=f"chains-{case.name}") for case in TRITON_TERMS_CASES
                          if case.name in CHAINS_CASES])


@pytest.fixture(params=["doubling", "chains"])
def across(request, monkeypatch):
    """Both ways of reading earlier chunks' writes on F1's terms (triton_chunk.ACROSS_ENV), each required to run."""
    from hdla_vision.kernels.loglinear import torch_chunk, triton_chunk

    monkeypatch.setattr(triton_chunk, "across_setting", lambda: request.param)
    if request.param == "chains":
        def refuse(*args, **kwargs):
            raise AssertionError("the doubling ran instead of the chains")
        monkeypatch.setattr(torch_chunk, "_across_chunks", refuse)
    return request.param


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
@pytest.mark.parametrize("case,across", TRITON_TERMS_PARAMS, indirect=["across"])
def test_no_grad_calls_take_f1s_terms(backend, case, only_triton_terms, across):
    """Without gradients the chunk form takes its terms from the linear op's F1 kernel: the output against the
    float64 loop, fp32 (offsets, reversed, mild and -20 gates, resets, ranks 0-3, scalar decay, HDLA's builder),
    across chunks by the doubling and by F2's chains on segments."""
    p = loglinear_problem(**case.problem)
    o, ref = _no_grad_output(case.problem["kind"], p, **case.op)
    assert rel_err(o, ref) < case.tol, rel_err(o, ref)  # NaN fails too


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
def test_f1s_terms_refuse_a_positive_log_decay(backend, only_triton_terms):
    with pytest.raises(ValueError, match="g is a log-decay"):
        chunk_loglinear_hdla(**bad_loglinear_problem("hdla", g=torch.ones(2, 6, 2, 8)))


def test_the_chains_cases_exist():
    assert set(CHAINS_CASES) <= {case.name for case in TRITON_TERMS_CASES}


def test_across_setting_names_its_values(monkeypatch):
    from hdla_vision.kernels.loglinear.triton_chunk import ACROSS_ENV, across_setting

    monkeypatch.delenv(ACROSS_ENV, raising=False)
    assert across_setting() == "chains"
    monkeypatch.setenv(ACROSS_ENV, "doubling")
    assert across_setting() == "doubling"
    monkeypatch.setenv(ACROSS_ENV, "fenwick")
    with pytest.raises(ValueError, match="HDLA_VISION_LOGLINEAR_ACROSS must be one of doubling, chains"):
        across_setting()


def test_triton_terms_only_without_gradients(monkeypatch):
    """The F1 path needs Triton on q's device, ranks the chunk kernels take and no input that needs a gradient."""
    from hdla_vision.kernels.loglinear.triton_chunk import triton_terms_apply
    q = torch.randn(1, 4, 1, 8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_terms_apply(q, 1, 1, q)  # a CPU tensor without the interpreter: the PyTorch form
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_terms_apply(q, 1, 1, q) and not triton_terms_apply(q, 1, 5, q)
    assert not triton_terms_apply(q, 1, 1, q.clone().requires_grad_())
    with torch.no_grad():
        assert triton_terms_apply(q, 1, 1, q.clone().requires_grad_())
    assert not triton_terms_apply(q.double(), 1, 1)


@pytest.mark.parametrize("backend", backends("cuda"), indirect=True)
@pytest.mark.parametrize("kind,dtype", [("hdla", torch.bfloat16), ("generalized", torch.bfloat16),
                                        ("hdla", torch.float32)])
def test_no_grad_calls_take_f1s_terms_on_cuda(backend, kind, dtype, only_triton_terms, across):
    """Inference on CUDA (F1's terms) against the float64 loop at a realistic size: three chunks and a tail, head
    dims 64, gates to -20, offset 5."""
    p = loglinear_problem(kind, 3 * 64 + 17, UNBOUNDED, batch=2, heads=3, dk=64, dv=64, r_ab=2, g_min=-20.0)
    o, ref = _no_grad_output(kind, on_backend({**p, "initial_state": None}, backend), dtype, offset=5)
    assert rel_err(o, ref) < CUDA_TOL, rel_err(o, ref)


@pytest.mark.parametrize("backend", backends("torch"), indirect=True)
@pytest.mark.parametrize("kind", ["hdla", "generalized"])
def test_one_chunk_form_equals_the_levels(backend, kind, monkeypatch):
    """The two paths on the same float64 inputs: outputs and gradients to rounding."""
    p = loglinear_problem(kind, 70, 5, r_ab=2)
    p.pop("initial_state")
    chunk = LOGLINEAR_OPS[kind][0]
    results = []
    for path in ("levels", "auto"):
        monkeypatch.setenv(chunk_module.PATH_ENV, path)
        leaves = {n: x.clone().requires_grad_() for n, x in p.items()}
        o, _ = chunk(**leaves)
        results.append((o, torch.autograd.grad((o * o).sum(), list(leaves.values()))))
    (o_levels, g_levels), (o_form, g_form) = results
    assert rel_err(o_form, o_levels) < 1e-12
    assert all(rel_err(a, b) < 1e-11 for a, b in zip(g_form, g_levels))


def test_chunk_form_levels_within_and_across_chunks():
    """The in-chunk level table is the bucket grid's; across chunks (identity maps, chunk m writing e_m, queries
    reading row r, level j weighted j) chunk n reads chunk m < n at level bit_length(n XOR m) on the absolute grid,
    also from a first chunk off the grid's blocks."""
    assert intra_levels(16).tolist() == [[token_level(max(t, s), min(t, s), UNBOUNDED) for s in range(16)]
                                         for t in range(16)]
    n_chunks = 37
    eye = torch.eye(n_chunks, dtype=torch.float64)
    for first in (0, 3, 64, 100):
        levels = ((first + n_chunks - 1) ^ first).bit_length()
        terms = ChunkTerms(q_eff=eye.expand(1, 1, n_chunks, n_chunks, n_chunks), o_local=None, mixing=None,
                           v_flat=None, s_trans=None, s_add=eye.reshape(1, 1, n_chunks, n_chunks, 1),
                           decay=torch.ones(1, 1, n_chunks, n_chunks, 1, dtype=torch.float64), unchunk=None)
        lam = torch.arange(levels + 1, dtype=torch.float64).expand(1, 1, n_chunks, n_chunks, levels + 1)
        out = _across_chunks(terms, lam, levels + 1, 0, first)[0, 0, :, :, 0]  # [n, m]
        expected = [[float(((first + n) ^ (first + m)).bit_length()) if m < n else 0.0 for m in range(n_chunks)]
                    for n in range(n_chunks)]
        assert out.tolist() == expected, first


def test_loglinear_path_setting_is_checked(monkeypatch):
    monkeypatch.setenv(chunk_module.PATH_ENV, "fused")
    with pytest.raises(ValueError, match="HDLA_VISION_LOGLINEAR must be one of auto, levels, chunk_form"):
        chunk_loglinear_hdla(**bad_loglinear_problem("hdla"))


# ----------------------------------------------------------------------------- special cases: the linear op
@pytest.mark.parametrize("backend", backends("torch"), indirect=True)
def test_one_level_is_the_linear_op_times_lambda(backend):
    """L = 1: every bucket is read with lambda_t, so o_t = lambda_t * HDLA's o_t; the single level
    is HDLA's state, also continuing from one (float64)."""
    p = loglinear_problem("hdla", 37, 1, h0=True)
    lam = p.pop("level_scales")
    cache = p.pop("initial_state")
    o_lin, s_lin = chunk_hdla(**p, initial_state=cache[:, :, 0], output_final_state=True)
    o, s = chunk_loglinear_hdla(**p, level_scales=lam, initial_state=cache, output_final_state=True, offset=5)
    assert rel_err(o, lam * o_lin) < 1e-12 and rel_err(s[:, :, 0], s_lin) < 1e-12


@pytest.mark.parametrize("backend", backends("torch"), indirect=True)
@pytest.mark.parametrize("num_levels", [2, 7])
def test_constant_weights_give_the_linear_op(backend, num_levels):
    """lambda = c on every level: c times the linear op, and the levels sum to its state (float64)."""
    p = loglinear_problem("generalized", 45, num_levels, r_kv=2, r_ab=2)
    p.pop("initial_state")
    p["level_scales"] = torch.full_like(p.pop("level_scales"), 0.7)
    o_lin, s_lin = chunk_generalized(**{n: p[n] for n in "qkvabg"}, output_final_state=True)
    o, s = chunk_loglinear_generalized(**p, output_final_state=True)
    assert rel_err(o, 0.7 * o_lin) < 1e-12 and rel_err(s.sum(2), s_lin) < 1e-12


# ----------------------------------------------------------------------------- splitting a sequence
@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
@pytest.mark.parametrize("kind", ["hdla", "generalized"])
@pytest.mark.parametrize("offset", [0, 13])
def test_splitting_and_continuing_equals_one_call(backend, kind, offset):
    chunk = LOGLINEAR_OPS[kind][0]
    p = {n: None if x is None else x.float() for n, x in loglinear_problem(kind, 40, 5, h0=offset > 0).items()}
    p = on_backend(p, backend)
    o_all, s_all = chunk(**p, output_final_state=True, offset=offset)
    tol = CUDA_TOL if backend == "cuda" else 1e-5
    for split in (1, 8, 19, 32):
        head = dict(loglinear_tokens(p, 0, split))
        o1, s1 = chunk(**head, output_final_state=True, offset=offset)
        tail = dict(loglinear_tokens(p, split, None), initial_state=s1)
        o2, s2 = chunk(**tail, output_final_state=True, offset=offset + split)
        assert rel_err(torch.cat([o1, o2], 1), o_all) < tol and rel_err(s2, s_all) < tol, split


# ----------------------------------------------------------------------------- bad input
HDLA_BAD_INPUT = [  # (overrides of bad_loglinear_problem, message)
    (dict(level_scales=torch.rand(2, 6, 2)), "level_scales must have shape [B, T, H, L]"),
    (dict(level_scales=torch.rand(2, 5, 2, 3)), "level_scales must have shape [B, T, H, L] = [2, 6, 2, 3]"),
    (dict(level_scales=torch.rand(2, 6, 2, 0)), "level_scales must have L >= 1"),
    (dict(level_scales=torch.rand(2, 6, 2, 3, dtype=torch.float64)), "level_scales has dtype torch.float64"),
    (dict(level_scales="x"), "level_scales must have shape [B, T, H, L]"),
    (dict(offset=-1), "offset must be >= 0"),
    (dict(offset=2.0), "offset must be an int"),
    (dict(initial_state=torch.zeros(2, 2, 8, 4)), "initial_state must have shape [B, H, L, K, V] = [2, 2, 3, 8, 4]"),
    (dict(initial_state=torch.zeros(2, 2, 3, 8, 4), reverse=True), "initial_state with reverse=True"),
    (dict(offset=4, reverse=True), "offset = 4 with reverse=True"),
    (dict(k=torch.randn(2, 6, 2, 9)), "k must have shape [B, T, H, K]"),
]


@pytest.mark.parametrize("over,needle", HDLA_BAD_INPUT)
def test_bad_input_hdla(backend, over, needle):
    with pytest.raises(ValueError) as info:
        chunk_loglinear_hdla(**on_backend(bad_loglinear_problem("hdla", **over), backend))
    assert needle in str(info.value)


@pytest.mark.parametrize("backend", backends("torch", "interpreter"), indirect=True)
def test_positive_log_decay_is_refused_on_cpu(backend):
    """g > 0 is outside the domain: refused for CPU tensors (unchecked on CUDA: a host sync)."""
    with pytest.raises(ValueError) as info:
        chunk_loglinear_hdla(**on_backend(bad_loglinear_problem("hdla", g=torch.ones(2, 6, 2, 8)), backend))
    assert "g is a log-decay" in str(info.value)


REVERSE_BAD_INPUT = [  # a reversed scan has no cache to continue (the decoding step has no reverse)
    (dict(initial_state=torch.zeros(2, 2, 3, 8, 4), reverse=True), "initial_state with reverse=True"),
    (dict(offset=4, reverse=True), "offset = 4 with reverse=True"),
]


@pytest.mark.parametrize("over,needle", LOGLINEAR_GENERALIZED_BAD_INPUT + REVERSE_BAD_INPUT)
def test_bad_input_generalized(backend, over, needle):
    with pytest.raises(ValueError) as info:
        chunk_loglinear_generalized(**on_backend(bad_loglinear_problem("generalized", **over), backend))
    assert needle in str(info.value)
