"""chunk_generalized on CPU tensors (the vectorised PyTorch chunk form) against the float64 loop,
plus the input checks. The Triton kernels themselves are in test_chunk_interpret.py / test_gpu_kernels.py."""
import pytest
import torch

from hdla_vision.kernels import chunk_generalized, naive_generalized
from hdla_vision.kernels.utils import triton_supports_ranks
from tests.oracle import compare_with_loop, generalized_problem, rel_err

CASES = [  # (batch, T, H, K, V, r_kv, r_ab, g_min, h0, reverse)
    (2, 37, 2, 8, 6, 1, 2, -3.0, True, False),
    (1, 16, 1, 4, 4, 2, 0, -3.0, False, True),
    (1, 1, 1, 8, 8, 1, 1, -1.0, True, False),
    (2, 50, 3, 16, 8, 2, 3, -20.0, True, True),
    (1, 45, 1, 8, 8, 4, 4, -8.0, True, False),
]


@pytest.mark.parametrize("batch,seq_len,heads,dk,dv,r_kv,r_ab,g_min,h0,reverse", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_chunk_form_matches_loop(batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min, h0, reverse, dtype):
    inputs = generalized_problem(batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min=g_min, h0=h0)
    errors = compare_with_loop(chunk_generalized, "generalized", inputs, scale=0.5, reverse=reverse, dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert all(err < tol for err in errors.values()), errors


PER_HEAD_CASES = [  # (batch, T, H, K, V, r_kv, r_ab, resets, reverse): g [B, T, H], one log-decay per head
    (2, 37, 2, 8, 6, 1, 1, 0.0, False),  # Gated DeltaNet's shape
    (1, 45, 2, 16, 8, 3, 3, 0.1, True),  # Gated DeltaProduct / Head-in-Head ranks, resets, reversed
    (1, 20, 1, 8, 8, 1, 0, 0.0, True),  # rank 0
]


@pytest.mark.parametrize("batch,seq_len,heads,dk,dv,r_kv,r_ab,resets,reverse", PER_HEAD_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_head_log_decay_matches_loop(batch, seq_len, heads, dk, dv, r_kv, r_ab, resets, reverse, dtype):
    """g [B, T, H] against the float64 loop on the same g: output, state and every gradient, dg in
    g's shape [B, T, H] (compare_with_loop counts a gradient of another shape as an error)."""
    inputs = generalized_problem(batch, seq_len, heads, dk, dv, r_kv, r_ab, resets=resets, per_head_g=True)
    assert inputs["g"].shape == (batch, seq_len, heads)
    errors = compare_with_loop(chunk_generalized, "generalized", inputs, scale=0.5, reverse=reverse, dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert all(err < tol for err in errors.values()), errors


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


def test_per_head_log_decay_equals_it_broadcast_over_k():
    """The op with g [B, T, H] equals the op with that g expanded to [B, T, H, K] (fp32, CPU)."""
    p = {n: x.float() for n, x in generalized_problem(1, 40, 2, 8, 8, 2, 2, per_head_g=True).items()}
    o1, s1 = chunk_generalized(**p, output_final_state=True)
    o2, s2 = chunk_generalized(**dict(p, g=p["g"].unsqueeze(-1).expand(1, 40, 2, 8)), output_final_state=True)
    assert rel_err(o1, o2) < 1e-6 and rel_err(s1, s2) < 1e-6


def test_reverse_equals_forward_on_flipped_inputs():
    p = generalized_problem(2, 29, 2, 8, 8, 1, 2)
    o_rev, s_rev = chunk_generalized(**p, output_final_state=True, reverse=True)
    flipped = {n: (x.flip(1) if n != "initial_state" else x) for n, x in p.items()}
    o_fwd, s_fwd = chunk_generalized(**flipped, output_final_state=True)
    assert rel_err(o_rev, o_fwd.flip(1)) < 1e-12 and rel_err(s_rev, s_fwd) < 1e-12


def test_final_state_chains_across_calls():
    p = generalized_problem(1, 40, 2, 8, 8, 1, 2)
    o_all, s_all = chunk_generalized(**p, output_final_state=True)
    first = {n: (x[:, :23] if n != "initial_state" else x) for n, x in p.items()}
    second = {n: x[:, 23:] for n, x in p.items() if n != "initial_state"}
    o1, s1 = chunk_generalized(**first, output_final_state=True)
    o2, s2 = chunk_generalized(**second, initial_state=s1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o_all) < 1e-12 and rel_err(s2, s_all) < 1e-12


def test_no_nan_at_extreme_gates():
    p = generalized_problem(1, 64, 1, 8, 8, 1, 2, g_min=-20.0)
    p["g"][:, :, :, :4] = -20.0  # the most negative gate everywhere in half the channels
    p["g"][:, :, :, 4:] = 0.0  # and lambda = 1 in the rest
    p = {n: x.float() for n, x in p.items()}
    o, s = chunk_generalized(**p, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    ref, _ = naive_generalized(**{n: x.double() for n, x in p.items()})
    assert rel_err(o, ref) < 1e-4


def _good(**over):
    p = generalized_problem(2, 5, 3, 8, 4, 1, 2)
    p = {n: x.float() for n, x in p.items()}
    p.update(over)
    return p


@pytest.mark.parametrize(
    "over,needle",
    [
        (dict(k=torch.randn(2, 5, 3, 1, 7)), "k must have shape [B, T, H, r_kv, K]"),
        (dict(v=torch.randn(2, 5, 3, 4)), "v must have shape [B, T, H, r_kv, V]"),
        (dict(v=torch.randn(2, 5, 3, 2, 4)), "k must have shape"),
        (dict(b=torch.randn(2, 5, 3, 1, 8)), "b must have shape"),
        (dict(g=-torch.rand(2, 5, 3, 8, dtype=torch.float64)), "g has dtype torch.float64; expected torch.float32"),
        (dict(g=torch.rand(2, 5, 3, 8)), "g is a log-decay and must be <= 0"),
        (dict(g=torch.randn(2, 5, 3, 8).int()), "g has dtype"),
        (dict(g=-torch.rand(2, 5, 3, 7)), "g must have shape [B, T, H, K] = [2, 5, 3, 8] (a log-decay per key channel) "
                                          "or [B, T, H] = [2, 5, 3] (one per head), got [2, 5, 3, 7]"),
        (dict(g=-torch.rand(2, 5, 4)), "or [B, T, H] = [2, 5, 3] (one per head), got [2, 5, 4]"),
        (dict(g=torch.rand(2, 5, 3)), "g is a log-decay and must be <= 0"),
        (dict(initial_state=torch.randn(2, 3, 8, 5)), "initial_state must have shape [B, H, K, V]"),
        (dict(q=torch.randn(2, 5, 3, 300), k=torch.randn(2, 5, 3, 1, 300), a=torch.randn(2, 5, 3, 2, 300),
              b=torch.randn(2, 5, 3, 2, 300), g=torch.randn(2, 5, 3, 300), initial_state=None), "K (head dim of q/k) = 300"),
        (dict(q=torch.randn(2, 5, 3)), "q must have shape [B, T, H, K]"),
        (dict(scale="2"), "scale must be a float"),
    ],
)
def test_bad_input_raises_naming_the_argument(over, needle):
    p = _good(**over)
    with pytest.raises(ValueError) as info:
        chunk_generalized(**p)
    assert needle in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_mismatch_raises():
    p = _good()
    p["v"] = p["v"].cuda()
    with pytest.raises(ValueError, match="v is on cuda"):
        chunk_generalized(**p)


@pytest.mark.parametrize("dk,r_kv,r_ab,fits", [(256, 1, 2, True), (256, 2, 2, True), (256, 3, 2, False),
                                               (128, 4, 2, True), (128, 1, 3, False), (64, 4, 4, True),
                                               (65, 1, 3, False), (16, 3, 4, False), (16, 4, 3, False), (16, 4, 2, True),
                                               (32, 1, 4, True)])
def test_triton_rank_rule(dk, r_kv, r_ab, fits):
    """The measured region the Triton kernels run correctly (tests/gpu_rank_sweep.py)."""
    assert triton_supports_ranks(dk, r_kv, r_ab) == fits


def test_ranks_outside_the_triton_rule_take_the_chunk_form(monkeypatch):
    """Under the interpreter a case outside the rule runs the PyTorch chunk form and stays exact."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import hdla_vision.kernels.generalized.chunk as triton_chunk

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran a case outside triton_supports_ranks")

    monkeypatch.setattr(triton_chunk, "triton_generalized_forward", refuse)
    monkeypatch.setattr(triton_chunk, "triton_generalized_backward", refuse)
    p = generalized_problem(1, 20, 1, 128, 8, 1, 3, h0=True)
    errors = compare_with_loop(chunk_generalized, "generalized", p)
    assert max(errors.values()) < 1e-4, errors
