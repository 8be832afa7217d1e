"""The chunk backward (issue 11): its float64 specification against autograd through the token loops,
and the Triton kernels of kernels/generalized/bwd.py under TRITON_INTERPRET=1 (fp32, CPU, in a
subprocess: tests/chunk_bwd_worker.py) against the same, relative error < 1e-4 for every gradient;
B2's diagonal Gram blocks on each of their paths (one factored product, by levels, the token loop), each
block's path as its gates decide; B2's 16-bit scratch bit-identical to fp32 scratch (fp16 inputs)."""

import pytest
import torch

from hdla_vision.kernels.generalized.naive import naive_generalized
from hdla_vision.kernels.hdla.naive import naive_hdla
from tests.chunk_bwd_reference import generalized_backward_reference, hdla_backward_reference
from tests.chunk_bwd_cases import CASES, DIAG_CASES, POOL_CASES, SCRATCH_CASES, SINGLE_GRAM_CASES, diag_gates
from tests.diag_levels_rule import chunk_cumsums, level_paths
from tests.oracle import generalized_problem, hdla_problem, rel_err
from tests.interpreted import run_interpreted_json

TOL = 1e-4
FP16_TOL = 5e-3  # against the loop on the fp16-rounded inputs (tests/chunk64_ops_checks.py)


def _loop_grads(loop, problem, names, reverse, scale=0.7):
    ins = [problem[n].clone().requires_grad_() for n in names]
    h0 = problem["initial_state"].clone().requires_grad_()
    o, s = loop(*ins, scale, h0, True, reverse)
    do, dht = torch.randn_like(o), torch.randn_like(s)
    return do, dht, torch.autograd.grad((o * do).sum() + (s * dht).sum(), ins + [h0])


@pytest.mark.parametrize("r_ab,r_kv,reverse,per_head,g_min,chunk", [
    (0, 1, False, False, -3.0, 16), (1, 2, True, False, -3.0, 16), (2, 1, False, False, -20.0, 32),
    (3, 4, False, True, -3.0, 16), (4, 1, True, False, -3.0, 64)])
def test_spec_matches_autograd_through_loop(r_ab, r_kv, reverse, per_head, g_min, chunk):
    torch.manual_seed(0)
    p = generalized_problem(2, 37, 2, 8, 6, r_kv, r_ab, g_min=g_min, per_head_g=per_head)
    names = ["q", "k", "v", "a", "b", "g"]
    do, dht, ref = _loop_grads(naive_generalized, p, names, reverse)
    mine = generalized_backward_reference(do, dht, *(p[n] for n in names), 0.7, p["initial_state"], reverse, chunk)
    for name, m, r in zip(names + ["h0"], mine, ref):
        assert rel_err(m, r) < 1e-10, name


@pytest.mark.parametrize("reverse,g_min,chunk", [(False, -3.0, 16), (True, -20.0, 32)])
def test_hdla_spec_matches_autograd_through_loop(reverse, g_min, chunk):
    torch.manual_seed(0)
    p = hdla_problem(2, 37, 2, 8, 6, g_min=g_min)
    names = ["q", "k", "v", "beta", "g"]
    do, dht, ref = _loop_grads(naive_hdla, p, names, reverse)
    mine = hdla_backward_reference(do, dht, *(p[n] for n in names), 0.7, p["initial_state"], reverse, chunk)
    for name, m, r in zip(names + ["h0"], mine, ref):
        assert rel_err(m, r) < 1e-10, name


@pytest.fixture(scope="module")
def interpreted_errors():
    return run_interpreted_json("tests.chunk_bwd_worker")


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(CASES))
def test_backward_kernels_match_float64_loop(interpreted_errors, case):
    errors = interpreted_errors[case]
    assert len(errors) >= 5, errors  # every input's gradient was compared
    bad = {name: err for name, err in errors.items() if not err < TOL}  # NaN fails too
    assert not bad, f"{case}: relative errors above {TOL}: {bad}"


def test_bad_shapes_raise_before_launch():
    from hdla_vision.kernels.generalized.bwd import generalized_backward

    p = generalized_problem(1, 5, 1, 8, 4, 1, 1)
    args = [p[n].float() for n in ("q", "k", "v", "a", "b", "g")]
    h = torch.zeros(1, 1, 1, 8, 4)
    with pytest.raises(ValueError, match="do must be"):
        generalized_backward(torch.zeros(1, 5, 1, 3), None, *args, 1.0, None, h, False)
    with pytest.raises(ValueError, match="a and b"):
        generalized_backward(torch.zeros(1, 5, 1, 4), None, *args[:3], args[3], args[4][:, :, :, :, :4], args[5],
                             1.0, None, h, False)
    with pytest.raises(ValueError, match="h must be"):
        generalized_backward(torch.zeros(1, 5, 1, 4), None, *args, 1.0, None, h[0], False)


@pytest.fixture(scope="module")
def diag_results():
    return run_interpreted_json("tests.chunk_bwd_worker", args=["--diag"])


def _expected_paths(case, tile):
    """[4 Grams, B*H, NT * C/16, K tiles of width ``tile``]: the path each diagonal block and K tile
    should take (tests/diag_levels_rule.py: 1 one product, 2..5 by levels), from the case's gates as the
    kernels receive them; M_QK, M_QA compare G with G, L_AB, L_KB the rows' G' with G. A decay per head:
    always 1."""
    from hdla_vision.kernels.generalized.bwd_chunk import DIAG_LIMIT

    kind, problem, chunk, reverse, dtype, gates = DIAG_CASES[case]
    batch, seq_len, heads, dk = (problem[n] for n in ("batch", "seq_len", "heads", "dk"))
    if problem.get("per_head_g"):
        return torch.ones(4, batch * heads, -(-seq_len // chunk) * chunk // 16, -(-dk // tile), dtype=torch.long)
    g = diag_gates((batch, seq_len, heads, dk), reverse, **gates).to(getattr(torch, dtype)).double()
    G, Gp = chunk_cumsums(g, chunk, reverse)
    paths = []
    for X in (G, G, Gp, Gp):
        path, margin = level_paths(G, X, tile, DIAG_LIMIT)
        assert margin > 1e-3, f"{case}: a block's bound is {margin} from the limit: the prediction is not meaningful"
        paths.append(path)
    return torch.stack(paths).flatten(1, 2).flatten(2, 3)  # [4, B*H, NT * C/16, tiles]


def test_diag_cases_take_every_path():
    """DIAG_CASES exercise one product and each number of levels (paths 1..5) in S2's and S5a's tiles."""
    from hdla_vision.kernels.generalized.bwd_chunk import b2_config

    for stage in ("S2", "S5a"):
        taken = set()
        for case, (kind, problem, chunk, *_) in DIAG_CASES.items():
            r_kv, r_ab = (1, 2) if kind == "hdla" else (problem["r_kv"], problem["r_ab"])
            cfg = b2_config(problem["dk"], problem["dv"], chunk, r_kv, r_ab)
            key = "BKV" if stage == "S5a" else ("BKG" if kind == "hdla" else "BKS")
            taken |= set(_expected_paths(case, cfg[key]).flatten().tolist())
        assert taken == {1, 2, 3, 4, 5}, (stage, taken)


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(DIAG_CASES))
def test_diagonal_blocks_match_float64_loop(diag_results, case):
    """Every gradient within the tolerance of the float64 loop with the default limit and with every
    diagonal block forced through the token loop (diag_limit 0), and the two agree."""
    fp16 = DIAG_CASES[case][4] == "float16"
    tol, agree = (FP16_TOL, 1e-3) if fp16 else (TOL, 1e-5)
    result = diag_results[case]
    for run in ("default", "loop"):
        assert len(result[run]) >= 6, result[run]
        bad = {name: err for name, err in result[run].items() if not err < tol}  # NaN fails too
        assert not bad, f"{case} ({run}): relative errors above {tol}: {bad}"
    apart = {name: err for name, err in result["default_vs_loop"].items() if not err < agree}
    assert not apart, f"{case}: default and token-loop gradients differ by more than {agree}: {apart}"


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(DIAG_CASES))
def test_diagonal_block_paths_follow_the_gates(diag_results, case):
    """The path each diagonal block took in S2 (four Grams) and S5a (four launches), after their levels
    passes: one product where the block's bound allows it, else the levels the gates call for (the
    cross levels down to the largest groups whose bound allows one product), per block and K tile, as
    tests/diag_levels_rule.py predicts; every block through the token loop at diag_limit 0 (a decay per
    head: always the product, exact without a limit)."""
    from hdla_vision.kernels.generalized.bwd_chunk import b2_config

    kind, problem, chunk, *_ = DIAG_CASES[case]
    r_kv, r_ab = (1, 2) if kind == "hdla" else (problem["r_kv"], problem["r_ab"])
    cfg = b2_config(problem["dk"], problem["dv"], chunk, r_kv, r_ab)
    every_block_loops = not problem.get("per_head_g")
    heads = problem["batch"] * problem["heads"]
    for run in ("default", "loop"):
        paths = diag_results[case][run + "_paths"]
        gram = torch.tensor(paths["gram"]).transpose(0, 1)  # [4 Grams, blocks, C/16, K tiles]
        vjp = torch.tensor(paths["gram_vjp"])  # [4 Grams, blocks, C/16, K tiles]
        for got, tile in ((gram, cfg["BKG" if kind == "hdla" else "BKS"]), (vjp, cfg["BKV"])):
            want = _expected_paths(case, tile)[:4 if r_ab else 1]
            if run == "loop" and every_block_loops:
                want = torch.zeros_like(want)
            got = got.reshape(4, heads, -1, got.shape[-1])[:4 if r_ab else 1]  # blocks: (head, chunk), chunk fastest
            assert torch.equal(got.long(), want), f"{case} ({run}, tile {tile}):\n{got}\nexpected\n{want}"


def test_diag_limit_outside_its_range_raises():
    from hdla_vision.kernels.generalized.bwd import generalized_backward

    p = generalized_problem(1, 5, 1, 8, 4, 1, 1)
    args = [p[n].float() for n in ("q", "k", "v", "a", "b", "g")]
    for limit in (-1.0, 36.0):
        with pytest.raises(ValueError, match="diag_limit"):
            generalized_backward(torch.zeros(1, 5, 1, 4), None, *args, 1.0, None, torch.zeros(1, 1, 1, 8, 4), False,
                                 diag_limit=limit)


def test_diag_precision_rule(monkeypatch):
    """The factored diagonal products for 16-bit inputs by default: tf32x3 in M_QK's and M_QA's VJPs (S5a) and in
    S5b's levels, tf32 in L_AB's and L_KB's VJPs and in the Grams (S2, S2b); the benchmark overrides pick bf16 or
    tf32 for every stage, or S2's or S5a's alone (one name or four), never fp16 operands (bf16 becomes tf32 for
    fp16 inputs); a bad name or count raises."""
    from hdla_vision.kernels.generalized import bwd_chunk

    for name in ("", "_S2", "_S5A"):
        monkeypatch.delenv("HDLA_VISION_DIAG_PRECISION" + name, raising=False)
    assert bwd_chunk.diag_lowp(1) == 3 and bwd_chunk.diag_lowp(2) == 3
    cfg = lambda: bwd_chunk.b2_config(64, 64, 32, 1, 2, True)  # noqa: E731
    assert cfg()["diag_gram"] == "tf32" and bwd_chunk.diag_lowp(1, cfg()["diag_gram"]) == 0
    assert [bwd_chunk.diag_lowp(1, n) for n in cfg()["diag_vjp"]] == [3, 3, 0, 0]
    monkeypatch.setenv("HDLA_VISION_DIAG_PRECISION_S2", "bf16")
    assert bwd_chunk.diag_lowp(1, cfg()["diag_gram"]) == 1 and bwd_chunk.diag_lowp(2, cfg()["diag_gram"]) == 0
    assert cfg()["diag_vjp"] == bwd_chunk.VJP_DIAG_PRECISIONS
    monkeypatch.setenv("HDLA_VISION_DIAG_PRECISION_S5A", "bf16,tf32,tf32x3,tf32")
    assert cfg()["diag_vjp"] == ("bf16", "tf32", "tf32x3", "tf32")
    monkeypatch.setenv("HDLA_VISION_DIAG_PRECISION_S5A", "tf32,tf32")
    with pytest.raises(ValueError, match="HDLA_VISION_DIAG_PRECISION_S5A"):
        cfg()
    monkeypatch.delenv("HDLA_VISION_DIAG_PRECISION_S2")
    monkeypatch.delenv("HDLA_VISION_DIAG_PRECISION_S5A")
    monkeypatch.setenv("HDLA_VISION_DIAG_PRECISION", "tf32x3")
    assert bwd_chunk.diag_lowp(1, cfg()["diag_gram"]) == 3 and cfg()["diag_vjp"] == "tf32x3"
    monkeypatch.setenv("HDLA_VISION_DIAG_PRECISION", "bf16")
    assert bwd_chunk.diag_lowp(1) == 1 and bwd_chunk.diag_lowp(2) == 0
    monkeypatch.setenv("HDLA_VISION_DIAG_PRECISION", "fp8")
    with pytest.raises(ValueError, match="HDLA_VISION_DIAG_PRECISION"):
        bwd_chunk.diag_lowp(1)


@pytest.fixture(scope="module")
def scratch_results():
    return run_interpreted_json("tests.chunk_bwd_worker", args=["--scratch"])


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(SCRATCH_CASES))
@pytest.mark.parametrize("mode", ["lowp", "lowp_stacks"])
def test_lowp_scratch_is_bit_identical(scratch_results, case, mode):
    """fp16 inputs: every gradient with B2's operand-only scratch in fp16 (S4 reading T and At from fp16
    copies; "lowp_stacks": and the stacks that copy k, a, b in fp16 too) equals (torch.equal) the one with all
    scratch fp32 and no copies, and is within the fp16 tolerance of the float64 loop."""
    from hdla_vision.kernels.generalized.bwd_chunk import OPERAND_COPIES, OPERAND_ONLY

    result = scratch_results[case][mode]
    assert len(result["identical"]) >= 6, result
    assert set(OPERAND_ONLY + OPERAND_COPIES) | {"dvs"} <= set(result["scratch"]), result["scratch"]
    assert ("kf" in result["scratch"]) == (mode == "lowp_stacks"), result["scratch"]
    differ = {name: result["max_diff"][name] for name, same in result["identical"].items() if not same}
    assert not differ, f"{case}: 16-bit scratch changed these gradients (largest difference): {differ}"
    bad = {name: err for name, err in result["error"].items() if not err < FP16_TOL}
    assert not bad, f"{case}: relative errors above {FP16_TOL}: {bad}"


def test_scratch_dtypes_rule(monkeypatch):
    """Only 16-bit inputs get 16-bit scratch and S4's 16-bit copies of T and At (M_QK only at r_ab = 0, where
    no fp32 sum reads it; HDLA's Bh, and no fp32 At for HDLA; dV's stack in v's dtype); "fp32" turns it off; a
    bad name raises."""
    from hdla_vision.kernels.generalized import bwd_chunk

    monkeypatch.delenv("HDLA_VISION_B2_SCRATCH", raising=False)
    bf, fp = torch.bfloat16, torch.float16
    assert bwd_chunk.scratch_dtypes(torch.float32, torch.float32, 2) == {}
    lowp = bwd_chunk.scratch_dtypes(bf, bf, 2)
    assert set(lowp) == set(bwd_chunk.OPERAND_ONLY + bwd_chunk.OPERAND_COPIES) | {"dvs"}
    assert set(lowp.values()) == {bf}
    assert bwd_chunk.scratch_dtypes(fp, fp, 0)["mqk"] == fp
    assert set(bwd_chunk.scratch_dtypes(bf, bf, 2, hdla=True, lean=True)) == set(lowp) | {"bh"}  # S5 does not read Bh
    shapes = bwd_chunk.scratch_shapes(32, 64, 64, 1, 2, True, False,
                                      bwd_chunk.scratch_dtypes(bf, bf, 2, hdla=True, lean=True))
    assert shapes["at"][0] == (0,) and shapes["at16"][0] == (64, 64)  # nor At: S4 reads its 16-bit copy
    assert bwd_chunk.scratch_dtypes(bf, torch.float32, 1)["dvs"] == torch.float32
    monkeypatch.setenv("HDLA_VISION_B2_SCRATCH", "lowp_stacks")  # and the stacks that copy 16-bit inputs
    assert set(bwd_chunk.scratch_dtypes(bf, bf, 2)) == set(lowp) | {"kf", "af", "bf"}
    assert set(bwd_chunk.scratch_dtypes(bf, bf, 2, hdla=True)) == set(lowp) | {"kf"}  # HDLA's A, B are built
    monkeypatch.setenv("HDLA_VISION_B2_SCRATCH", "fp32")
    assert bwd_chunk.scratch_dtypes(bf, bf, 2) == {}
    monkeypatch.setenv("HDLA_VISION_B2_SCRATCH", "fp8")
    with pytest.raises(ValueError, match="HDLA_VISION_B2_SCRATCH"):
        bwd_chunk.scratch_dtypes(bf, bf, 2)


@pytest.fixture(scope="module")
def pool_results():
    return run_interpreted_json("tests.chunk_bwd_worker", args=["--pool"])


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(POOL_CASES))
def test_scratch_pool_changes_no_bit(pool_results, case):
    """B2's scratch carved from the lifetime-planned pool gives the gradients (torch.equal) of one allocation
    per tensor, with every scratch byte NaN before B2 runs: no tensor is read after another that shares its
    memory overwrote it, or before it is written; the gradients are finite and within tolerance of the
    float64 loop. S4's products launched one at a time give the bits of its grouped launches."""
    result = pool_results[case]
    dtype = POOL_CASES[case][4]
    assert len(result["identical"]) >= 6, result
    assert all(result["identical"].values()), f"{case}: the pool changed {result['identical']}"
    assert result["s4_single_identical"].keys() == result["identical"].keys()
    assert all(result["s4_single_identical"].values()), f"{case}: S4's grouping changed {result['s4_single_identical']}"
    assert all(result["finite"].values()), f"{case}: non-finite gradients {result['finite']}"
    tol = TOL if dtype == "float32" else FP16_TOL
    bad = {name: err for name, err in result["error"].items() if not err < tol}
    assert not bad, f"{case}: relative errors above {tol}: {bad}"


@pytest.fixture(scope="module")
def single_gram_results():
    return run_interpreted_json("tests.chunk_bwd_worker", args=["--single-gram"])


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(SINGLE_GRAM_CASES))
def test_hdla_single_gram_equals_rank_stack_grams(single_gram_results, case):
    """HDLA's S2 and S5a through six base Grams of q and k (bwd_chunk._hdla_gram_kernel, _hdla_gram_vjp_kernel)
    give the four Grams and the stack gradients (after S5b) of the launches over the rank stacks (to rounding: 1e-6
    in fp32, 1e-4 with fp16 inputs, whose off-diagonal products take fp16 operands either way; gk with A's rank-1
    rows, which hold 0 where S5b adds nothing), leave S2b and S5b the blocks they must (the same paths after them,
    and the mixed gates send some to the levels), and the gradients stay within tolerance of float64."""
    result = single_gram_results[case]
    fp32 = SINGLE_GRAM_CASES[case][3] == "float32"
    for key, names in (("gram_diff", {"mqk", "mqa", "lab", "lkb"}), ("vjp_diff", {"gq", "gb", "ga0", "gk"})):
        diffs = {n: result[key][n] for n in names}
        apart = {n: d for n, d in diffs.items() if not d < (1e-6 if fp32 else 1e-4)}
        assert not apart, f"{case}: {result[key]}"
    fast = SINGLE_GRAM_CASES[case][4] is not None
    assert result["paths_equal"] and result["vjp_paths_equal"], case
    assert (result["levels_taken"] > 0) == fast and (result["vjp_levels_taken"] > 0) == fast, result
    if not fast:
        assert result["vjp_diff"]["ga1_max"] == 0.0, result["vjp_diff"]
    tol = TOL if fp32 else FP16_TOL
    bad = {name: err for name, err in result["error"].items() if not err < tol}
    assert len(result["error"]) == 6 and not bad, f"{case}: relative errors above {tol}: {bad}"


def _live_overlaps(offsets, sizes, spans):
    """Pairs of tensors that share a byte while both are live (first <= other's last and vice versa)."""
    names = [n for n in sizes if sizes[n]]
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if offsets[a] < offsets[b] + sizes[b] and offsets[b] < offsets[a] + sizes[a]
            and not (spans[a][1] < spans[b][0] or spans[b][1] < spans[a][0])]


@pytest.mark.parametrize("r_ab,r_kv,hdla,scalar,dtype", [(2, 1, True, False, torch.bfloat16),
                                                        (2, 1, True, False, torch.float32),
                                                        (0, 2, False, False, torch.float16),
                                                        (3, 1, False, True, torch.bfloat16)])
def test_scratch_plan_separates_live_tensors(r_ab, r_kv, hdla, scalar, dtype):
    """plan_scratch never places two tensors that are live at a common stage on a common byte, aligns every
    offset, and needs less than the sum of the sizes (HDLA bf16 at d = 64, chunk 32: at most 70% of it)."""
    from hdla_vision.kernels.generalized import bwd_chunk

    dtypes = bwd_chunk.scratch_dtypes(dtype, dtype, r_ab)
    shapes = bwd_chunk.scratch_shapes(32, 64, 64, r_kv, r_ab, hdla, scalar, dtypes)
    sizes = {n: torch.Size(s).numel() * d.itemsize for n, (s, d) in shapes.items()}
    assert set(sizes) == set(bwd_chunk.SCRATCH_LIFETIMES)
    spans = bwd_chunk.scratch_lifetimes(r_ab, sizes["tm16"] > 0)
    offsets, total = bwd_chunk.plan_scratch(sizes, spans)
    assert not _live_overlaps(offsets, sizes, spans)
    assert all(o % bwd_chunk.POOL_ALIGN == 0 for o in offsets.values())
    assert max(offsets[n] + sizes[n] for n in sizes) <= total < sum(sizes.values())
    if hdla and dtype == torch.bfloat16:
        assert total <= 0.70 * sum(sizes.values()), (total, sum(sizes.values()))


def test_scratch_lifetimes_follow_the_launch_order():
    """Every lifetime starts at its writer and ends no earlier; the reads the kernels make at S5 (the stacks,
    the cumsums, the gradient buffers) and at S7 (dV's stack) are inside the spans."""
    from hdla_vision.kernels.generalized import bwd_chunk

    spans = bwd_chunk.scratch_lifetimes(2, False)
    assert all(first <= last for first, last in spans.values())
    s5 = bwd_chunk.STAGES.index("S5")
    for name in ("gs", "gps", "xq", "kf", "kt", "af", "bf", "at", "bh", "dqe", "det", "dat", "dwp", "gq", "gk", "ga",
                 "gb"):
        assert spans[name][1] >= s5, name
    assert spans["dvs"][1] == bwd_chunk.STAGES.index("S7") and spans["s"][1] == bwd_chunk.STAGES.index("S6")
    for cotangent, *_ in bwd_chunk.GRAM_VJPS:  # S5b reads every Gram's cotangent
        assert spans[cotangent][1] >= bwd_chunk.STAGES.index("S5b")
    for name in ("bt", "s", "kf"):  # S2b rebuilds HDLA's A, B rows from them (lean stacks)
        assert spans[name][1] >= bwd_chunk.STAGES.index("S2b"), name
    assert [g[7:] for g in bwd_chunk.GRAM_VJPS] == [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("pool", [True, False])
def test_allocate_scratch_views_follow_the_plan(pool):
    """allocate_scratch's tensors (pooled: strided views of one allocation in each dtype) have their shapes and
    dtypes, are contiguous and start at the planned byte offsets; the plan, made once per layout, is the one
    plan_scratch gives and follows the pool switch."""
    from hdla_vision.kernels.generalized import bwd_chunk

    shapes = bwd_chunk.scratch_shapes(32, 48, 80, 1, 2, True, False,
                                      bwd_chunk.scratch_dtypes(torch.bfloat16, torch.float16, 2))
    blocks = 5
    nbytes, offsets, per_block = bwd_chunk.scratch_layout(shapes, 2, pool)
    z = bwd_chunk.allocate_scratch(shapes, blocks, "cpu", 2, pool)
    assert set(z) == set(shapes)
    for name, (shape, dtype) in shapes.items():
        assert z[name].shape == (blocks, *shape) and z[name].dtype == dtype and z[name].is_contiguous(), name
    if not pool:
        assert offsets is None and per_block == sum(nbytes.values())
        return
    spans = bwd_chunk.scratch_lifetimes(2, nbytes["tm16"] > 0)
    assert (offsets, per_block) == bwd_chunk.plan_scratch(dict(nbytes), spans)
    base = z["w"].untyped_storage().data_ptr()
    assert all(z[n].untyped_storage().data_ptr() == base for n in z)
    for name, size in nbytes.items():
        if size:
            assert z[name].data_ptr() - base == offsets[name] * blocks, name
    assert bwd_chunk.scratch_layout(shapes, 2, pool) is bwd_chunk.scratch_layout(shapes, 2, pool)
