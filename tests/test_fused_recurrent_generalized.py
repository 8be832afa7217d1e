"""The generalized decoding step (fused_recurrent_generalized) against the float64 token loop and the chunk op."""
import textwrap

import pytest
import torch

from hdla_vision.kernels import chunk_generalized, custom_ops, fused_recurrent_generalized, naive_generalized
from hdla_vision.kernels.generalized.fused_recurrent import torch_fused_recurrent_generalized
from tests.oracle import generalized_problem, rel_err
from tests.interpreted import run_interpreted

NAMES = ("q", "k", "v", "a", "b", "g")

# (B, T, H, K, V, r_kv, r_ab, per_head_g): every r_ab 0..4 and r_kv 1..4, head dims 16..256
CASES = [
    (2, 1, 3, 16, 16, 1, 0, False),
    (1, 3, 2, 32, 24, 1, 1, True),
    (2, 2, 1, 64, 48, 2, 2, False),
    (1, 4, 2, 16, 32, 3, 3, True),
    (1, 2, 1, 128, 64, 4, 4, False),
    (1, 1, 1, 256, 256, 2, 4, True),
    (1, 2, 1, 256, 16, 1, 2, False),
]


def fp32_inputs(problem):
    return {n: None if x is None else x.float() for n, x in problem.items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}K{}V{}_rkv{}_rab{}_{}".format(
    *c[:7], "headg" if c[7] else "chang"))
def test_torch_step_matches_float64_loop(case):
    *shape, per_head_g = case
    p = generalized_problem(*shape, per_head_g=per_head_g, seed=sum(shape))
    ref_o, ref_s = naive_generalized(**p, scale=0.7, output_final_state=True)
    o, s = fused_recurrent_generalized(**fp32_inputs(p), scale=0.7, output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o, ref_o) < 1e-5 and rel_err(s, ref_s) < 1e-5
    o64, s64 = torch_fused_recurrent_generalized(*(p[n] for n in NAMES), 0.7, p["initial_state"])
    torch.testing.assert_close(o64, ref_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s64, ref_s, rtol=1e-12, atol=1e-12)


def test_without_initial_state_and_without_final_state():
    p = generalized_problem(2, 3, 2, 16, 8, 2, 1, h0=False, seed=3)
    ref_o, ref_s = naive_generalized(**p, output_final_state=True)
    o, s = fused_recurrent_generalized(**fp32_inputs(p), output_final_state=True)
    assert rel_err(o, ref_o) < 1e-5 and rel_err(s, ref_s) < 1e-5
    o2, none = fused_recurrent_generalized(**fp32_inputs(p))
    assert none is None and torch.equal(o2, o)


@pytest.mark.parametrize("per_head_g", [False, True])
def test_steps_chained_equal_one_multi_token_call(per_head_g):
    p = fp32_inputs(generalized_problem(2, 5, 2, 16, 16, 2, 2, per_head_g=per_head_g, seed=4))
    o_all, s_all = fused_recurrent_generalized(**p, scale=0.5, output_final_state=True)
    state, outputs = p["initial_state"], []
    for t in range(5):
        o_t, state = fused_recurrent_generalized(*(p[n][:, t:t + 1] for n in NAMES), scale=0.5,
                                                 initial_state=state, output_final_state=True)
        outputs.append(o_t)
    torch.testing.assert_close(torch.cat(outputs, 1), o_all, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, s_all, rtol=1e-6, atol=1e-6)


def test_steps_from_chunk_final_state_equal_chunk_over_whole_sequence():
    """Prefill with the chunk op, then decode token by token: same outputs and final state."""
    p = fp32_inputs(generalized_problem(2, 37, 2, 16, 16, 1, 2, seed=5))
    prefill = 29
    o_full, s_full = chunk_generalized(**p, output_final_state=True)
    _, state = chunk_generalized(*(p[n][:, :prefill] for n in NAMES), initial_state=p["initial_state"],
                                 output_final_state=True)
    outputs = []
    for t in range(prefill, 37):
        o_t, state = fused_recurrent_generalized(*(p[n][:, t:t + 1] for n in NAMES), initial_state=state,
                                                 output_final_state=True)
        outputs.append(o_t)
    torch.testing.assert_close(torch.cat(outputs, 1), o_full[:, prefill:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, s_full, rtol=1e-4, atol=1e-4)


def test_reset_and_identity_token():
    """g = -inf resets that channel exactly; a token with k, v, a, b, g = 0 (padding) keeps the state."""
    p = fp32_inputs(generalized_problem(1, 2, 2, 8, 8, 1, 2, seed=6))
    p["g"][:, 0, :, :4] = float("-inf")
    ref_o, ref_s = naive_generalized(**{n: None if x is None else x.double() for n, x in p.items()},
                                     output_final_state=True)
    o, s = fused_recurrent_generalized(**p, output_final_state=True)
    assert torch.isfinite(o).all() and rel_err(o, ref_o) < 1e-5 and rel_err(s, ref_s) < 1e-5
    zeros = {n: torch.zeros_like(p[n]) for n in ("k", "v", "a", "b", "g")}
    _, kept = fused_recurrent_generalized(p["q"], **zeros, initial_state=p["initial_state"], output_final_state=True)
    torch.testing.assert_close(kept, p["initial_state"], rtol=0, atol=0)


def test_gradients_match_the_float64_loop():
    p = generalized_problem(1, 3, 2, 8, 4, 2, 2, per_head_g=True, seed=7)
    names = (*NAMES, "initial_state")
    gen = torch.Generator().manual_seed(0)
    do = torch.randn(1, 3, 2, 4, generator=gen, dtype=torch.float64)
    ds = torch.randn(1, 2, 8, 4, generator=gen, dtype=torch.float64)

    def grads(fn, cast):
        leaves = {n: cast(p[n]).requires_grad_() for n in names}
        o, s = fn(**leaves, scale=0.5, output_final_state=True)
        return torch.autograd.grad((o.double() * do).sum() + (s.double() * ds).sum(), [leaves[n] for n in names])

    for n, got, ref in zip(names, grads(fused_recurrent_generalized, lambda x: x.float()),
                           grads(naive_generalized, lambda x: x.clone())):
        assert got.shape == ref.shape and rel_err(got, ref) < 1e-5, n


@pytest.mark.parametrize("h0", [True, False])
def test_opcheck(h0):
    p = {n: None if x is None else x.float().requires_grad_()
         for n, x in generalized_problem(2, 3, 2, 8, 4, 2, 1, h0=h0, per_head_g=not h0).items()}
    args = (*(p[n] for n in NAMES), 0.5, p["initial_state"])
    torch.library.opcheck(custom_ops.fused_recurrent_generalized_op, args)
    o, state = custom_ops.fused_recurrent_generalized_op(*args)
    detached = [t.detach() for t in args[:6]]
    torch.library.opcheck(custom_ops.fused_recurrent_generalized_backward_op,
                          (torch.randn_like(o), torch.randn_like(state), *detached, 0.5,
                           p["initial_state"].detach() if h0 else None))


def bad_inputs():
    p = fp32_inputs(generalized_problem(1, 1, 2, 8, 8, 1, 2, seed=8))
    yield "a", dict(p, a=p["a"][..., :4])
    yield "b", dict(p, b=p["b"][:, :, :, :1])
    yield "k", dict(p, k=p["k"].double())
    yield "v", dict(p, v=p["v"][:, :, :, :, 0])
    yield "g must have shape", dict(p, g=p["g"][..., :3])
    yield "initial_state", dict(p, initial_state=p["initial_state"][:, :, :4])
    yield "g is a log-decay", dict(p, g=p["g"].abs() + 1e-3)
    yield "scale", dict(p, scale="0.5")
    yield "output_final_state", dict(p, output_final_state=1)


@pytest.mark.parametrize("match, kwargs", list(bad_inputs()), ids=[m for m, _ in bad_inputs()])
def test_bad_input_raises_value_error_naming_the_argument(match, kwargs):
    with pytest.raises(ValueError, match=match):
        fused_recurrent_generalized(**kwargs)


TRITON_SCRIPT = textwrap.dedent(
    """
    import os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from hdla_vision.kernels import fused_recurrent_generalized, naive_generalized
    from hdla_vision.kernels.generalized import fused_recurrent
    from tests.oracle import generalized_problem, rel_err
    from tests.test_fused_recurrent_generalized import CASES, NAMES

    launched = []
    triton_run = fused_recurrent.triton_fused_recurrent_generalized
    fused_recurrent.triton_fused_recurrent_generalized = lambda *a: launched.append(1) or triton_run(*a)
    worst = 0.0
    for B, T, H, K, V, r_kv, r_ab, per_head_g in CASES:
        for h0 in (True, False):
            p = generalized_problem(B, T, H, K, V, r_kv, r_ab, h0=h0, per_head_g=per_head_g, seed=K + r_ab)
            if r_ab:  # a reset of some tokens / channels
                p["g"][:, 0, ..., : max(1, K // 4) if not per_head_g else 1] = float("-inf")
            ref_o, ref_s = naive_generalized(**p, scale=0.6, output_final_state=True)
            f = {n: None if x is None else x.float() for n, x in p.items()}
            o, s = fused_recurrent_generalized(**f, scale=0.6, output_final_state=True)
            assert s.dtype == torch.float32 and o.dtype == torch.float32
            err = max(rel_err(o, ref_o), rel_err(s, ref_s))
            assert err < 1e-4, (B, T, H, K, V, r_kv, r_ab, per_head_g, h0, err)
            worst = max(worst, err)
    assert len(launched) == 2 * len(CASES), launched
    p = generalized_problem(1, 4, 2, 32, 32, 2, 3, seed=1)
    f = {n: x.float() for n, x in p.items()}
    o_all, s_all = fused_recurrent_generalized(**f, output_final_state=True)
    state, outs = f["initial_state"], []
    for t in range(4):
        o_t, state = fused_recurrent_generalized(*(f[n][:, t:t + 1] for n in NAMES), initial_state=state,
                                                 output_final_state=True)
        outs.append(o_t)
    assert rel_err(torch.cat(outs, 1), o_all) < 1e-6 and rel_err(state, s_all) < 1e-6
    ref_o, _ = naive_generalized(**p, output_final_state=True)
    o_bf, s_bf = triton_run(*(f[n].bfloat16() for n in NAMES[:5]), f["g"], None, f["initial_state"])
    assert o_bf.dtype == torch.bfloat16 and s_bf.dtype == torch.float32 and rel_err(o_bf, ref_o) < 0.05
    print("TRITON-INTERPRET-OK worst fp32 error %.2e" % worst)
    """
)


@pytest.mark.interpret
def test_triton_kernel_under_interpreter():
    """The Triton kernel on the CPU in a fresh process (TRITON_INTERPRET must be set before import)."""
    result = run_interpreted(["-c", TRITON_SCRIPT], timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TRITON-INTERPRET-OK" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_on_cuda(case):
    *shape, per_head_g = case
    p = generalized_problem(*shape, per_head_g=per_head_g)
    ref_o, ref_s = naive_generalized(**p, output_final_state=True)
    f = {n: x.float().cuda() for n, x in p.items()}
    o, s = fused_recurrent_generalized(**f, output_final_state=True)
    assert rel_err(o.cpu(), ref_o) < 1e-4 and rel_err(s.cpu(), ref_s) < 1e-4
