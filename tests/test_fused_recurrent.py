"""The HDLA decoding step (fused_recurrent_hdla) against the float64 token loop and the chunk op."""
import textwrap

import pytest
import torch
import torch.nn.functional as F

from hdla_vision.kernels import chunk_hdla, fused_recurrent_hdla, naive_hdla
from hdla_vision.kernels.hdla.fused_recurrent import torch_fused_recurrent_hdla
from tests.interpreted import run_interpreted


def hdla_inputs(batch, seq_len, heads, dk, dv, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dk, generator=gen)
    k = F.normalize(torch.randn(batch, seq_len, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, seq_len, heads, dv, generator=gen)
    beta = 2 * torch.rand(batch, seq_len, heads, generator=gen)
    g = F.logsigmoid(2 * torch.randn(batch, seq_len, heads, dk, generator=gen))
    state = torch.randn(batch, heads, dk, dv, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, beta, g)], state.to(device)


@pytest.mark.parametrize("shape", [(2, 1, 3, 16, 16), (1, 4, 2, 12, 20), (2, 3, 1, 32, 8)])
def test_torch_step_matches_float64_loop(shape):
    (q, k, v, beta, g), s0 = hdla_inputs(*shape)
    o_ref, s_ref = naive_hdla(*(x.double() for x in (q, k, v, beta, g)), scale=0.7,
                              initial_state=s0.double(), output_final_state=True)
    o, s = fused_recurrent_hdla(q, k, v, beta, g, scale=0.7, initial_state=s0)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-5, atol=1e-5)
    o64, s64 = torch_fused_recurrent_hdla(*(x.double() for x in (q, k, v, beta, g)), 0.7, s0.double())
    torch.testing.assert_close(o64, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s64, s_ref, rtol=1e-12, atol=1e-12)


def test_steps_from_chunk_final_state_equal_chunk_over_whole_sequence():
    """Prefill with the chunk op, then decode token by token: same outputs and final state."""
    (q, k, v, beta, g), _ = hdla_inputs(2, 37, 2, 16, 16, seed=1)
    prefill = 29
    o_full, s_full = chunk_hdla(q, k, v, beta, g, output_final_state=True)
    _, state = chunk_hdla(*(x[:, :prefill] for x in (q, k, v, beta, g)), output_final_state=True)
    outputs = []
    for t in range(prefill, q.shape[1]):
        o_t, state = fused_recurrent_hdla(*(x[:, t:t + 1] for x in (q, k, v, beta, g)), initial_state=state)
        outputs.append(o_t)
    torch.testing.assert_close(torch.cat(outputs, 1), o_full[:, prefill:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, s_full, rtol=1e-4, atol=1e-4)


def test_zero_state_and_identity_token_keep_state():
    """A token with k = 0, g = 0, beta = 0 (a padding token) leaves the state unchanged."""
    (q, k, v, beta, g), s0 = hdla_inputs(1, 1, 2, 8, 8)
    _, s = fused_recurrent_hdla(q, torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(beta),
                                torch.zeros_like(g), initial_state=s0)
    torch.testing.assert_close(s, s0, rtol=0, atol=0)


def test_input_checks_name_the_argument():
    (q, k, v, beta, g), s0 = hdla_inputs(1, 1, 2, 8, 8)
    with pytest.raises(ValueError, match="beta"):
        fused_recurrent_hdla(q, k, v, beta[..., :1], g)
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent_hdla(q, k, v, beta, g, initial_state=s0[:, :, :4])


TRITON_SCRIPT = textwrap.dedent(
    """
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch, torch.nn.functional as F
    from hdla_vision.kernels import naive_hdla
    from hdla_vision.kernels.hdla.fused_recurrent import triton_fused_recurrent_hdla, fused_recurrent_hdla
    torch.manual_seed(0)
    for (B, T, H, K, V) in [(2, 1, 2, 16, 16), (1, 3, 1, 12, 40)]:
        q = torch.randn(B, T, H, K); k = F.normalize(torch.randn(B, T, H, K), dim=-1)
        v = torch.randn(B, T, H, V); beta = 2 * torch.rand(B, T, H)
        g = F.logsigmoid(2 * torch.randn(B, T, H, K)); s0 = torch.randn(B, H, K, V)
        ref_o, ref_s = naive_hdla(*(x.double() for x in (q, k, v, beta, g)), scale=0.5,
                                  initial_state=s0.double(), output_final_state=True)
        o, s = fused_recurrent_hdla(q, k, v, beta, g, scale=0.5, initial_state=s0)
        assert s.dtype == torch.float32
        torch.testing.assert_close(o.double(), ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s.double(), ref_s, rtol=1e-5, atol=1e-5)
        o_bf, _ = triton_fused_recurrent_hdla(*(x.bfloat16() for x in (q, k, v, beta, g)), 0.5, s0)
        assert o_bf.dtype == torch.bfloat16
        assert (o_bf.double() - ref_o).abs().max() < 0.1 * ref_o.abs().max()
        o0, s_no_init = triton_fused_recurrent_hdla(q, k, v, beta, g, None, None)
        ref0, ref_s0 = naive_hdla(q.double(), k.double(), v.double(), beta.double(), g.double(), output_final_state=True)
        torch.testing.assert_close(o0.double(), ref0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s_no_init.double(), ref_s0, rtol=1e-5, atol=1e-5)
        g_reset = g.clone()  # lambda = 0: the exact reset of those channels
        g_reset[:, 0, :, : K // 2] = float("-inf")
        o_r, s_r = fused_recurrent_hdla(q, k, v, beta, g_reset, 0.5, s0)
        ref_or, ref_sr = naive_hdla(*(x.double() for x in (q, k, v, beta, g_reset)), scale=0.5,
                                    initial_state=s0.double(), output_final_state=True)
        assert torch.isfinite(o_r).all() and torch.isfinite(s_r).all()
        torch.testing.assert_close(o_r.double(), ref_or, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s_r.double(), ref_sr, rtol=1e-5, atol=1e-5)
        try:
            fused_recurrent_hdla(q, k, v, beta, g.abs() + 1e-3, 0.5, s0)
            raise AssertionError("g > 0 was accepted")
        except ValueError as err:
            assert "g is a log-decay" in str(err)
    print("TRITON-INTERPRET-OK")
    """
)


@pytest.mark.interpret
def test_triton_kernel_under_interpreter():
    """Run the Triton kernel on the CPU in a fresh process (TRITON_INTERPRET must be set before import)."""
    result = run_interpreted(["-c", TRITON_SCRIPT], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TRITON-INTERPRET-OK" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_on_cuda():
    (q, k, v, beta, g), s0 = hdla_inputs(3, 2, 4, 64, 64, device="cuda")
    o_ref, s_ref = naive_hdla(*(x.double() for x in (q, k, v, beta, g)), initial_state=s0.double(),
                              output_final_state=True)
    o, s = fused_recurrent_hdla(q, k, v, beta, g, initial_state=s0)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-4, atol=1e-4)
