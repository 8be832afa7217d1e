"""Every (r_ab, r_kv, K, V) that chunk_generalized accepts runs fwd+bwd on the GPU and matches the
float64 loop in bf16; every one it refuses raises ValueError. One subprocess per case (an illegal
memory access would poison this process's CUDA context). See tests/gpu_rank_sweep.py."""
import pytest
import torch

from tests.gpu_rank_sweep import all_cases, bad_cases, markdown_table, sweep

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_rank_and_head_dim_sweep():
    results = sweep(all_cases(), jobs=8)
    assert not bad_cases(results), markdown_table(results)
    assert any(r["status"] == "ok" for r in results.values())
