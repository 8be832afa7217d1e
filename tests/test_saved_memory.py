"""tools/saved_memory.py: what autograd keeps for the backward, per storage, on fake CUDA tensors (CUDA
autocast, the Triton ops' fake outputs) and on real CPU tensors with the kernels interpreted."""
import json

import pytest
import torch

from hdla_vision.layers.mixer import set_activation_recompute
from tests.interpreted import run_interpreted
from tools.saved_memory import BASELINE, BATCH_SIZES, Setting, ratio_to_baseline, saved_by_block, saved_by_model

C, HEADS, HIDDEN = 192, 3, 768  # the tiny models: width, heads, MLP width
FP32, BF16 = 4, 2  # bytes
MIXER_MODELS = ("hdla_tiny", "gla_tiny", "gdn_tiny", "kda_tiny")
TARGET = 1.5  # issue 12 part 4: peak training memory at most 1.5x deit_tiny's


@pytest.fixture
def saving_activations():
    """The mixers and blocks save their activations instead of recomputing them (the state before issue 12
    part 4), for the duration of the test."""
    set_activation_recompute(False)
    yield
    set_activation_recompute(True)


def chunk_states(account, op="hdla_vision.chunk_hdla_bidirectional"):
    """The storages the bidirectional op itself allocated and saved (its ``x``; its y is saved by the output
    stage): ``[(shape, dtype), ...]``."""
    return sorted((s.shape, s.dtype) for s in account.saved.values() if s.producer == op and op in s.savers)


def test_deit_block_saves_exactly_what_its_ops_need():
    """deit_tiny's block under CUDA bf16 autocast, counted from first principles per token: both layer norms'
    fp32 inputs and their mean and rstd; the bf16 inputs of qkv and fc1; the qkv output (flash attention's
    q, k, v are views of it); the attention output (proj's input too) and its fp32 log-sum-exp per head;
    fc1's output (GELU's input) and GELU's output (fc2's input). Plus flash's philox seed and offset."""
    account = saved_by_block(BASELINE, 64, 2)
    per_token = (2 * (FP32 * C + 2 * FP32) + BF16 * C + BF16 * 3 * C + BF16 * C + FP32 * HEADS + BF16 * C
                 + 2 * BF16 * HIDDEN)
    assert account.tokens == 17
    assert account.total_bytes == 2 * 17 * per_token + 2 * 8 + 8
    assert account.weight_bytes == BF16 * (3 * C * C + C * C + 2 * C * HIDDEN)  # the four weights, autocast to bf16


@pytest.mark.parametrize("family, autocast, expected", [
    ("chunk16", torch.bfloat16, ((2, 16, HEADS, 2, 64), "bfloat16")),  # the reads X = S^T B, bf16
    ("chunk16", None, ((2, 16, HEADS, 2, 64), "float32")),
    ("chunk64", torch.bfloat16, ((2, HEADS, 1, 64, 64), "bfloat16")),  # the states entering each chunk
    ("chunk64", None, ((2, HEADS, 1, 64, 64), "float32")),
])
def test_the_ops_saved_states_are_counted(family, autocast, expected, monkeypatch):
    """What the Triton backward needs from the forward (the bidirectional op's ``x`` output) is counted once,
    both directions stacked, in the family's layout and dtype."""
    monkeypatch.setenv("HDLA_VISION_KERNELS", family)
    account = saved_by_block("hdla_tiny", 64, 2, Setting(autocast=autocast))
    shape, dtype = expected
    assert chunk_states(account) == [((2, *shape), dtype)]


def test_block_and_model_accounts_agree():
    """A whole model keeps what its blocks keep, and its stem and head on top: twelve blocks of hdla_tiny
    hold twelve times one block's bytes, give or take what the patch embedding and the head save."""
    block = saved_by_block("hdla_tiny", 64, 2)
    model = saved_by_model("hdla_tiny", 64, 2)
    stem_and_head = model.total_bytes - 12 * block.total_bytes
    assert 0 < stem_and_head < block.total_bytes
    base = saved_by_model(BASELINE, 64, 2)
    (ratio,) = ratio_to_baseline([model, base])
    assert ratio["predicted_peak_ratio"] == pytest.approx(model.predicted_peak_bytes() / base.predicted_peak_bytes(),
                                                          abs=1e-3)


def test_interpreted_kernels_save_what_the_fake_run_counts(tmp_path):
    """The chunk64 kernels, run under the Triton interpreter on real CPU tensors (fp32), save states of the
    shape and dtype the fake CUDA run counts."""
    out = tmp_path / "saved.json"
    proc = run_interpreted(["-m", "tools.saved_memory", "--mode", "cpu", "--kernels", "chunk64", "--dtype", "fp32",
                            "--models", "hdla_tiny", "--resolutions", "64", "--batch", "2", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (real,) = json.loads(out.read_text())["accounts"]
    real_states = sorted((tuple(s["shape"]), s["dtype"]) for s in real["storages"]
                         if s["producer"] == "hdla_vision.chunk_hdla_bidirectional"
                         and "hdla_vision.chunk_hdla_bidirectional" in s["savers"])
    assert real_states == [((2, 2, HEADS, 1, 64, 64), "float32")]


@pytest.mark.parametrize("family", ["chunk16", "chunk64"])
def test_hdla_block_saves_exactly_what_its_backward_needs(family, monkeypatch):
    """hdla_tiny's block under CUDA bf16 autocast, from first principles per token: the block's input (which
    the recomputed mixer stages keep, norm1 inside them) and the residual after the mixer (norm2's input),
    with norm2's mean and rstd; q, k, v in bf16 (shared by the directions); per direction g (fp32, per
    channel) and beta (fp32, per head), stacked for the bidirectional op (which computes the own write
    itself); the op's y (bf16) for the recomputed output stage; proj's and fc1's bf16 inputs; fc1's output,
    from which the MLP's activation is recomputed. Plus the op's states per direction: chunk16's reads X
    ``[B, T, H, 2, V]`` in bf16, chunk64's ``h [B, H, NT, K, V]`` in bf16 (one 64-token chunk here)."""
    monkeypatch.setenv("HDLA_VISION_KERNELS", family)
    account = saved_by_block("hdla_tiny", 64, 2)
    per_token = (FP32 * C + FP32 * C + 2 * FP32 + 3 * BF16 * C + 2 * (FP32 * C + FP32 * HEADS)
                 + BF16 * C + BF16 * C + BF16 * C + BF16 * HIDDEN)
    states = 2 * (2 * 16 * HEADS * 2 * 64 * BF16 if family == "chunk16" else 2 * HEADS * 1 * 64 * 64 * BF16)
    assert account.total_bytes == 2 * 16 * per_token + states


@pytest.mark.parametrize("family", ["chunk16", "chunk64"])
@pytest.mark.parametrize("img_size", [224, 1024])
def test_mixer_models_within_the_target_of_deit(img_size, family, monkeypatch):
    """Whole models at 224 and 1024 px with benchmarks.models' batches (256 and 16): saved activations plus
    16 bytes per parameter at most 1.5x deit_tiny's, and so is each block's saved bytes per image."""
    monkeypatch.setenv("HDLA_VISION_KERNELS", family)
    batch = BATCH_SIZES[img_size]
    models = [saved_by_model(name, img_size, batch) for name in (*MIXER_MODELS, BASELINE)]
    blocks = [saved_by_block(name, img_size, batch) for name in (*MIXER_MODELS, BASELINE)]
    for row in ratio_to_baseline(models):
        assert row["predicted_peak_ratio"] <= TARGET, row
    for row in ratio_to_baseline(blocks):
        assert row["saved_ratio"] <= TARGET, row


def test_saving_every_activation_is_what_the_target_rules_out(saving_activations):
    """The accounting tells the two apart: with the activations saved (the mixers before issue 12 part 4),
    gdn_tiny keeps more than 2.4x deit_tiny's bytes, and its block saves the projection before SiLU;
    hdla_tiny's fused prologue (one op from the projections to the scan's inputs) saves less than that."""
    (gdn,) = ratio_to_baseline([saved_by_model("gdn_tiny", 224, 256), saved_by_model(BASELINE, 224, 256)])
    (hdla,) = ratio_to_baseline([saved_by_model("hdla_tiny", 224, 256), saved_by_model(BASELINE, 224, 256)])
    assert gdn["predicted_peak_ratio"] > 2.4, gdn
    assert hdla["predicted_peak_ratio"] < gdn["predicted_peak_ratio"], (hdla, gdn)
    block = saved_by_block("gdn_tiny", 64, 2)
    assert any(s.module.endswith("attn.qkv") and "silu" in s.savers for s in block.saved.values())


@pytest.mark.parametrize("family", ["chunk16", "chunk64"])
def test_backward_scratch_holds_at_least_the_gradients(family):
    """``--op-scratch``: the peak one HDLA scan's Triton backward allocates (interpreted, bf16) counts at least
    the gradients it returns (dq, dk, dv in bf16, dbeta per head and dg per channel in fp32)."""
    proc = run_interpreted(["-m", "tools.saved_memory", "--op-scratch", "--kernels", family, "--resolutions", "64",
                            "--batch", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kernels"] == family and result["tokens"] == 16
    gradients = 3 * BF16 * C + FP32 * HEADS + FP32 * C
    assert result["backward_scratch_bytes_per_token"] > gradients
