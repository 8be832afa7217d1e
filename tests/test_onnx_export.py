"""ONNX export: the exportable decomposition of the ops (chunk form with the block-doubling
inverse) against the float64 token loop, and exported backbones run by onnxruntime against eager."""
import pytest
import torch

from hdla_vision.kernels import naive_generalized, naive_hdla
from hdla_vision.kernels.generalized.torch_chunk import doubling_unit_lower, solve_unit_lower
from hdla_vision.kernels.ops import exportable_generalized, exportable_hdla
from tests.oracle import generalized_problem, hdla_problem, rel_err


@pytest.mark.parametrize("tokens,rank", [(16, 1), (16, 2), (16, 3), (5, 2), (1, 1)])
def test_doubling_inverse_equals_triangular_solve(tokens, rank):
    """(I + L)^{-1} by block doubling equals solve_triangular's for strictly lower block-triangular L
    (r x r blocks on the diagonal are 0), chunk sizes that are and are not powers of two."""
    gen = torch.Generator().manual_seed(0)
    size = tokens * rank
    tok = torch.arange(size) // rank
    lmat = torch.randn(3, size, size, generator=gen, dtype=torch.float64) * 0.5
    lmat = lmat.masked_fill(~(tok[:, None] > tok[None, :]), 0.0)
    inv = doubling_unit_lower(lmat, rank)
    eye = torch.eye(size, dtype=torch.float64)
    assert rel_err(inv, solve_unit_lower(lmat, rank)) < 1e-12
    assert rel_err((eye + lmat) @ inv, eye.expand(3, -1, -1)) < 1e-12


GEN_CASES = [  # (batch, T, H, K, V, r_kv, r_ab, g_min, per_head_g, resets, reverse)
    (2, 37, 2, 8, 6, 1, 2, -3.0, False, 0.0, False),
    (1, 50, 2, 16, 8, 2, 3, -20.0, False, 0.1, True),
    (1, 33, 2, 8, 8, 1, 1, -3.0, True, 0.0, True),
    (1, 20, 1, 8, 8, 1, 0, -3.0, False, 0.0, False),
]


@pytest.mark.parametrize("batch,seq_len,heads,dk,dv,r_kv,r_ab,g_min,per_head_g,resets,reverse", GEN_CASES)
def test_exportable_generalized_matches_loop(batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min, per_head_g,
                                             resets, reverse):
    """fp32 exportable form (output and final state) against the float64 loop; resets are g = -inf."""
    p = generalized_problem(batch, seq_len, heads, dk, dv, r_kv, r_ab, g_min=g_min, per_head_g=per_head_g,
                            resets=resets)
    ref_o, ref_s = naive_generalized(**p, scale=0.5, output_final_state=True, reverse=reverse)
    f = {n: x.float() for n, x in p.items()}
    o, s = exportable_generalized(f["q"], f["k"], f["v"], f["a"], f["b"], f["g"], 0.5, f["initial_state"], reverse)
    assert o.dtype == torch.float32 and rel_err(o, ref_o) < 1e-4 and rel_err(s, ref_s) < 1e-4


@pytest.mark.parametrize("reverse", [False, True])
def test_exportable_hdla_matches_loop(reverse):
    p = hdla_problem(2, 45, 2, 16, 8, g_min=-8.0, resets=0.05)
    ref_o, ref_s = naive_hdla(**p, output_final_state=True, reverse=reverse)
    f = {n: x.float() for n, x in p.items()}
    o, s = exportable_hdla(f["q"], f["k"], f["v"], f["beta"], f["g"], 1.0, f["initial_state"], reverse)
    assert rel_err(o, ref_o) < 1e-4 and rel_err(s, ref_s) < 1e-4


# ----------------------------------------------------------------------------- exported backbones
def _onnx_outputs(path, images):
    """onnxruntime's outputs for each image batch ``[N, 3, S, S]``."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [torch.from_numpy(session.run(None, {"image": x.numpy()})[0]) for x in images]


def _check_graph(path):
    """Standard ONNX operators only (no custom-op domain), opset >= 17, a symbolic batch dimension."""
    import onnx

    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    domains = {node.domain for node in model.graph.node}
    assert domains <= {"", "ai.onnx"}, domains
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    batch_dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.HasField("dim_value")


def test_hdla_tiny_exports_and_matches_eager_at_batch_1_and_3(tmp_path):
    from hdla_vision.export import build_model, export_onnx

    torch.manual_seed(0)
    model = build_model("hdla_tiny", 32, depth=1)
    export_onnx(model, tmp_path / "hdla.onnx", img_size=32, opset=18)
    _check_graph(tmp_path / "hdla.onnx")
    images = [torch.randn(n, 3, 32, 32) for n in (1, 3)]
    with torch.no_grad():
        refs = [model(x) for x in images]
    for out, ref in zip(_onnx_outputs(tmp_path / "hdla.onnx", images), refs):
        assert out.shape == ref.shape and rel_err(out, ref) < 1e-4


def test_cli_exports_a_seed_mixer_checkpoint_that_matches_eager(tmp_path, capsys):
    """``python -m hdla_vision.export`` on a Gated DeltaNet export of this project (its recorded
    model_kwargs, depth 1, rebuild the model): onnxruntime on the file equals the saved model."""
    import timm

    from hdla_vision.export import main
    from hdla_vision.training.models import export_metadata, export_weights

    torch.manual_seed(0)
    model = timm.create_model("gdn_tiny", img_size=32, depth=1, num_classes=7).eval()
    export_weights(model, tmp_path / "w.safetensors", export_metadata("gdn_tiny", 7, 32, {"depth": 1}))
    assert main(["--model", "gdn_tiny", "--out", str(tmp_path / "gdn.onnx"), "--checkpoint",
                 str(tmp_path / "w.safetensors"), "--opset", "17"]) == 0
    assert "relative error" in capsys.readouterr().out
    _check_graph(tmp_path / "gdn.onnx")
    images = [torch.randn(n, 3, 32, 32) for n in (1, 3)]
    with torch.no_grad():
        refs = [model(x) for x in images]
    for out, ref in zip(_onnx_outputs(tmp_path / "gdn.onnx", images), refs):
        assert out.shape == ref.shape == (len(ref), 7) and rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("argv,named", [
    (["--model", "no_such_model", "--out", "m.onnx"], "--model"),
    (["--model", "hdla_tiny", "--out", "m.onnx", "--opset", "16"], "--opset"),
    (["--model", "hdla_tiny", "--out", "m.txt"], "--out"),
    (["--model", "hdla_tiny", "--out", "m.onnx", "--img-size", "0"], "--img-size"),
    (["--model", "hdla_tiny", "--out", "m.onnx", "--checkpoint", "missing.safetensors"], "--checkpoint"),
])
def test_cli_errors_name_the_argument(argv, named, tmp_path, monkeypatch, capsys):
    from hdla_vision.export import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2 and f"error: {named}" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_import_hdla_vision_does_not_import_the_exporter():
    import subprocess
    import sys

    code = "import sys, hdla_vision; assert 'hdla_vision.export' not in sys.modules; assert 'onnx' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
