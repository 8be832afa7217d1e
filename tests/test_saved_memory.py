"""tools/saved_memory.py: what autograd keeps for the backward, per storage, on fake CUDA tensors (CUDA
autocast, the Triton ops' fake outputs) and on real CPU tensors with the kernels interpreted."""
import json

import pytest
import torch

from tests.interpreted import run_interpreted
from tools.saved_memory import BASELINE, Setting, ratio_to_baseline, saved_by_block, saved_by_model

C, HEADS, HIDDEN = 192, 3, 768  # the tiny models: width, heads, MLP width
FP32, BF16 = 4, 2  # bytes


def chunk_states(account, op="hdla_vision.chunk_hdla"):
    """The storages the chunk op itself allocated and saved (its ``x``): ``[(shape, dtype), ...]``."""
    return sorted((s.shape, s.dtype) for s in account.saved.values() if s.producer == op)


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
    ("chunk16", torch.bfloat16, ((2, 16, HEADS, 2, 64), "float32")),  # the reads X = S^T B, fp32
    ("chunk64", torch.bfloat16, ((2, HEADS, 1, 64, 64), "bfloat16")),  # the states entering each chunk
    ("chunk64", None, ((2, HEADS, 1, 64, 64), "float32")),
])
def test_the_ops_saved_states_are_counted(family, autocast, expected, monkeypatch):
    """What the Triton backward needs from the forward (the op's ``x`` output) is counted once per direction,
    in the family's layout and dtype."""
    monkeypatch.setenv("HDLA_VISION_KERNELS", family)
    account = saved_by_block("hdla_tiny", 64, 2, Setting(autocast=autocast))
    assert chunk_states(account) == [expected, expected]


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
                         if s["producer"] == "hdla_vision.chunk_hdla")
    assert real_states == [((2, HEADS, 1, 64, 64), "float32")] * 2
