"""Log-linear ops (kernels/loglinear) on CPU: the bucket grid, the chunk ops and the decoding step
against the float64 loops written from the definition (kernels/README.md §7)."""
import pytest
import torch
import torch.nn.functional as F

from hdla_vision.kernels import (
    chunk_generalized,
    chunk_hdla,
    chunk_loglinear_generalized,
    chunk_loglinear_hdla,
    fused_recurrent_loglinear_generalized,
    fused_recurrent_loglinear_hdla,
    naive_loglinear_generalized,
    naive_loglinear_hdla,
)
from hdla_vision.kernels.loglinear.levels import initial_level, merge_target, token_level
from tests.oracle import generalized_problem, hdla_problem, rel_err

OPS = {
    "hdla": (chunk_loglinear_hdla, naive_loglinear_hdla, fused_recurrent_loglinear_hdla),
    "generalized": (chunk_loglinear_generalized, naive_loglinear_generalized, fused_recurrent_loglinear_generalized),
}
GRAD_NAMES = {"hdla": ("q", "k", "v", "beta", "g", "level_scales", "initial_state"),
              "generalized": ("q", "k", "v", "a", "b", "g", "level_scales", "initial_state")}
UNBOUNDED = 64  # more levels than any test sequence has: every bucket gets its own weight


def loglinear_problem(kind, seq_len, num_levels, batch=2, heads=2, dk=8, dv=4, r_kv=1, r_ab=1, g_min=-3.0,
                      h0=False, scalar_decay=False, resets=0.0, seed=0):
    """Random float64 inputs: the linear op's (tests/oracle.py), level weights softplus(N(0, 1))
    ``[B, T, H, L]`` and, with ``h0``, a random cache ``[B, H, L, K, V]`` (every level filled,
    also those a Fenwick cache would keep empty); ``resets``: a fraction of g = -inf."""
    if kind == "hdla":
        p = hdla_problem(batch, seq_len, heads, dk, dv, g_min=g_min, h0=False, seed=seed, resets=resets)
    else:
        p = generalized_problem(batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min=g_min, h0=False, seed=seed,
                                resets=resets)
    if scalar_decay:
        p["g"] = p["g"][..., :1].expand_as(p["g"]).contiguous()
    gen = torch.Generator().manual_seed(seed + 100)
    p["level_scales"] = F.softplus(torch.randn(batch, seq_len, heads, num_levels, generator=gen, dtype=torch.float64))
    p["initial_state"] = (torch.randn(batch, heads, num_levels, dk, dv, generator=gen, dtype=torch.float64)
                          if h0 else None)
    return p


def compare_with_definition(kind, inputs, dtype=torch.float32, **kwargs):
    """Relative errors of the chunk op run in ``dtype`` against the float64 loop: the output, the
    final levels and every gradient (random cotangents on both outputs)."""
    chunk, loop, _ = OPS[kind]
    names = [n for n in GRAD_NAMES[kind] if inputs[n] is not None and inputs[n].numel() > 0]
    empty = [n for n in GRAD_NAMES[kind] if inputs[n] is not None and inputs[n].numel() == 0]

    def run(fn, cast):
        leaves = {n: None if x is None else cast(x).requires_grad_(n in names + empty) for n, x in inputs.items()}
        return leaves, *fn(**leaves, output_final_state=True, **kwargs)

    ref_leaves, ref_o, ref_s = run(loop, lambda x: x.clone())
    gen = torch.Generator().manual_seed(1)
    do, ds = torch.randn(ref_o.shape, generator=gen, dtype=torch.float64), torch.randn(ref_s.shape, generator=gen,
                                                                                          dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref_o * do).sum() + (ref_s * ds).sum(), [ref_leaves[n] for n in names])
    leaves, o, s = run(chunk, lambda x: x.detach().to(dtype))
    assert o.dtype == dtype and s.dtype == dtype
    grads = torch.autograd.grad((o.double() * do).sum() + (s.double() * ds).sum(),
                                [leaves[n] for n in names + empty], allow_unused=True)
    errors = {"o": rel_err(o, ref_o), "final_state": rel_err(s, ref_s)}
    errors.update({f"d{n}": rel_err(g, r) for n, g, r in zip(names, grads, ref_grads)})
    for n, g in zip(empty, grads[len(names):]):  # a, b at r_ab = 0 get (empty) gradients of their shape
        errors[f"d{n}"] = 0.0 if g is not None and g.shape == leaves[n].shape else float("inf")
    return errors


# ---- the bucket grid -------------------------------------------------------------------------

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


# ---- chunk ops against the definition ------------------------------------------------------

@pytest.mark.parametrize("seq_len,num_levels,offset,h0,reverse,g_min", [
    (1, 3, 0, False, False, -3.0),
    (7, UNBOUNDED, 0, False, False, -3.0),
    (33, 4, 0, False, True, -3.0),
    (64, UNBOUNDED, 0, False, False, -20.0),
    (33, 5, 11, True, False, -3.0),
    (15, 3, 0, True, False, -1.0),
    (17, 6, 1000, True, False, -3.0),
])
def test_hdla_chunk_matches_definition(seq_len, num_levels, offset, h0, reverse, g_min):
    p = loglinear_problem("hdla", seq_len, num_levels, g_min=g_min, h0=h0)
    errors = compare_with_definition("hdla", p, scale=0.5, reverse=reverse, offset=offset)
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("seq_len,num_levels,r_kv,r_ab,scalar_decay,offset,h0,reverse", [
    (33, UNBOUNDED, 1, 0, False, 0, False, False),  # GLA-like: rank 0, vector decay
    (7, 3, 1, 0, False, 0, False, True),
    (64, 5, 1, 1, True, 0, False, False),  # rank 1 with a scalar decay (Gated-DeltaNet-like)
    (33, 4, 1, 1, True, 6, True, False),
    (17, 6, 2, 3, False, 3, True, False),
])
def test_generalized_chunk_matches_definition(seq_len, num_levels, r_kv, r_ab, scalar_decay, offset, h0, reverse):
    p = loglinear_problem("generalized", seq_len, num_levels, r_kv=r_kv, r_ab=r_ab, scalar_decay=scalar_decay, h0=h0)
    errors = compare_with_definition("generalized", p, reverse=reverse, offset=offset)
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("kind", ["hdla", "generalized"])
def test_resets_match_definition(kind):
    """g = -inf (a full reset of a channel) inside the blocks and before a cache is read."""
    p = loglinear_problem(kind, 29, 4, h0=True, resets=0.2, seed=3)
    errors = compare_with_definition(kind, p, offset=3)
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("kind", ["hdla", "generalized"])
def test_float64_is_exact(kind):
    p = loglinear_problem(kind, 21, 4, h0=True)
    errors = compare_with_definition(kind, p, dtype=torch.float64, offset=9)
    assert max(errors.values()) < 1e-11, errors


def test_bf16_inputs_return_bf16():
    p = loglinear_problem("hdla", 20, 4, h0=True)
    p = {n: x.bfloat16() for n, x in p.items()}
    p["level_scales"] = p["level_scales"].float()  # weights may stay fp32 under bf16, like the gates
    o, s = chunk_loglinear_hdla(**p, output_final_state=True, offset=3)
    assert o.dtype == s.dtype == torch.bfloat16 and torch.isfinite(o.float()).all()


# ---- special cases: the linear op ------------------------------------------------------------

def test_one_level_is_the_linear_op_times_lambda():
    """L = 1: every bucket is read with lambda_t, so o_t = lambda_t * HDLA's o_t; the single level
    is HDLA's state, also continuing from one."""
    p = loglinear_problem("hdla", 37, 1, h0=True)
    lam = p.pop("level_scales")
    cache = p.pop("initial_state")
    o_lin, s_lin = chunk_hdla(**p, initial_state=cache[:, :, 0], output_final_state=True)
    o, s = chunk_loglinear_hdla(**p, level_scales=lam, initial_state=cache, output_final_state=True, offset=5)
    assert rel_err(o, lam * o_lin) < 1e-12 and rel_err(s[:, :, 0], s_lin) < 1e-12


@pytest.mark.parametrize("num_levels", [2, 7])
def test_constant_weights_give_the_linear_op(num_levels):
    """lambda = c on every level: c times the linear op, and the levels sum to its state."""
    p = loglinear_problem("generalized", 45, num_levels, r_kv=2, r_ab=2)
    p.pop("initial_state")
    p["level_scales"] = torch.full_like(p.pop("level_scales"), 0.7)
    o_lin, s_lin = chunk_generalized(**{n: p[n] for n in "qkvabg"}, output_final_state=True)
    o, s = chunk_loglinear_generalized(**p, output_final_state=True)
    assert rel_err(o, 0.7 * o_lin) < 1e-12 and rel_err(s.sum(2), s_lin) < 1e-12


# ---- caches: splitting and decoding -----------------------------------------------------------

def _tokens(p, start, stop):
    return {n: (x[:, start:stop] if n != "initial_state" else x) for n, x in p.items() if x is not None}


@pytest.mark.parametrize("kind", ["hdla", "generalized"])
@pytest.mark.parametrize("offset", [0, 13])
def test_splitting_and_continuing_equals_one_call(kind, offset):
    chunk = OPS[kind][0]
    p = {n: None if x is None else x.float() for n, x in loglinear_problem(kind, 40, 5, h0=offset > 0).items()}
    o_all, s_all = chunk(**p, output_final_state=True, offset=offset)
    for split in (1, 8, 19, 32):
        head = dict(_tokens(p, 0, split))
        o1, s1 = chunk(**head, output_final_state=True, offset=offset)
        tail = dict(_tokens(p, split, None), initial_state=s1)
        o2, s2 = chunk(**tail, output_final_state=True, offset=offset + split)
        assert rel_err(torch.cat([o1, o2], 1), o_all) < 1e-5 and rel_err(s2, s_all) < 1e-5, split


@pytest.mark.parametrize("kind", ["hdla", "generalized"])
@pytest.mark.parametrize("offset,h0", [(0, False), (0, True), (21, True)])
def test_decoding_token_by_token_equals_the_chunk_op(kind, offset, h0):
    chunk, _, step = OPS[kind]
    p = {n: None if x is None else x.float() for n, x in loglinear_problem(kind, 33, 5, h0=h0).items()}
    o_chunk, s_chunk = chunk(**p, output_final_state=True, offset=offset)
    state, outputs = p["initial_state"], []
    for i in range(33):
        o_i, state = step(**dict(_tokens(p, i, i + 1), initial_state=state), offset=offset + i)
        outputs.append(o_i)
    assert state.dtype == torch.float32
    assert rel_err(torch.cat(outputs, 1), o_chunk) < 1e-5 and rel_err(state, s_chunk) < 1e-5


def test_decoding_continues_a_prompt():
    """The chunk op's final levels are a cache the decoding step continues (prefill, then decode)."""
    p = {n: None if x is None else x.float() for n, x in loglinear_problem("hdla", 30, 4).items()}
    o_all, s_all = chunk_loglinear_hdla(**p, output_final_state=True)
    _, cache = chunk_loglinear_hdla(**_tokens(p, 0, 23), output_final_state=True)
    o_tail, s_tail = fused_recurrent_loglinear_hdla(**dict(_tokens(p, 23, None), initial_state=cache), offset=23)
    assert rel_err(o_tail, o_all[:, 23:]) < 1e-5 and rel_err(s_tail, s_all) < 1e-5


# ---- bad input --------------------------------------------------------------------------------

def _bad(kind, **over):
    p = {n: None if x is None else x.float() for n, x in loglinear_problem(kind, 6, 3).items()}
    p.update(over)
    return p


@pytest.mark.parametrize("over,needle", [
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
    (dict(g=torch.ones(2, 6, 2, 8)), "g is a log-decay"),
])
def test_bad_input_hdla(over, needle):
    with pytest.raises(ValueError) as info:
        chunk_loglinear_hdla(**_bad("hdla", **over))
    assert needle in str(info.value)


@pytest.mark.parametrize("over,needle", [
    (dict(level_scales=torch.rand(2, 6, 3, 3)), "level_scales must have shape [B, T, H, L]"),
    (dict(offset=True), "offset must be an int"),
    (dict(initial_state=torch.zeros(2, 2, 4, 8, 4)), "initial_state must have shape [B, H, L, K, V]"),
    (dict(a=torch.randn(2, 6, 2, 1, 7)), "a must have shape [B, T, H, r_ab, K]"),
])
def test_bad_input_generalized_and_decoding(over, needle):
    for op in (chunk_loglinear_generalized, fused_recurrent_loglinear_generalized):
        with pytest.raises(ValueError) as info:
            op(**_bad("generalized", **over))
        assert needle in str(info.value)
