"""tools/aot_check.py: Triton launches compile for the H100 (sm_90a) on a machine without a GPU."""
import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles real kernels: not under the interpreter", allow_module_level=True)

import triton.language as tl  # noqa: E402

from tools.aot_check import compile_only, format_records  # noqa: E402


@triton.jit
def _square_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    tile = tl.load(x_ptr + rows[:, None] * BLOCK + rows[None, :])
    tl.store(y_ptr + rows[:, None] * BLOCK + rows[None, :], tl.dot(tile, tile))


def test_launch_compiles_for_the_h100_and_runs_nothing():
    x = torch.ones(64, 64, dtype=torch.bfloat16)
    y = torch.full((64, 64), -1.0)
    with compile_only() as records:
        _square_kernel[(1,)](x, y, BLOCK=64, num_warps=4)
    assert (y == -1).all()  # nothing ran
    (record,) = records
    assert record["kernel"] == "_square_kernel" and record["constexprs"] == {"BLOCK": 64}
    assert record["wgmma"] and record["reg"] > 0 and record["stack"] == 0
    assert "_square_kernel" in format_records(records)


def test_the_driver_is_restored():
    from triton.runtime.driver import driver

    before = driver._active
    with compile_only():
        pass
    assert driver._active is before


@pytest.mark.parametrize("dk, r_kv, r_ab, per_head_g", [(16, 1, 0, False), (64, 4, 4, False), (128, 2, 3, True),
                                                         (256, 4, 4, False)])
def test_generalized_decoding_kernel_compiles_for_the_h100_without_spills(dk, r_kv, r_ab, per_head_g):
    """fused_recurrent_generalized's kernel at the LM's decoding step count (4 tokens), bf16 inputs."""
    from hdla_vision.kernels.generalized.fused_recurrent import triton_fused_recurrent_generalized

    batch, seq_len, heads = 1, 4, 2
    q = torch.zeros(batch, seq_len, heads, dk, dtype=torch.bfloat16)
    k, v = (torch.zeros(batch, seq_len, heads, r_kv, dk, dtype=torch.bfloat16) for _ in range(2))
    a, b = (torch.zeros(batch, seq_len, heads, r_ab, dk, dtype=torch.bfloat16) for _ in range(2))
    g = torch.zeros(batch, seq_len, heads, *(() if per_head_g else (dk,)))
    with compile_only() as records:
        triton_fused_recurrent_generalized(q, k, v, a, b, g, 1.0, torch.zeros(batch, heads, dk, dk))
    (record,) = records
    assert record["kernel"] == "_fused_recurrent_generalized_kernel" and record["constexprs"]["R_AB"] == r_ab
    assert 0 < record["reg"] <= 255 and record["stack"] == 0 and record["local"] == 0, format_records(records)


def test_recurrence_kernels_compile_for_the_h100():
    """The recurrence's forward and backward, both directions in one launch, d = 64, bf16: the interpreter runs
    them without Triton's type checks (a loop-carried variable whose type changes passes it and fails to
    compile), so they are compiled here. The forward keeps its state in registers with no spill; the backward
    takes all 255 registers with a few bytes of stack (8 on 2026-11-29, Triton 3.6; kernels/README.md §11 has
    its profile): a change that spills more fails here."""
    from hdla_vision.kernels.hdla import fused_recurrent as rec

    batch, seq_len, heads, dk = 1, 9, 1, 64
    q, k, v, do = (torch.zeros(batch, seq_len, heads, dk, dtype=torch.bfloat16) for _ in range(4))
    beta, g = torch.zeros(2, batch, seq_len, heads, dtype=torch.bfloat16), torch.zeros(2, batch, seq_len, heads, dk)
    with compile_only() as records:
        rec.triton_fused_recurrent_hdla_bidirectional(q, k, v, beta, g, 1.0, None)
        rec.triton_fused_recurrent_hdla_bidirectional_backward(do, None, q, k, v, beta, g, 1.0, None)
    by_name = {r["kernel"]: r for r in records}
    fwd, bwd = by_name["_fused_recurrent_hdla_fwd_kernel"], by_name["_fused_recurrent_hdla_bwd_kernel"]
    assert 0 < fwd["reg"] <= 255 and fwd["stack"] == 0 and fwd["local"] == 0, format_records(records)
    assert 0 < bwd["reg"] <= 255 and bwd["stack"] <= 64, format_records(records)


@pytest.mark.parametrize("with_bias", [False, True])
def test_short_convolution_kernels_compile_for_the_h100_without_spills(with_bias):
    """causal_conv1d's forward and backward (bf16 x, fp32 filter, 4 taps): the interpreter does not type-check
    them, and the mixers run them on every CUDA training step."""
    from hdla_vision.kernels.short_conv import fused

    x = torch.zeros(2, 45, 200, dtype=torch.bfloat16)
    weight, bias = torch.zeros(200, 4), torch.zeros(200) if with_bias else None
    with compile_only() as records:
        fused.causal_conv_fwd_kernel[fused._grid(x)](x, weight, x if bias is None else bias, x, 45, 200, K=4,
                                                      HAS_BIAS=with_bias, BT=fused.BLOCK_T, BC=fused.BLOCK_C,
                                                      num_warps=4)
        part = torch.zeros(2, 200, 4)
        fused.causal_conv_bwd_kernel[fused._grid(x, fused.SEG_TILES)](x, weight, x, x, part, part[..., 0], 45, 200,
                                                                       K=4, BT=fused.BLOCK_T, BC=fused.BLOCK_C,
                                                                       SEG_TILES=fused.SEG_TILES, num_warps=4)
    assert {r["kernel"] for r in records} == {"causal_conv_fwd_kernel", "causal_conv_bwd_kernel"}
    assert all(0 < r["reg"] <= 255 and r["stack"] == 0 and r["local"] == 0 for r in records), format_records(records)


@pytest.mark.parametrize("diag_limit, record_path", [(35.0, False), (0.0, False), (35.0, True)])
def test_forward_intra_kernel_compiles_for_the_h100(diag_limit, record_path):
    """F1ab (``chunk_intra_kernel``) with its factored diagonal blocks and their levels (limit 35, the
    default), without them (limit 0: the exact loop alone) and recording its path, HDLA at K = 64 in
    bf16: the branches that the interpreter tests may never take compile too."""
    from hdla_vision.kernels.generalized import fwd

    assert diag_limit in (fwd.DIAG_LIMIT, 0.0)
    batch, seq_len, heads, dk = 1, 64, 1, 64
    q, k, v = (torch.zeros(batch, seq_len, heads, dk, dtype=torch.bfloat16) for _ in range(3))
    beta = torch.zeros(batch, seq_len, heads, dtype=torch.bfloat16)
    g = torch.zeros(batch, seq_len, heads, dk)
    with compile_only() as records:
        fwd.chunk_prepare(q, k, v, None, None, g, 1.0, False, hdla_beta=beta, diag_limit=diag_limit,
                          record_path=record_path)
    (intra,) = [r for r in records if r["kernel"] == "chunk_intra_kernel"]
    assert intra["constexprs"]["DIAG_LIMIT"] == diag_limit and intra["constexprs"]["RECORD_PATH"] == record_path
    assert 0 < intra["reg"] <= 255, format_records(records)


@pytest.mark.parametrize("dtype, dirs", [(torch.bfloat16, 1), (torch.float32, 1), (torch.bfloat16, 2)])
def test_backward_levels_kernels_compile_for_the_h100(dtype, dirs):
    """B2's levels passes (S2b ``_gram_levels_kernel``, S5b ``_gram_vjp_levels_kernel``: the diagonal blocks
    of fast gates, kernels/generalized/diag_levels.py) compile for HDLA at K = 64 with tf32x3 (bf16 inputs)
    and exact fp32 operands, and with both directions in one launch (``dirs = 2``: the reversed scan's
    strict M_QK a runtime flag, kernels/README.md §9); the interpreter tests run them, the device only
    where gates are fast."""
    from hdla_vision.kernels.generalized import bwd

    batch, seq_len, heads, dk = 1, 64, 1, 64
    q, k, v, do = (torch.zeros(batch, seq_len, heads, dk, dtype=dtype) for _ in range(4))
    beta = torch.zeros(dirs, batch, seq_len, heads, dtype=dtype)  # per direction, as g
    g = torch.zeros(dirs, batch, seq_len, heads, dk)
    strides = dict(hdla_beta=beta[0].numel(), g=g[0].numel()) if dirs == 2 else None
    h = torch.zeros(dirs * batch, heads, 2, dk, dk, dtype=dtype)
    with compile_only() as records:  # (F1's levels: test_forward_intra_kernel_compiles_for_the_h100)
        bwd.generalized_backward(do, None, q, k, v, None, None, g[0], 1.0, None, h, False, hdla_beta=beta[0],
                                 direction_strides=strides)
    names = [r["kernel"] for r in records]
    assert "_gram_levels_kernel" in names and "_gram_vjp_levels_kernel" in names, names
    for r in records:
        assert 0 < r["reg"] <= 255, format_records(records)
        if r["kernel"] in ("_gram_levels_kernel", "_gram_vjp_levels_kernel"):
            assert r["constexprs"]["DIRS"] == dirs, r["constexprs"]


def test_launches_bound_only_counts_and_runs_nothing():
    from tools.aot_check import launches_bound_only

    x = torch.ones(64, 64, dtype=torch.bfloat16)
    y = torch.full((64, 64), -1.0)
    counter = [0, 0.0]
    with launches_bound_only(counter):
        for _ in range(3):
            _square_kernel[(1,)](x, y, BLOCK=64, num_warps=4)
    assert (y == -1).all() and counter[0] == 3 and counter[1] > 0


def test_host_ms_sees_s4_grouping_in_the_launch_count(monkeypatch):
    """GLA's fwd+bwd (rank 0: the smallest set of kernels to compile) on the chunk kernels: S4's four products in one
    launch instead of four."""
    from tools.aot_check import host_ms

    monkeypatch.setenv("HDLA_VISION_KERNELS", "chunk64")
    shape = (1, 64, 1, 16)
    _, _, grouped = host_ms("gla", shape, s4_group=4, repeats=1)
    _, _, single = host_ms("gla", shape, s4_group=1, repeats=1)
    assert single - grouped == 3, (single, grouped)


def test_triton_path_for_cpu_tensors_leaves_no_module_patched(monkeypatch):
    """A module that takes ``use_triton`` from kernels.utils inside the block (a lazy import) gets the real one back:
    later tests would otherwise launch Triton kernels on CPU tensors without the interpreter."""
    import sys
    import types

    from hdla_vision.kernels import utils
    from tools.aot_check import triton_path_for_cpu_tensors

    real = utils.use_triton
    with triton_path_for_cpu_tensors():
        assert utils.use_triton(torch.zeros(1)) is True
        late = types.ModuleType("hdla_vision.kernels._late_import_probe")
        late.use_triton = utils.use_triton  # what `from ..utils import use_triton` binds inside the block
        monkeypatch.setitem(sys.modules, late.__name__, late)
    assert utils.use_triton is real and late.use_triton is real


def test_triton_path_for_cpu_tensors_restores_a_module_listed_twice(monkeypatch):
    """One module object under two names in sys.modules (its second entry sees the patch of the first)."""
    import sys

    from hdla_vision.kernels import utils
    from tools.aot_check import triton_path_for_cpu_tensors

    real = utils.use_triton
    monkeypatch.setitem(sys.modules, "kernels.utils", utils)
    with triton_path_for_cpu_tensors():
        assert utils.use_triton(torch.zeros(1)) is True
    assert utils.use_triton is real
