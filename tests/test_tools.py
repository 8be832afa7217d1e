"""tools/: carrying fla's Triton cache between device calls, merging the fla comparison's per-GPU JSONs,
and the seed-mixer pairing of tools/fla_ops.py."""
import json
import tarfile

import pytest
import torch

from tools import fla_seed_merge, triton_cache
from tools.fla_ops import MIXERS, as_float64
from hdla_vision.kernels import naive_generalized
from hdla_vision.kernels.utils import KERNEL_FAMILY_ENV
from tests.backends import backends
from tests.oracle import rel_err


def _fake_entry(root, name, kernel):
    entry = root / name
    entry.mkdir(parents=True)
    (entry / f"{kernel}.cubin").write_bytes(b"\x00binary")
    (entry / f"__grp__{kernel}.json").write_text("{}")
    return entry


def test_pack_keeps_foreign_kernels_and_leaves_ours_out(tmp_path, monkeypatch):
    assert {"chunk_scan_kernel", "chunk_local_kernel", "_fused_recurrent_hdla_fwd_kernel"} <= triton_cache.our_kernel_names()
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


def test_pack_to_plain_tar_for_external_compression(tmp_path, monkeypatch):
    _fake_entry(tmp_path / "cache", "AAA", "chunk_kda_fwd_kernel")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    triton_cache.pack(tmp_path / "fla.tar")
    with tarfile.open(tmp_path / "fla.tar", "r:") as tar:  # "r:" refuses compressed archives
        assert "AAA/chunk_kda_fwd_kernel.cubin" in tar.getnames()


def test_pack_cut_short_leaves_no_archive(tmp_path, monkeypatch):
    _fake_entry(tmp_path / "cache", "AAA", "chunk_kda_fwd_kernel")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # what a time limit's signal looks like halfway through

    monkeypatch.setattr(tarfile.TarFile, "add", killed)
    with pytest.raises(KeyboardInterrupt):
        triton_cache.pack(tmp_path / "fla.tar.xz")
    assert not (tmp_path / "fla.tar.xz").exists()


def _seed_result(folder, mixer, device="NVIDIA H200", forced=(), commit="abc"):
    folder.mkdir()
    result = {"device": device, "torch": "2.11", "triton": "3.6.0", "fla": "0.6.0", "scale": 0.125, "commit": commit,
              "fla_kernels": {mixer: "chunk_x"}, "fla_gated_bwd_forced_for": list(forced),
              "parity": {mixer: {"bfloat16": {}}}, "timings_ms": {f"vision/{mixer}": {"ours": {"fwd": 1.0}}}}
    (folder / "fla_seed.json").write_text(json.dumps(result))


def test_fla_seed_merges_one_json_per_gpu(tmp_path):
    _seed_result(tmp_path / "a", "gla")
    _seed_result(tmp_path / "b", "gated_deltanet", forced=["gated_deltanet"], commit="def")
    fla_seed_merge.merge([tmp_path / "a", tmp_path / "b"], tmp_path)
    merged = json.loads((tmp_path / "fla_seed.json").read_text())
    assert set(merged["parity"]) == {"gla", "gated_deltanet"}
    assert set(merged["timings_ms"]) == {"vision/gla", "vision/gated_deltanet"}
    assert merged["fla_gated_bwd_forced_for"] == ["gated_deltanet"]
    assert merged["commits"] == {"gla": "abc", "gated_deltanet": "def"} and "commit" not in merged
    _seed_result(tmp_path / "c", "kda", device="NVIDIA H100")
    with pytest.raises(ValueError, match="device"):
        fla_seed_merge.merge([tmp_path / "a", tmp_path / "c"], tmp_path)


def test_each_mixer_runs_our_op_like_its_float64_loop():
    """The 'ours' side of the fla comparison equals the token loop on the same factor functions."""
    for name, (make, _fla, ours, _kernel) in MIXERS.items():
        x = make(1, 21, 2, 16, torch.float32, "cpu", torch.Generator().manual_seed(0))
        out = ours(x, 0.5)
        ref = ours(as_float64(x), 0.5, op=naive_generalized)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (name, err)


@pytest.mark.parametrize("backend", backends("interpreter"), indirect=True)
def test_delta_shaped_mixers_run_the_delta_rule_in_the_fla_comparison(backend, monkeypatch):
    """Under HDLA_VISION_KERNELS=delta the 'ours' side of the mixers that are products of delta steps takes the
    delta rule's sub-step op (as the mixers do), and still equals the float64 loop; the others keep theirs."""
    from hdla_vision.kernels.delta_rule import steps as delta_steps

    monkeypatch.setenv(KERNEL_FAMILY_ENV, "delta")
    calls = []
    substeps = delta_steps.substeps
    monkeypatch.setattr(delta_steps, "substeps", lambda *a: calls.append(a[1].shape[3]) or substeps(*a))
    for name, (make, _fla, ours, _kernel) in MIXERS.items():
        calls.clear()
        x = make(1, 21, 2, 16, torch.float32, "cpu", torch.Generator().manual_seed(0))
        out = ours(x, 0.5)
        ref = ours(as_float64(x), 0.5, op=naive_generalized)
        assert rel_err(out, ref) < 1e-5, name
        assert calls == ([] if name == "rwkv7" else [int(name[-1]) if name[-1].isdigit() else 1]), (name, calls)


def test_benchmark_readme_is_what_the_committed_jsons_give():
    """benchmarks/README.md's tables are regenerated, never edited: ``python -m tools.benchmark_tables``."""
    from tools import benchmark_tables

    committed = benchmark_tables.README.read_text()
    assert benchmark_tables.regenerate(committed) == committed, "run python -m tools.benchmark_tables"
    assert benchmark_tables.main(["--check"]) == 0
    for path in sorted(benchmark_tables.RESULTS.rglob("*.json")):
        name = path.relative_to(benchmark_tables.RESULTS).as_posix()
        if name.startswith(("kernels", "fla_seed", "models", "loglinear", "train_throughput", "kernel_stages_aot",
                            "aot/")):
            assert f"<!-- table: {name} -->" in committed, name


def test_benchmark_tables_replace_edited_numbers_and_refuse_unknown_sources():
    from tools import benchmark_tables

    committed = benchmark_tables.README.read_text()
    edited = committed.replace("| hdla_tiny | train | 224 | 256 | 166.800 |", "| hdla_tiny | train | 224 | 256 | 1.000 |")
    assert edited != committed and benchmark_tables.regenerate(edited) == committed
    with pytest.raises(ValueError, match="no table renderer for 'mystery.json'"):
        benchmark_tables.regenerate("<!-- table: mystery.json -->\n<!-- end table -->\n")
    with pytest.raises(ValueError, match="no '<!-- table"):
        benchmark_tables.regenerate("no tables here\n")


def test_models_table_shows_the_engine_rows_when_a_run_has_them(tmp_path, monkeypatch):
    from tools import benchmark_tables

    result = json.loads((benchmark_tables.RESULTS / "models_h100.json").read_text())
    engine = json.loads((benchmark_tables.RESULTS / "train_throughput_h100.json").read_text())["rows"]
    (tmp_path / "models_x.json").write_text(json.dumps(dict(result, engine=engine)))
    monkeypatch.setattr(benchmark_tables, "RESULTS", tmp_path)
    table = benchmark_tables.render("models_x.json")
    assert "| model (engine step) |" in table and "| hdla_tiny | 224 | 256 | bf16 | 171.141 | 1495.8 | 12.2 |" in table
    assert table.startswith("`results/models_x.json`: NVIDIA H100 80GB HBM3, 2026-11-22")


def test_kernels_table_shows_the_cuda_graph_columns_when_a_run_has_them(tmp_path, monkeypatch):
    from tools import benchmark_tables

    result = json.loads((benchmark_tables.RESULTS / "op_floor_h200" / "kernels.json").read_text())
    plain = benchmark_tables.render("op_floor_h200/kernels.json")
    result["timings_ms"]["b224/ours"].update(fwd_graph=0.5, fwd_bwd_graph=5.0)
    (tmp_path / "call").mkdir()
    (tmp_path / "call" / "kernels.json").write_text(json.dumps(result))
    monkeypatch.setattr(benchmark_tables, "RESULTS", tmp_path)
    table = benchmark_tables.render("call/kernels.json")
    assert "CUDA graph" not in plain and "| fwd ms, CUDA graph | fwd+bwd ms, CUDA graph |" in table
    assert "| b224 | ours | 0.636 | 6.265 | 0.500 | 5.000 | 121.5 / 37.0 |" in table
    assert "| b224 | sdpa | 0.079 | 0.366 |  |  |  |" in table


def test_benchmark_provenance_names_device_date_and_commit(monkeypatch):
    import datetime
    import subprocess

    from tools.provenance import ROOT, provenance

    monkeypatch.setenv("COMMIT", "abc1234")
    assert provenance("NVIDIA H100") == {"device": "NVIDIA H100", "date": datetime.date.today().isoformat(),
                                         "commit": "abc1234"}
    monkeypatch.delenv("COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert provenance("cpu")["commit"] == (head.stdout.strip() or "unknown")


def test_mqar_runner_records_the_commit_as_the_benchmarks_do(monkeypatch):
    """hdla_vision/lm may not import tools/, so the MQAR runner keeps its own copy of the rule."""
    from hdla_vision.lm.mqar_runner import git_commit
    from tools.provenance import current_commit

    monkeypatch.setenv("COMMIT", "abc1234")
    assert git_commit() == current_commit() == "abc1234"
    monkeypatch.delenv("COMMIT")
    assert git_commit() == current_commit()


def test_every_benchmark_that_writes_a_json_starts_it_with_provenance():
    from tools.benchmark_tables import ROOT

    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        source = path.read_text()
        if "json.dump(" in source:
            assert "from tools.provenance import provenance" in source and "provenance(" in source, path.name


def test_mqar_device_entry_point_is_a_tool():
    """The MQAR device tooling runs as ``python -m tools.mqar_device`` (tools/mqar_device.sh calls it)."""
    import subprocess
    import sys

    from tools.provenance import ROOT

    run = subprocess.run([sys.executable, "-m", "tools.mqar_device", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "{restore,export,collect}" in run.stdout
    assert "python3 -m tools.mqar_device restore" in (ROOT / "tools" / "mqar_device.sh").read_text()


def test_models_benchmark_compares_compiled_cells_with_eager_and_deit(tmp_path, monkeypatch):
    """``benchmarks.models --compile``: rows carry their compile setting; ratios are taken against deit_tiny
    under the same setting and against the same model's eager cell; the README table shows both."""
    from benchmarks import models
    from tools import benchmark_tables

    args = models.parse_args(["--resolutions", "224", "--compile", "--cuda-graphs"])
    assert args.compile_modes == ["eager", "default", "reduce-overhead"]
    assert models.parse_args(["--resolutions", "224", "--compile", "max-autotune", "--no-eager"]).compile_modes == [
        "max-autotune"]
    with pytest.raises(SystemExit):
        models.parse_args(["--resolutions", "224", "--no-eager"])
    assert not models.parse_args(["--resolutions", "224"]).no_activation_recompute
    assert models.parse_args(["--resolutions", "224", "--no-activation-recompute"]).no_activation_recompute

    def row(model, compile_mode, images_per_s, mem, **extra):
        return dict(model=model, mode="train", compile=compile_mode, resolution=224, batch=256, tokens=196,
                    step_ms=256e3 / images_per_s, images_per_s=images_per_s, peak_mem_mib=mem, **extra)

    rows = [row("hdla_tiny", "eager", 100.0, 1000.0), row("deit_tiny_patch16_224", "eager", 500.0, 400.0),
            row("hdla_tiny", "default", 150.0, 800.0, graphs=1, graph_breaks=0),
            row("deit_tiny_patch16_224", "default", 600.0, 400.0, graphs=1, graph_breaks=0)]
    ratios = {(r["model"], r["compile"]): r for r in models.ratio_rows(rows)}
    assert ratios[("hdla_tiny", "eager")] == dict(model="hdla_tiny", mode="train", compile="eager", resolution=224,
                                                  speed_ratio=0.2, memory_ratio=2.5)
    assert ratios[("hdla_tiny", "default")]["speed_ratio"] == 0.25
    assert ratios[("hdla_tiny", "default")]["compile_speedup"] == 1.5
    assert ratios[("deit_tiny_patch16_224", "default")]["compile_speedup"] == 1.2
    assert ("deit_tiny_patch16_224", "eager") not in ratios  # the baseline against itself, eager: nothing to say

    result = dict(device="NVIDIA H100", date="2026-11-24", commit="abc1234", autocast="bfloat16", rows=rows,
                  ratios=list(ratios.values()))
    (tmp_path / "models_c.json").write_text(json.dumps(result))
    monkeypatch.setattr(benchmark_tables, "RESULTS", tmp_path)
    table = benchmark_tables.render("models_c.json")
    assert "| hdla_tiny | train | default | 224 | 256 | 1706.667 | 150.0 | 800 | 1/0 |" in table
    assert "| hdla_tiny | train | default | 224 | 0.25 | 2.0 | 1.5 | 0.8 |" in table


def test_models_profile_sorts_kernels_into_block_parts():
    """``benchmarks.models --profile``: each CUDA kernel goes to one part of a block (our scan kernels by
    their Triton names, cuBLAS / CUTLASS GEMMs, attention, the ViT's own norms and activations, the
    optimizer, the rest glue), summed per block and step."""
    from types import SimpleNamespace

    from benchmarks import models

    cuda = torch.autograd.DeviceType.CUDA
    scan = {"_gram_kernel"}
    assert models.block_part("_gram_kernel", scan) == "scan_op"
    assert models.block_part("nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNN", scan) == "gemm"
    assert models.block_part("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", scan) == "gemm"
    assert models.block_part("flash_fwd_kernel", scan) == "attention"
    assert models.block_part("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel", scan) == \
        "vit_shared"
    assert models.block_part("void at::native::vectorized_elementwise_kernel<4, at::native::sigmoid>", scan) == "glue"
    events = [SimpleNamespace(key="nvjet_x", device_type=cuda, self_device_time_total=6000.0, count=12),
              SimpleNamespace(key="elementwise", device_type=cuda, self_device_time_total=3000.0, count=24),
              SimpleNamespace(key="aten::mm", device_type=torch.autograd.DeviceType.CPU,
                              self_device_time_total=0.0, count=5)]
    parts = models.profile_parts(events, blocks=2, steps=3)
    assert parts == {"gemm": {"ms": 1.0, "launches": 2.0}, "glue": {"ms": 0.5, "launches": 4.0}}
    assert "total" in models.format_parts(parts)


def test_launch_configs_summary_lines(tmp_path):
    """``python -m benchmarks.launch_configs --summarize`` (the device scripts' summary): one line per row of
    either kind, a failed row as its error, a missing file named."""
    from benchmarks.launch_configs import summary_lines

    rows = [dict(shape="lm", variant="base", fwd_bwd_ms=12.8246, max_rel_vs_base=0.0, peak_mib=1998,
                 kernels_us={"chunk_nc_kernel": [567.04, 1.0], "chunk_intra_kernel": [2900.5, 1.0]}),
            dict(shape="lm", variant="f1ab_reg128", error="OutOfResources: shared memory"),
            dict(variant="base", round=1, resolution=512, step_ms=177.418, images_per_s=360.72, peak_mem_mib=7862.7)]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(dict(device="H200", rows=rows)))
    lines = summary_lines(str(path), ["chunk_nc_kernel", "absent_kernel"])
    assert lines[0] == "lm base 12.825 ms rel 0.0e+00 1998 MiB kernel sum 3467.5 us {'chunk_nc_kernel': 567.0}"
    assert "OutOfResources" in lines[1]
    assert lines[2] == "base 1 512 177.42 ms 360.7 img/s 7863 MiB"
    assert summary_lines(str(tmp_path / "none.json")) == [f"missing {tmp_path / 'none.json'}"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_timing_replays_the_step_and_times_our_op():
    """benchmarks.timing.graphed: a replay reruns the captured kernels on the inputs' current values; the chunk op's
    forward and forward+backward capture and time (benchmarks.kernels --cuda-graphs)."""
    from benchmarks.kernels import graphed_times, make_inputs, ours
    from benchmarks.timing import graphed

    x = torch.randn(64, 64, device="cuda")
    out = torch.empty_like(x)
    replay = graphed(lambda: out.copy_(x @ x))
    x.copy_(2 * torch.eye(64, device="cuda"))
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, 4 * torch.eye(64, device="cuda"))
    times = graphed_times(ours, make_inputs(2, 700, 2, 64, torch.bfloat16, "cuda"))  # the chunk kernels
    assert "graph_error" not in times and 0 < times["fwd_graph"] < times["fwd_bwd_graph"], times


def test_delta_rule_table_shows_every_variant_and_failures(monkeypatch):
    """``benchmarks.delta_rule``'s JSON renders a row per shape and op (a failed variant as "failed") and the errors."""
    from tools import benchmark_tables

    shape = {"bthd": [4, 4096, 16, 128]}
    result = {"device": "GPU", "date": "2026-11-29", "commit": "abc1234", "dtype": "bfloat16",
              "parity": {"short/tf32x3": 1.2e-3, "short/tf32": 4.5e-3, "long_d128/tf32x3": "failed: OutOfResources"},
              "fwd_ms": {"lm": {**shape, "hdla_today": 4.5, "delta_hdla_tf32": "failed: OutOfResources"}},
              "fwd_bwd_ms": {"lm": {**shape, "hdla_today": 13.1, "delta_hdla_tf32": "failed: OutOfResources"}}}
    monkeypatch.setattr(benchmark_tables, "load", lambda name: result)
    table = benchmark_tables.render("delta_rule_h200/delta_rule.json")
    assert "| lm | 4, 4096, 16, 128 | hdla_today | 4.500 | 13.100 |" in table
    assert "| lm | 4, 4096, 16, 128 | delta_hdla_tf32 | failed | failed |" in table
    assert "| short/tf32 | 4.5e-03 |" in table and "| long_d128/tf32x3 | failed: OutOfResources |" in table
    assert "commit abc1234" in table


def test_delta_kernels_table_shows_each_kernel_and_failures(monkeypatch):
    """``benchmarks.delta_rule_kernels``'s JSON renders a row per shape and variant: fwd+bwd, the kernels' sum, µs
    per kernel (P..dC for ours, fla's three costliest), a failed variant with its error."""
    from tools import benchmark_tables

    ours = {"_prepare_kernel": 100.0, "_state_kernel": 20.0, "_output_kernel": 5.0, "_state_bwd_kernel": 30.0,
            "_chunk_bwd_kernel": 200.0}
    fla = {"chunk_kda_bwd_kernel_intra": 50.0, "recompute_w_u_fwd_kda_kernel": 20.0, "chunk_gla_fwd_kernel_o": 10.0,
           "chunk_local_cumsum_vector_kernel": 1.0}
    result = {"device": "GPU", "date": "2026-11-29", "commit": "abc1234", "dtype": "bfloat16", "precision": "tf32",
              "shapes": {"lm": {"bthd": [4, 4096, 16, 128], "fla_kda": {"fwd_bwd_ms": 0.09, "kernel_us": fla},
                                "base": {"fwd_bwd_ms": 0.36, "kernel_us": ours},
                                "bv64": {"failed": "OutOfResources: out of resource: shared memory"}}}}
    monkeypatch.setattr(benchmark_tables, "load", lambda name: result)
    table = benchmark_tables.render("delta_kernels_h200/delta_rule_kernels_1_first.json")
    assert "| lm | base | 0.360 | 355 | P 100, S 20, O 5, dS 30, dC 200 |" in table
    assert "| lm | fla_kda | 0.090 | 81 | chunk_kda_bwd_kernel_intra 50, recompute_w_u_fwd_kda_kernel 20, " \
           "chunk_gla_fwd_kernel_o 10 |" in table
    assert "| lm | bv64 | failed |  | OutOfResources: out of resource: shared memory |" in table
    assert "commit abc1234" in table and "precision tf32" in table
