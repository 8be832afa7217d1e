"""The device-call helpers of benchmarks/: carrying fla's Triton cache, and the seed-mixer pairing."""
import torch

from benchmarks import triton_cache
from benchmarks.fla_ops import MIXERS, as_float64
from hdla_vision.kernels import naive_generalized


def _fake_entry(root, name, kernel):
    entry = root / name
    entry.mkdir(parents=True)
    (entry / f"{kernel}.cubin").write_bytes(b"\x00binary")
    (entry / f"__grp__{kernel}.json").write_text("{}")
    return entry


def test_pack_keeps_foreign_kernels_and_leaves_ours_out(tmp_path, monkeypatch):
    assert {"chunk_scan_kernel", "chunk_local_kernel", "_fused_recurrent_hdla_kernel"} <= triton_cache.our_kernel_names()
    cache = tmp_path / "cache"
    _fake_entry(cache, "AAA", "chunk_kda_fwd_kernel")
    _fake_entry(cache, "BBB", "chunk_scan_kernel")
    (cache / "AAA" / "chunk_kda_fwd_kernel.autotune.json").write_text("{}")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    archive = tmp_path / "fla.tar.xz"
    triton_cache.pack(archive)

    restored = tmp_path / "restored"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(restored))
    triton_cache.unpack(archive)
    assert sorted(p.name for p in restored.iterdir()) == ["AAA"]
    assert (restored / "AAA" / "chunk_kda_fwd_kernel.cubin").read_bytes() == b"\x00binary"
    triton_cache.drop_autotune()
    assert not list(restored.rglob("*.autotune.json"))


def test_each_mixer_runs_our_op_like_its_float64_loop():
    """The 'ours' side of the fla comparison equals the token loop on the same factor functions."""
    for name, (make, _fla, ours, _kernel) in MIXERS.items():
        x = make(1, 21, 2, 16, torch.float32, "cpu", torch.Generator().manual_seed(0))
        out = ours(x, 0.5)
        ref = ours(as_float64(x), 0.5, op=naive_generalized)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (name, err)
