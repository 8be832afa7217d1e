"""chunk_generalized on every backend (tests/backends.py: the vectorised PyTorch chunk form, the
Triton kernels under the interpreter, the Triton kernels on CUDA) against the float64 token loop:
the output, the final state and every gradient, with g per key channel [B, T, H, K] or per head
[B, T, H]; the log-decay and dtype contract; bad input raising ValueError before any launch; which
ranks the Triton kernels take; the custom op under opcheck. The per-head reference is checked first.
The rank / head-dim sweep on the GPU, one subprocess per case, is tests/test_gpu_rank_sweep.py."""
import pytest
import torch

from hdla_vision.kernels import chunk_generalized, custom_ops, naive_generalized
from hdla_vision.kernels.utils import LOG_ZERO_FP32, LOG_ZERO_FP64, triton_supports_ranks
from tests.ops.compiled import assert_compiled_equals_eager
from tests.backends import CUDA_TOL, backend_cases, backends, dtypes_id, on_backend
from tests.oracle import (LoopCase, assert_full_reset_forgets, assert_reset_gradients_zero_and_finite, case_name,
                          compare_with_loop, generalized_problem, rel_err, worst)

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


# ----------------------------------------------------------------------------- the reference, the floor
def test_per_head_loop_equals_the_loop_on_g_broadcast_over_k():
    """The oracle for g [B, T, H] is itself checked: the loop with g broadcast to [B, T, H, K] gives the
    same output and state, and its dg summed over K is the per-head dg."""
    p = generalized_problem(2, 13, 2, 8, 5, 1, 2, per_head_g=True, resets=0.1)
    g_head = p.pop("g").requires_grad_()
    g_channel = g_head.detach().unsqueeze(-1).expand(2, 13, 2, 8).clone().requires_grad_()
    o1, s1 = naive_generalized(**p, g=g_head, output_final_state=True)
    o2, s2 = naive_generalized(**p, g=g_channel, output_final_state=True)
    assert rel_err(o1, o2) < 1e-14 and rel_err(s1, s2) < 1e-14
    (o1.square().sum() + s1.sum()).backward()
    (o2.square().sum() + s2.sum()).backward()
    assert g_head.grad.shape == (2, 13, 2) and rel_err(g_head.grad, g_channel.grad.sum(-1)) < 1e-12
    assert g_head.grad.abs().max() > 0


def test_floors_underflow_to_exactly_zero():
    """g = -inf is clamped to a floor; the clamp is exact only if exp of the floor is 0 in the compute dtype."""
    assert torch.exp(torch.tensor(LOG_ZERO_FP32, dtype=F32)) == 0
    assert torch.exp(torch.tensor(LOG_ZERO_FP64, dtype=F64)) == 0


# ----------------------------------------------------------------------------- against the loop
def _case(name, batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min=-3.0, h0=True, resets=0.0, per_head_g=False,
          dtype=F32, tol=1e-4, **op):
    problem = dict(batch=batch, seq_len=seq_len, heads=heads, dk=dk, dv=dv, r_kv=r_kv, r_ab=r_ab, g_min=g_min, h0=h0,
                   resets=resets, per_head_g=per_head_g)
    return LoopCase(name, problem, op, dtype, tol)


def _in_fp64_and_fp32(name, *args, **kwargs):
    """The case in float64 (the chunk form is exact: < 1e-10) and in fp32 (< 1e-4)."""
    return [_case(f"{name}_f64", *args, dtype=F64, tol=1e-10, **kwargs), _case(f"{name}_f32", *args, **kwargs)]


CPU_CASES = [  # small head dims: every rank 0..4, T = 1 and T not a multiple of the chunk, batch 1, reverse
    *_in_fp64_and_fp32("B2_T37_H2_K8_V6_rkv1_rab2", 2, 37, 2, 8, 6, 1, 2, scale=0.5),
    *_in_fp64_and_fp32("B1_T16_K4_rkv2_rab0_rev_no_h0", 1, 16, 1, 4, 4, 2, 0, h0=False, scale=0.5, reverse=True),
    *_in_fp64_and_fp32("B1_T1_rab1", 1, 1, 1, 8, 8, 1, 1, g_min=-1.0, scale=0.5),
    *_in_fp64_and_fp32("B2_T50_H3_K16_V8_rkv2_rab3_rev_gates-20", 2, 50, 3, 16, 8, 2, 3, g_min=-20.0, scale=0.5,
                       reverse=True),
    *_in_fp64_and_fp32("B1_T45_rkv4_rab4_gates-8", 1, 45, 1, 8, 8, 4, 4, g_min=-8.0, scale=0.5),
    # g [B, T, H]: one log-decay per head (Gated DeltaNet, Gated DeltaProduct / Head-in-Head ranks, rank 0)
    *_in_fp64_and_fp32("per_head_g_B2_T37_rab1", 2, 37, 2, 8, 6, 1, 1, per_head_g=True, scale=0.5),
    *_in_fp64_and_fp32("per_head_g_T45_rkv3_rab3_resets_rev", 1, 45, 2, 16, 8, 3, 3, resets=0.1, per_head_g=True,
                       scale=0.5, reverse=True),
    *_in_fp64_and_fp32("per_head_g_T20_rab0_rev", 1, 20, 1, 8, 8, 1, 0, per_head_g=True, scale=0.5, reverse=True),
    # g = -inf (full resets) on about 15% of the tokens and of the single channels: the exact limit
    *_in_fp64_and_fp32("resets_rab0", 2, 37, 2, 8, 6, 2, 0, resets=0.15, scale=0.5),
    *_in_fp64_and_fp32("resets_rab2_rev", 2, 37, 2, 8, 6, 2, 2, resets=0.15, scale=0.5, reverse=True),
    *_in_fp64_and_fp32("resets_rab3", 2, 37, 2, 8, 6, 2, 3, resets=0.15, scale=0.5),
]
INTERPRETER_CASES = [  # the Triton kernels' block sizes (K >= 16), kept small: the interpreter is slow
    _case("gen_r0_T33", 1, 33, 1, 16, 32, 1, 0),  # also: the empty a, b (r_ab = 0) get empty gradients
    _case("gen_r1_T1", 1, 1, 1, 16, 16, 1, 1),
    _case("gen_r2_T20_gates-20", 1, 20, 1, 16, 16, 1, 2, g_min=-20.0),
    _case("gen_r3_rkv2_T37_rev", 2, 37, 2, 16, 16, 2, 3, reverse=True, scale=0.7),
    _case("gen_r4_T23_gates-8", 1, 23, 2, 32, 24, 1, 4, g_min=-8.0),
    _case("gen_r2_rkv3_T18_rev_no_h0", 1, 18, 1, 16, 16, 3, 2, h0=False, reverse=True),
    # g = -inf (full resets) on about 15% of tokens and of single channels: the exact limit, dg = 0 there
    _case("gen_r2_T40_resets", 1, 40, 1, 16, 16, 1, 2, resets=0.15),
    # g [B, T, H], broadcast over K inside the op; dg comes back [B, T, H]
    _case("gen_r2_T37_per_head_g_rev", 1, 37, 2, 16, 16, 1, 2, per_head_g=True, resets=0.1, reverse=True),
]
CUDA_CASES = [  # realistic shapes in bf16
    _case(f"B2_T150_D64_rkv{r_kv}_rab{r_ab}{'_rev' if reverse else ''}_bf16", 2, 150, 2, 64, 64, r_kv, r_ab,
          g_min=-5.0, dtype=BF16, tol=CUDA_TOL, reverse=reverse)
    for r_kv, r_ab, reverse in [(1, 0, False), (1, 1, True), (2, 2, False), (3, 3, True), (1, 4, False)]
]


@pytest.mark.parametrize("backend,case", backend_cases(case_name, torch=CPU_CASES,
                                                       interpreter=INTERPRETER_CASES, cuda=CUDA_CASES),
                         indirect=["backend"])
def test_matches_float64_loop(backend, case):
    """Output, final state and the gradients of q, k, v, a, b, g (in g's shape) and the initial state."""
    problem = on_backend(generalized_problem(**case.problem), backend)
    assert problem["g"].dim() == (3 if case.problem["per_head_g"] else 4)
    assert torch.isinf(problem["g"]).any() == (case.problem["resets"] > 0)
    errors = compare_with_loop(chunk_generalized, "generalized", problem, dtype=case.dtype, **case.op)
    assert len(errors) >= 4, errors  # o, final state and gradients were all compared
    bad = {name: err for name, err in errors.items() if not err < case.tol}  # NaN fails too
    assert not bad, f"{case.name}: relative errors above {case.tol}: {bad}"


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_per_head_log_decay_equals_it_broadcast_over_k(backend):
    """The op with g [B, T, H] equals the op with that g expanded to [B, T, H, K] (fp32)."""
    p = on_backend({n: x.float() for n, x in generalized_problem(1, 40, 2, 8, 8, 2, 2, per_head_g=True).items()},
                   backend)
    o1, s1 = chunk_generalized(**p, output_final_state=True)
    o2, s2 = chunk_generalized(**dict(p, g=p["g"].unsqueeze(-1).expand(1, 40, 2, 8)), output_final_state=True)
    assert rel_err(o1, o2) < 1e-6 and rel_err(s1, s2) < 1e-6


@pytest.mark.parametrize("backend", backends("torch"), indirect=True)
def test_reverse_equals_forward_on_flipped_inputs(backend):
    p = generalized_problem(2, 29, 2, 8, 8, 1, 2)
    o_rev, s_rev = chunk_generalized(**p, output_final_state=True, reverse=True)
    flipped = {n: (x.flip(1) if n != "initial_state" else x) for n, x in p.items()}
    o_fwd, s_fwd = chunk_generalized(**flipped, output_final_state=True)
    assert rel_err(o_rev, o_fwd.flip(1)) < 1e-12 and rel_err(s_rev, s_fwd) < 1e-12


@pytest.mark.parametrize("backend", backends("torch"), indirect=True)
def test_final_state_chains_across_calls(backend):
    p = generalized_problem(1, 40, 2, 8, 8, 1, 2)
    o_all, s_all = chunk_generalized(**p, output_final_state=True)
    first = {n: (x[:, :23] if n != "initial_state" else x) for n, x in p.items()}
    second = {n: x[:, 23:] for n, x in p.items() if n != "initial_state"}
    o1, s1 = chunk_generalized(**first, output_final_state=True)
    o2, s2 = chunk_generalized(**second, initial_state=s1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o_all) < 1e-12 and rel_err(s2, s_all) < 1e-12


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_no_nan_at_extreme_gates(backend):
    p = generalized_problem(1, 64, 1, 8, 8, 1, 2, g_min=-20.0)
    p["g"][:, :, :, :4] = -20.0  # the most negative gate everywhere in half the channels
    p["g"][:, :, :, 4:] = 0.0  # and lambda = 1 in the rest
    p = {n: x.float() for n, x in p.items()}
    o, s = chunk_generalized(**on_backend(p, backend), output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    ref, _ = naive_generalized(**{n: x.double() for n, x in p.items()})
    assert rel_err(o.cpu(), ref) < (CUDA_TOL if backend == "cuda" else 1e-4)


# ----------------------------------------------------------------------------- g = -inf, g > 0, r_ab = 0
@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_full_reset_forgets_everything_before_it(backend):
    """With lambda = 0 in every channel at token t GLA's transition (rank 0) is 0: the outputs from t on
    equal the op run on the suffix from a zero state, and the earlier inputs get no gradient."""
    p = on_backend({n: x.float() for n, x in generalized_problem(1, 40, 2, 8, 8, 1, 0).items()}, backend)
    assert_full_reset_forgets(chunk_generalized, p, 21, CUDA_TOL if backend == "cuda" else 1e-5)


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_gradient_at_minus_inf_is_zero_and_all_finite(backend):
    p = generalized_problem(1, 33, 2, 8, 8, 1, 2, resets=0.2)
    p = {n: x.float().requires_grad_() for n, x in on_backend(p, backend).items()}
    assert_reset_gradients_zero_and_finite(lambda **x: chunk_generalized(**x, output_final_state=True), p)


@pytest.mark.parametrize("backend", backends("torch", "interpreter"), indirect=True)
def test_positive_log_decay_is_refused_on_cpu(backend):
    """g > 0 is outside the domain: refused for CPU tensors (unchecked on CUDA: a host sync)."""
    p = {n: x.float() for n, x in generalized_problem(1, 5, 1, 8, 8, 1, 2).items()}
    chunk_generalized(**p)  # g <= 0 (zeros included) is fine
    p["g"][0, 3, 0, 2] = 1e-3
    with pytest.raises(ValueError, match=r"g is a log-decay and must be <= 0"):
        chunk_generalized(**p)


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("use", ["output", "state"])
def test_empty_rank_inputs_get_empty_gradients(backend, reverse, use):
    """At r_ab = 0 (GLA) a and b are empty and get empty gradients (the interpreter: gen_r0_T33 above)."""
    p = generalized_problem(1, 20, 2, 8, 8, 1, 0)
    p = {n: x.float().requires_grad_() for n, x in on_backend(p, backend).items()}
    o, s = chunk_generalized(**p, output_final_state=True, reverse=reverse)
    (o if use == "output" else s).square().sum().backward()
    for name in ("a", "b"):
        assert p[name].grad is not None, f"{name}.grad is None"
        assert p[name].grad.shape == p[name].shape == (1, 20, 2, 0, 8)


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_unrequested_final_state_is_none_and_gradients_flow_without_it(backend):
    """The op always returns a state tensor (empty when not requested); the public op returns None."""
    p = generalized_problem(1, 20, 1, 8, 8, 1, 2)
    p = {n: x.float().requires_grad_() for n, x in on_backend(p, backend).items()}
    o, final = chunk_generalized(**p)
    assert final is None
    o.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in p.values())


# ----------------------------------------------------------------------------- dtypes, bad input
def _with_dtypes(dtypes, backend):
    """A small problem with each input in ``dtypes[name]`` (default q's dtype)."""
    p = generalized_problem(1, 5, 2, 8, 8, 1, 2)
    return on_backend({n: x.to(dtypes.get(n, dtypes["q"])) for n, x in p.items()}, backend)


ACCEPTED = [dict(q=BF16, g=F32), dict(q=F16, g=F32, initial_state=F32), dict(q=F64, g=F32)]


@pytest.mark.parametrize("dtypes", ACCEPTED, ids=dtypes_id)
def test_dtype_rule_accepts(backend, dtypes):
    """k, v, a, b have q's dtype; g q's dtype or float32 (fp32 or wider compute)."""
    p = _with_dtypes(dtypes, backend)
    o, _ = chunk_generalized(**p)
    assert torch.isfinite(o.float()).all()
    ref, _ = naive_generalized(**{n: x.double() for n, x in p.items()})
    assert rel_err(o, ref) < 2e-2


REFUSED = [  # (dtypes, message)
    (dict(q=BF16, k=F32), "k has dtype torch.float32; expected q's dtype torch.bfloat16"),
    (dict(q=F32, v=BF16), "v has dtype torch.bfloat16; expected q's dtype torch.float32"),
    (dict(q=F32, a=F64), "a has dtype torch.float64; expected q's dtype torch.float32"),
    (dict(q=BF16, b=F16), "b has dtype torch.float16; expected q's dtype torch.bfloat16"),
    (dict(q=BF16, g=F16), "g has dtype torch.float16; expected q's dtype torch.bfloat16 or torch.float32"),
    (dict(q=F32, g=F64), "g has dtype torch.float64; expected torch.float32"),
]


@pytest.mark.parametrize("dtypes,message", REFUSED, ids=[dtypes_id(dtypes) for dtypes, _ in REFUSED])
def test_dtype_rule_refuses_naming_the_argument(backend, dtypes, message):
    with pytest.raises(ValueError) as info:
        chunk_generalized(**_with_dtypes(dtypes, backend))
    assert message in str(info.value)


BAD_INPUT = [  # (overrides of a good [B, T, H, K, V] = [2, 5, 3, 8, 4] problem, message)
    (dict(k=torch.randn(2, 5, 3, 1, 7)), "k must have shape [B, T, H, r_kv, K]"),
    (dict(v=torch.randn(2, 5, 3, 4)), "v must have shape [B, T, H, r_kv, V]"),
    (dict(v=torch.randn(2, 5, 3, 2, 4)), "k must have shape"),
    (dict(b=torch.randn(2, 5, 3, 1, 8)), "b must have shape"),
    (dict(g=-torch.rand(2, 5, 3, 8, dtype=torch.float64)), "g has dtype torch.float64; expected torch.float32"),
    (dict(g=torch.randn(2, 5, 3, 8).int()), "g has dtype"),
    (dict(g=-torch.rand(2, 5, 3, 7)), "g must have shape [B, T, H, K] = [2, 5, 3, 8] (a log-decay per key channel) "
                                      "or [B, T, H] = [2, 5, 3] (one per head), got [2, 5, 3, 7]"),
    (dict(g=-torch.rand(2, 5, 4)), "or [B, T, H] = [2, 5, 3] (one per head), got [2, 5, 4]"),
    (dict(initial_state=torch.randn(2, 3, 8, 5)), "initial_state must have shape [B, H, K, V]"),
    (dict(q=torch.randn(2, 5, 3, 300), k=torch.randn(2, 5, 3, 1, 300), a=torch.randn(2, 5, 3, 2, 300),
          b=torch.randn(2, 5, 3, 2, 300), g=torch.randn(2, 5, 3, 300), initial_state=None), "K (head dim of q/k) = 300"),
    (dict(q=torch.randn(2, 5, 3)), "q must have shape [B, T, H, K]"),
    (dict(scale="2"), "scale must be a float"),
]
POSITIVE_LOG_DECAY = [  # refused for CPU tensors only (tests above)
    (dict(g=torch.rand(2, 5, 3, 8)), "g is a log-decay and must be <= 0"),
    (dict(g=torch.rand(2, 5, 3)), "g is a log-decay and must be <= 0"),
]


def _bad_input_raises(backend, over, needle):
    p = {n: x.float() for n, x in generalized_problem(2, 5, 3, 8, 4, 1, 2).items()}
    p.update(over)
    with pytest.raises(ValueError) as info:
        chunk_generalized(**on_backend(p, backend))
    assert needle in str(info.value)


@pytest.mark.parametrize("over,needle", BAD_INPUT)
def test_bad_input_raises_naming_the_argument(backend, over, needle):
    _bad_input_raises(backend, over, needle)


@pytest.mark.parametrize("backend", backends("torch", "interpreter"), indirect=True)
@pytest.mark.parametrize("over,needle", POSITIVE_LOG_DECAY)
def test_positive_log_decay_raises_naming_g(backend, over, needle):
    _bad_input_raises(backend, over, needle)


@pytest.mark.parametrize("backend", backends("cuda"), indirect=True)
def test_device_mismatch_raises(backend):
    p = {n: x.float() for n, x in generalized_problem(2, 5, 3, 8, 4, 1, 2).items()}
    p["v"] = p["v"].cuda()
    with pytest.raises(ValueError, match="v is on cuda"):
        chunk_generalized(**p)


# ----------------------------------------------------------------------------- which ranks Triton runs
@pytest.mark.parametrize("dk,r_kv,r_ab,fits", [(256, 1, 2, True), (256, 2, 2, True), (256, 3, 2, False),
                                               (128, 4, 2, True), (128, 1, 3, False), (64, 4, 4, True),
                                               (65, 1, 3, False), (16, 3, 4, False), (16, 4, 3, False), (16, 4, 2, True),
                                               (32, 1, 4, True)])
def test_triton_rank_rule(dk, r_kv, r_ab, fits):
    """The measured region the Triton kernels run correctly (tests/gpu_rank_sweep.py)."""
    assert triton_supports_ranks(dk, r_kv, r_ab) == fits


@pytest.mark.parametrize("backend", backends("interpreter", "cuda"), indirect=True)
def test_ranks_outside_the_triton_rule_take_the_chunk_form(backend, monkeypatch):
    """Where Triton runs, a case outside the rule runs the PyTorch chunk form and stays exact."""
    import hdla_vision.kernels.generalized.chunk as triton_chunk

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran a case outside triton_supports_ranks")

    monkeypatch.setattr(triton_chunk, "triton_generalized_forward", refuse)
    monkeypatch.setattr(triton_chunk, "triton_generalized_backward", refuse)
    assert not triton_supports_ranks(128, 1, 3)
    p = on_backend(generalized_problem(1, 20, 1, 128, 8, 1, 3, h0=True), backend)
    errors = compare_with_loop(chunk_generalized, "generalized", p)
    assert worst(errors) < (1e-4 if backend == "interpreter" else CUDA_TOL), errors


# ----------------------------------------------------------------------------- the custom op
GENERALIZED_OPCHECK = [  # (problem kwargs, output_final_state, reverse)
    (dict(batch=1, seq_len=20, heads=2, dk=8, dv=4, r_kv=1, r_ab=2), True, False),
    (dict(batch=1, seq_len=17, heads=1, dk=8, dv=8, r_kv=2, r_ab=0, h0=False), False, True),
    (dict(batch=2, seq_len=9, heads=1, dk=4, dv=4, r_kv=1, r_ab=3, per_head_g=True), True, True),
]


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
@pytest.mark.parametrize("problem,final,reverse", GENERALIZED_OPCHECK)
def test_opcheck(backend, problem, final, reverse):
    """torch.library.opcheck (schema, autograd registration, fake implementation, AOT dispatch), the
    state's shape, and the backward op's gradient shapes."""
    p = {n: None if x is None else x.float().requires_grad_()
         for n, x in on_backend(generalized_problem(**problem), backend).items()}
    args = (p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], 0.5, p["initial_state"], final, reverse)
    torch.library.opcheck(custom_ops.chunk_generalized_op, args)
    o, state, x = custom_ops.chunk_generalized_op(*args)
    expected = (problem["batch"], problem["heads"], problem["dk"], problem["dv"]) if final else (0,)
    assert tuple(state.shape) == expected and tuple(o.shape) == tuple(p["q"].shape[:3]) + (problem["dv"],)
    grads = torch.ops.hdla_vision.chunk_generalized_backward(
        torch.randn_like(o), state.detach() if final else None,
        *(t.detach() if t is not None else None for t in args[:6]),
        None if p["initial_state"] is None else p["initial_state"].detach(), x, state.detach(), 0.5, reverse)
    assert [tuple(t.shape) for t in grads[:6]] == [tuple(t.shape) for t in args[:6]]


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
def test_opcheck_backward_op(backend):
    p = on_backend({n: x.float() for n, x in generalized_problem(1, 18, 2, 8, 4, 1, 2).items()}, backend)
    args = (p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], 0.5, p["initial_state"], True, False)
    o, state, x = torch.ops.hdla_vision.chunk_generalized(*args)
    torch.library.opcheck(custom_ops.chunk_generalized_backward_op,
                          (torch.randn_like(o), torch.randn_like(state), *args[:6], p["initial_state"], x, state, 0.5,
                           False))


@pytest.mark.parametrize("backend", backends("torch", "cuda"), indirect=True)
@pytest.mark.parametrize("per_head_g", [False, True])
def test_compiled_equals_eager(backend, per_head_g):
    """The op under torch.compile(fullgraph=True): output, state and every gradient as in eager."""
    p = generalized_problem(1, 37, 2, 8, 8, 2, 2, per_head_g=per_head_g)
    p = on_backend({n: x.float() for n, x in p.items()}, backend)
    assert_compiled_equals_eager(lambda **kw: chunk_generalized(**kw, scale=0.5, output_final_state=True), p)
