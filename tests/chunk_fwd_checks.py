"""The forward kernels of ``kernels/generalized/fwd.py`` (F1 prepare, F2 state pass, F3 output)
under ``TRITON_INTERPRET=1`` on CPU, fp32, against the float64 token loops: the output, the final
state and the per-chunk states h (relative error < 1e-4).

Run by tests/test_chunk_fwd_kernels.py in a pytest subprocess started with ``TRITON_INTERPRET=1``
(tests/interpreted.py says why). Not collected on its own (no ``test_`` prefix)."""
import os

import pytest
import torch

from hdla_vision.kernels.generalized import fwd
from hdla_vision.kernels.generalized.fwd import chunk_output, chunk_prepare, chunk_state_pass, generalized_forward
from hdla_vision.kernels.generalized.naive import naive_generalized
from hdla_vision.kernels.hdla.naive import naive_hdla
from tests.chunk_bwd_cases import DIAG_CASES, diag_gates
from tests.diag_levels_rule import chunk_cumsums, level_paths
from tests.oracle import generalized_problem, hdla_problem, rel_err

assert os.environ.get("TRITON_INTERPRET") == "1", "run this module through tests/test_chunk_fwd_kernels.py"
TOL = 1e-4
HDLA = -1
SCALE = 0.7


def _fp32(p):
    return {n: None if x is None else x.float() for n, x in p.items()}


def _steps_prefix(p, steps, reverse, names):
    """The inputs of the first ``steps`` scan steps (the last ``steps`` tokens when reversed)."""
    seq_len = p["q"].shape[1]
    sl = slice(seq_len - steps, seq_len) if reverse else slice(0, steps)
    return {n: (p[n][:, sl] if n in names else p[n]) for n in p}


def _check_states(loop, p, h, chunk, reverse, names):
    """h[:, :, c] equals the loop's state after c * chunk scan steps."""
    for c in range(1, h.shape[2]):
        _, ref = loop(**_steps_prefix(p, c * chunk, reverse, names), scale=SCALE, output_final_state=True,
                      reverse=reverse)
        assert rel_err(h[:, :, c], ref) < TOL, c


def _run_generalized(r_ab, r_kv, seq_len, chunk, reverse=False, per_head_g=False, g_min=-3.0, dk=16, dv=32,
                     batch=1, h0=True, states=False):
    p = generalized_problem(batch, seq_len, 2, dk, dv, r_kv, r_ab, g_min=g_min, h0=h0, per_head_g=per_head_g)
    ref_o, ref_s = naive_generalized(**p, scale=SCALE, output_final_state=True, reverse=reverse)
    f = _fp32(p)
    o, s, h = generalized_forward(f["q"], f["k"], f["v"], f["a"], f["b"], f["g"], SCALE, f["initial_state"],
                                  reverse, chunk=chunk)
    assert o.dtype == torch.float32 and h.shape == (batch, 2, -(-seq_len // chunk), dk, dv)
    assert rel_err(o, ref_o) < TOL and rel_err(s, ref_s) < TOL, (rel_err(o, ref_o), rel_err(s, ref_s))
    if states:
        _check_states(naive_generalized, p, h, chunk, reverse, ("q", "k", "v", "a", "b", "g"))


@pytest.mark.parametrize("r_ab", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("r_kv", [1, 2])
def test_ranks(r_ab, r_kv):
    """Every rank pair at T = 37 (C = 16: three chunks, the last one partial)."""
    _run_generalized(r_ab, r_kv, 37, 16, reverse=(r_ab + r_kv) % 2 == 1)


def test_rank_4_4_chunk_16():
    _run_generalized(4, 4, 20, 16, dk=16, dv=16)


@pytest.mark.parametrize("reverse", [False, True])
def test_states_per_chunk(reverse):
    """h is the state entering each chunk; C = 32 with T = 70 (three chunks, the last partial)."""
    _run_generalized(2, 1, 70, 32, reverse=reverse, states=True)


@pytest.mark.parametrize("reverse", [False, True])
def test_scalar_decay(reverse):
    """g [B, T, H] (one decay per head) with fast gates."""
    _run_generalized(2, 2, 70, 32, reverse=reverse, per_head_g=True, g_min=-20.0, states=True)


def test_fast_gates_vector_decay():
    """log lambda down to -20 per step: exact diagonal sub-blocks."""
    _run_generalized(1, 1, 70, 32, g_min=-20.0)


def test_chunk_64_batch_2_no_initial_state():
    _run_generalized(1, 1, 70, 64, batch=2, h0=False, dk=16, dv=16)


def _run_hdla(seq_len, chunk, reverse=False, g_min=-3.0, beta=None, dk=16, dv=32, states=False):
    p = hdla_problem(1, seq_len, 2, dk, dv, g_min=g_min)
    if beta is not None:
        p["beta"] = torch.full_like(p["beta"], beta)
    ref_o, ref_s = naive_hdla(**p, scale=SCALE, output_final_state=True, reverse=reverse)
    f = _fp32(p)
    o, s, h = generalized_forward(f["q"], f["k"], f["v"], None, None, f["g"], SCALE, f["initial_state"], reverse,
                                  hdla_beta=f["beta"], chunk=chunk)
    assert rel_err(o, ref_o) < TOL and rel_err(s, ref_s) < TOL, (rel_err(o, ref_o), rel_err(s, ref_s))
    if states:
        _check_states(naive_hdla, p, h, chunk, reverse, ("q", "k", "v", "beta", "g"))


@pytest.mark.parametrize("reverse", [False, True])
def test_hdla(reverse):
    _run_hdla(70, 32, reverse=reverse, states=True)


@pytest.mark.parametrize("beta", [0.0, 2.0])
def test_hdla_beta_edges_fast_gates(beta):
    _run_hdla(37, 16, g_min=-20.0, beta=beta)


def test_hdla_chunk_64():
    _run_hdla(70, 64, dk=16, dv=16)


@pytest.mark.parametrize("r_ab", [HDLA, 3])
def test_fp16_path(r_ab):
    """fp16 inputs take the 16-bit path (tensor-core operands in fp16, N/Qeff/Mo/h stored in fp16;
    the interpreter cannot run bf16 dots): against the loop on the same fp16-rounded inputs."""
    p = hdla_problem(1, 37, 2, 16, 32, g_min=-20.0) if r_ab == HDLA else \
        generalized_problem(1, 37, 2, 16, 32, 1, r_ab, per_head_g=True)
    p = {n: x.to(torch.float16) if n != "g" else x.float() for n, x in p.items()}
    ref = {n: x.double() for n, x in p.items()}
    if r_ab == HDLA:
        ref_o, ref_s = naive_hdla(**ref, scale=SCALE, output_final_state=True, reverse=True)
        o, s, h = generalized_forward(p["q"], p["k"], p["v"], None, None, p["g"], SCALE, p["initial_state"], True,
                                      hdla_beta=p["beta"], chunk=16)
    else:
        ref_o, ref_s = naive_generalized(**ref, scale=SCALE, output_final_state=True)
        o, s, h = generalized_forward(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], SCALE, p["initial_state"],
                                      False, chunk=16)
    assert o.dtype == h.dtype == torch.float16 and s.dtype == torch.float32
    assert rel_err(o, ref_o) < 2e-3 and rel_err(s, ref_s) < 2e-3, (rel_err(o, ref_o), rel_err(s, ref_s))


def test_prepare_layout():
    """N is None at rank 0; shapes of the prepared tensors; bad arguments raise ValueError."""
    p = _fp32(generalized_problem(1, 20, 2, 16, 32, 2, 0))
    prep = chunk_prepare(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], 1.0, False, chunk=16)
    assert prep["N"] is None and prep["Mo"].shape == (1, 2, 2, 16, 32) and prep["Qeff"].shape == (1, 2, 32, 16)
    assert prep["Cc"].shape == (1, 2, 2, 16, 32) and prep["gamma"].shape == (1, 2, 2, 16)
    with pytest.raises(ValueError, match="chunk"):
        chunk_prepare(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], 1.0, False, chunk=48)
    with pytest.raises(ValueError, match="g must be"):
        chunk_prepare(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"][..., :3], 1.0, False)


@pytest.mark.parametrize("per_head_g", [False, True])
def test_cumsum_stage(per_head_g):
    """F0: G is the chunk-local inclusive cumsum of the clamped g in scan order (reversed here) and
    gamma = e^{G at the chunk's last step}; steps past T add 0."""
    p = _fp32(generalized_problem(1, 20, 2, 16, 32, 1, 1, g_min=-20.0, per_head_g=per_head_g))
    prep = chunk_prepare(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], 1.0, True, chunk=16)
    g = torch.flip(p["g"], [1]).clamp_min(-110.0).transpose(1, 2)  # [B, H, T(, K)] in scan order
    g = torch.cat([g, g.new_zeros(g.shape[0], g.shape[1], 12, *g.shape[3:])], 2)
    ref = g.reshape(2, 2, 16, *g.shape[3:]).cumsum(2)
    G = prep["G"].view(2, 2, 16, -1)[..., :16] if not per_head_g else prep["G"].view(2, 2, 16)
    assert torch.allclose(G, ref, atol=1e-5)
    last = ref[:, :, -1] if not per_head_g else ref[:, :, -1, None].expand(2, 2, 16)
    assert torch.allclose(prep["gamma"][0], last.exp(), rtol=1e-5)


@pytest.mark.parametrize("r_ab,chunk,reverse,g_min", [(3, 16, False, -20.0), (3, 32, True, -3.0),
                                                      (4, 16, True, -3.0), (4, 32, False, -20.0)])
def test_high_ranks_dk32(r_ab, chunk, reverse, g_min):
    """r_ab = 3 (padded to 4 rank slots) and 4 at K = 32 (the GPU sweep's failing ranks, at dk > 8):
    row blocks of 64 stack rows, several row blocks per chunk at C = 32."""
    _run_generalized(r_ab, 1, 45, chunk, reverse=reverse, g_min=g_min, dk=32, dv=16)


def test_k16_chunk_64_scalar_decay_rank_2_2():
    """K = 16 at C = 64 with a decay per head and r_ab = r_kv = 2 (four row blocks of 32 stack rows)."""
    _run_generalized(2, 2, 70, 64, per_head_g=True, g_min=-20.0, dk=16, dv=16, reverse=True)


@pytest.mark.parametrize("dk,chunk", [(160, 16), (256, 32)])
def test_hdla_wide_keys(dk, chunk):
    """K = 160 (key block 256, masked channels) and K = 256: full-width key tiles."""
    _run_hdla(40, chunk, dk=dk, dv=16, reverse=dk == 160)


# ----------------------------------------------------------------------------- F1's factored diagonal
# Per 16-token row block, F1 computes the vector-decay diagonal Grams as one product through the block's
# reference where G's half range over the block is below diag_limit, else by levels (2 to 5 products per
# Gram, kernels/generalized/diag_levels.py), or by the exact column loop at diag_limit 0. The launcher
# records which path each row block took (record_path); the checks below predict that map from the gates
# on the host (tests/diag_levels_rule.py) and require every path to match the float64 loop.
BLOCK_GATES = {"mild": (-0.5, 0.0), "ramp": (-1.2, -1.0), "fast": (-20.0, -19.0)}  # per-step log-decay ranges


def _block_gates(shape, pattern, reverse, seed=3):
    """g ``[B, T, H, K]`` float64: scan step p (token p, or T-1-p when reversed) uniform in the range
    ``BLOCK_GATES[pattern[(p // 16) % len(pattern)]]``, so each 16-step row block has its own speed."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    lo = torch.tensor([BLOCK_GATES[pattern[(p // 16) % len(pattern)]][0] for p in range(shape[1])], dtype=torch.float64)
    hi = torch.tensor([BLOCK_GATES[pattern[(p // 16) % len(pattern)]][1] for p in range(shape[1])], dtype=torch.float64)
    if reverse:
        lo, hi = lo.flip(0), hi.flip(0)
    return lo[None, :, None, None] + u * (hi - lo)[None, :, None, None]


def _expected_path(g, chunk, reverse, limit):
    """The path each row block's diagonal should take, ``[B, H, NT, C/16]``: 1 one product, 2..5 by levels
    (tests/diag_levels_rule.py over all K channels: F1 decides per row block from G), 0 the loop at limit 0."""
    G, _ = chunk_cumsums(g, chunk, reverse)
    if limit == 0:
        return torch.zeros(G.shape[:3] + (chunk // 16,), dtype=torch.int8)
    path, margin = level_paths(G, G, G.shape[-1], limit)
    assert margin > 1e-3, f"a row block's bound is {margin} from the limit {limit}: the prediction is not meaningful"
    return path[..., 0].to(torch.int8)


def _forward_recorded(f, reverse, chunk, limit):
    """(o, final state, diag_path) of the forward (F1, F2, F3) with the diagonal limit ``limit``."""
    prep = chunk_prepare(f["q"], f["k"], f["v"], f.get("a"), f.get("b"), f["g"], SCALE, reverse,
                         hdla_beta=f.get("beta"), chunk=chunk, diag_limit=limit, record_path=True)
    h, s = chunk_state_pass(prep, f["initial_state"])
    return chunk_output(prep, h, f["v"], reverse), s, prep["diag_path"]


def _check_diag_paths(p, reverse, chunk, limits, tol=TOL, dtype=torch.float32):
    """For each limit: the recorded path map equals the host's prediction and o, the final state equal
    the float64 loop (on the inputs rounded to ``dtype``); returns the maps and the outputs."""
    f = {n: None if x is None else (x.float() if n == "g" else x.to(dtype)) for n, x in p.items()}
    ref = {n: None if x is None else x.double() for n, x in f.items()}
    loop = naive_hdla if "beta" in p else naive_generalized
    ref_o, ref_s = loop(**ref, scale=SCALE, output_final_state=True, reverse=reverse)
    paths, outs = {}, {}
    for limit in limits:
        o, s, path = _forward_recorded(f, reverse, chunk, limit)
        assert torch.equal(path.cpu(), _expected_path(p["g"], chunk, reverse, limit)), (limit, path)
        assert rel_err(o, ref_o) < tol and rel_err(s, ref_s) < tol, (limit, rel_err(o, ref_o), rel_err(s, ref_s))
        paths[limit], outs[limit] = path, o
    return paths, outs


@pytest.mark.parametrize("pattern,reverse", [("mild", True), ("fast", False), (("mild", "fast"), True)])
def test_diag_paths_hdla(pattern, reverse):
    """HDLA, C = 32, T = 45 (the last chunk partial): mild gates take one product in every row block,
    log lambda ~ -20 per step the levels in every block with two or more steps (one step: G constant),
    the mix alternates inside each chunk; forced loop (limit 0) = default = float64 loop."""
    p = hdla_problem(1, 45, 2, 16, 16)
    p["g"] = _block_gates(p["g"].shape, pattern if isinstance(pattern, tuple) else (pattern,), reverse)
    paths, outs = _check_diag_paths(p, reverse, 32, (fwd.DIAG_LIMIT, 0.0))
    default = paths[fwd.DIAG_LIMIT]
    valid = torch.tensor([45 - 16 * blk >= 2 for blk in range(4)]).view(1, 1, 2, 2)  # row blocks with >= 2 steps
    if pattern == "mild":
        assert bool((default == 1).all())
    elif pattern == "fast":
        assert bool((default[valid.expand_as(default)] > 1).all())
    else:
        assert 1 in default and bool((default > 1).any())
    assert bool((paths[0.0] == 0).all()) and rel_err(outs[0.0], outs[fwd.DIAG_LIMIT]) < 1e-5


def test_diag_limit_decides_rank_2():
    """r_ab = r_kv = 2, C = 64, T = 70: row blocks of half range <= 3.75 (mild) and 7.5-9 (ramp) in one
    chunk; the limit moves the ramp blocks between the paths (35: one product, 5: by halves, whose
    bound is 3.5-4.2; 0: every block the loop), all exact."""
    p = generalized_problem(1, 70, 2, 16, 16, 2, 2)
    p["g"] = _block_gates(p["g"].shape, ("ramp", "mild"), False)
    paths, _ = _check_diag_paths(p, False, 64, (fwd.DIAG_LIMIT, 5.0, 0.0))
    assert bool((paths[fwd.DIAG_LIMIT][:, :, 0] == 1).all())  # chunk 0: every row block the product
    assert bool((paths[5.0][:, :, 0, 0::2] == 2).all()) and bool((paths[5.0][:, :, 0, 1::2] == 1).all())  # ramp
    assert bool((paths[0.0] == 0).all())


def test_diag_paths_fp16():
    """fp16 inputs (the product's factors in TF32: fp16 cannot hold e^lim), mild and fast row blocks
    mixed, rank 1 generalized reversed: within 2e-3 of the loop on the fp16-rounded inputs, every path."""
    p = generalized_problem(1, 45, 2, 16, 32, 1, 1)
    p["g"] = _block_gates(p["g"].shape, ("fast", "mild"), True)
    paths, outs = _check_diag_paths(p, True, 32, (fwd.DIAG_LIMIT, 0.0), tol=2e-3, dtype=torch.float16)
    assert set(paths[fwd.DIAG_LIMIT].flatten().tolist()) == {1, 3}
    assert outs[0.0].dtype == torch.float16


@pytest.mark.parametrize("case", [name for name, spec in DIAG_CASES.items() if not spec[1].get("per_head_g")])
def test_diag_cases_forward(case):
    """The backward's DIAG_CASES of vector decay (tests/chunk_bwd_cases.py: log lambda = -20 on every eighth
    channel, -35, -inf resets, runs of them inside single blocks, HDLA and ranks 1, 2, reversed, T not a
    multiple of the chunk, fp16) through F1, F2, F3: o and the final state within the tolerance of the float64 loop on the
    inputs the kernels get, every row block on the path the rule predicts, and equal to the loop (limit 0)."""
    kind, problem, chunk, reverse, dtype, gates = DIAG_CASES[case]
    p = (hdla_problem if kind == "hdla" else generalized_problem)(**problem)
    p["g"] = diag_gates(p["g"].shape, reverse, **gates)
    fp16 = dtype == "float16"
    _, outs = _check_diag_paths(p, reverse, chunk, (fwd.DIAG_LIMIT, 0.0), tol=2e-3 if fp16 else TOL,
                                dtype=getattr(torch, dtype))
    assert rel_err(outs[0.0], outs[fwd.DIAG_LIMIT]) < (1e-3 if fp16 else 1e-5)


def test_diag_limit_bad_values():
    p = _fp32(hdla_problem(1, 20, 1, 16, 16))
    for bad in (-1.0, 36.0):
        with pytest.raises(ValueError, match="diag_limit"):
            chunk_prepare(p["q"], p["k"], p["v"], None, None, p["g"], 1.0, False, hdla_beta=p["beta"], diag_limit=bad)


def test_diag_path_scalar_decay_not_recorded():
    """A decay per head never takes either vector path: its map stays -1."""
    p = _fp32(generalized_problem(1, 20, 2, 16, 16, 1, 1, per_head_g=True))
    prep = chunk_prepare(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], 1.0, False, chunk=16, record_path=True)
    assert prep["diag_path"].shape == (1, 2, 2, 1) and bool((prep["diag_path"] == -1).all())


# F1 for HDLA from six base Grams of q and k ($HDLA_VISION_F1_GRAM=1, chunk_intra_kernel's HDLA_GRAM): the factored
# diagonal blocks, the substitution (b) and the query rows (c) per rank, against the float64 loop and against the
# rank-stack F1 on the same inputs. Chunks 16 / 32 / 64, K = 80 (BK 128, masked columns), beta at 0 and 2, reversed,
# T not a multiple of the chunk, fast row blocks that keep the levels beside mild ones, fp16.
# Mild gates (log lambda in [-0.3, 0]) keep the earlier row blocks' terms well above the tolerance.
F1_GRAM_CASES = {
    "c32_rev_states": dict(seq_len=70, chunk=32, reverse=True, dk=16, dv=32, g_min=-0.3),
    "c64": dict(seq_len=70, chunk=64, dk=16, dv=16, g_min=-0.3),
    "c16_k80": dict(seq_len=45, chunk=16, dk=80, dv=8, g_min=-0.3),
    "beta0_fast": dict(seq_len=37, chunk=16, g_min=-20.0, beta=0.0),
    "beta2_c32": dict(seq_len=45, chunk=32, g_min=-0.3, beta=2.0, reverse=True),
}


def _switched_forward(env, flag, f, reverse, chunk, monkeypatch):
    """F1, F2, F3 with ``$env`` set to ``flag``: (o, final state, h); HDLA where ``f`` has beta."""
    monkeypatch.setenv(env, flag)
    if "beta" not in f:
        return generalized_forward(f["q"], f["k"], f["v"], f["a"], f["b"], f["g"], SCALE, f["initial_state"],
                                   reverse, chunk=chunk)
    prep = chunk_prepare(f["q"], f["k"], f["v"], None, None, f["g"], SCALE, reverse, hdla_beta=f["beta"], chunk=chunk)
    h, s = chunk_state_pass(prep, f["initial_state"])
    return chunk_output(prep, h, f["v"], reverse), s, h


def _check_switched(env, p, reverse, chunk, monkeypatch):
    """``$env`` on: against the float64 loop (< TOL) and against it off on the same inputs (< 1e-5); returns h."""
    loop = naive_hdla if "beta" in p else naive_generalized
    ref_o, ref_s = loop(**p, scale=SCALE, output_final_state=True, reverse=reverse)
    f = _fp32(p)
    o, s, h = _switched_forward(env, "1", f, reverse, chunk, monkeypatch)
    o0, _, h0 = _switched_forward(env, "0", f, reverse, chunk, monkeypatch)
    assert rel_err(o, ref_o) < TOL and rel_err(s, ref_s) < TOL, (rel_err(o, ref_o), rel_err(s, ref_s))
    assert rel_err(o, o0) < 1e-5 and rel_err(h, h0) < 1e-5, (rel_err(o, o0), rel_err(h, h0))
    return h


def _hdla_switch_problem(spec):
    """(problem, chunk, reverse) of an HDLA case dict (seq_len, chunk, dk, dv, g_min; reverse, beta optional)."""
    spec = dict(spec)
    seq_len, chunk, reverse = spec.pop("seq_len"), spec.pop("chunk"), spec.pop("reverse", False)
    beta = spec.pop("beta", None)
    p = hdla_problem(1, seq_len, 2, spec.pop("dk", 16), spec.pop("dv", 16), g_min=spec.pop("g_min"))
    if beta is not None:
        p["beta"] = torch.full_like(p["beta"], beta)
    return p, chunk, reverse


@pytest.mark.parametrize("case", list(F1_GRAM_CASES))
def test_hdla_f1_single_gram(case, monkeypatch):
    p, chunk, reverse = _hdla_switch_problem(F1_GRAM_CASES[case])
    h = _check_switched("HDLA_VISION_F1_GRAM", p, reverse, chunk, monkeypatch)
    if case == "c32_rev_states":
        _check_states(naive_hdla, p, h, chunk, reverse, ("q", "k", "v", "beta", "g"))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_hdla_f1_single_gram_mixed_paths(dtype, monkeypatch):
    """Mild and fast row blocks alternating (reversed, C = 32): the mild ones take the base Grams, the fast ones
    the levels over the rank stacks, each on the path the rule predicts; fp16 within 2e-3 of the loop."""
    monkeypatch.setenv("HDLA_VISION_F1_GRAM", "1")
    p = hdla_problem(1, 45, 2, 32, 16)
    p["g"] = _block_gates(p["g"].shape, ("mild", "fast"), True)
    fp16 = dtype == "float16"
    paths, _ = _check_diag_paths(p, True, 32, (fwd.DIAG_LIMIT,), tol=2e-3 if fp16 else TOL,
                                 dtype=getattr(torch, dtype))
    assert set(paths[fwd.DIAG_LIMIT].flatten().tolist()) >= {1, 3}


def test_f1_gram_flag_rejects_other_values(monkeypatch):
    monkeypatch.setenv("HDLA_VISION_F1_GRAM", "yes")
    with pytest.raises(ValueError, match="HDLA_VISION_F1_GRAM"):
        fwd.f1_hdla_gram()
