"""Bad input gets a clear message naming what is wrong (CLI exit code 2), never a silent load."""
from __future__ import annotations

import shutil

import hdla_vision  # noqa: F401  (registers the timm models)
import pytest

from hdla_vision.training import runner
from hdla_vision.training.config import load_config
from hdla_vision.training.models import create_model, export_metadata, export_weights
from tests.training_helpers import (
    cli_module, reset_accelerate_state, tiny_config, tiny_config_dict, write_config)

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singletons, per test





@pytest.fixture(scope="module")
def one_epoch_run(tmp_path_factory, data_dir):
    reset_accelerate_state()
    out = tmp_path_factory.mktemp("run")
    runner.train(tiny_config(data_dir, sched={"epochs": 1, "warmup_epochs": 0}), out)
    return out


def run_cli(tmp_path, capsys, values: dict, *extra: str) -> str:
    """Run train_imagenet.main with a config written from ``values``; return stderr (exit code must be 2)."""
    config = write_config(tmp_path / "config.yaml", values)
    code = cli_module().main(["--config", str(config), "--output-dir", str(tmp_path / "out"), *extra])
    assert code == 2
    return capsys.readouterr().err


def test_missing_data_directory(tmp_path, capsys, data_dir):
    err = run_cli(tmp_path, capsys, tiny_config_dict(data_dir), "--data-dir", str(tmp_path / "nowhere"))
    assert "nowhere" in err and "does not exist" in err


def test_data_directory_without_val_split(tmp_path, capsys, data_dir):
    broken = tmp_path / "broken"
    shutil.copytree(data_dir / "train", broken / "train")
    err = run_cli(tmp_path, capsys, tiny_config_dict(broken))
    assert "malformed" in err and "val" in err


def test_class_count_mismatch(tmp_path, capsys, data_dir):
    values = tiny_config_dict(data_dir, data={"num_classes": 7})
    assert "data.num_classes is 7" in run_cli(tmp_path, capsys, values)


def test_unreadable_image_names_the_file(tmp_path, data_dir):
    broken = tmp_path / "broken"
    shutil.copytree(data_dir, broken)
    victim = sorted((broken / "train" / "circle").iterdir())[0]
    victim.write_bytes(b"this is not a png")
    with pytest.raises(ValueError, match=f"cannot read image '.*{victim.name}'"):
        runner.train(tiny_config(broken, sched={"epochs": 1}), tmp_path / "out")


def test_unknown_model(tmp_path, capsys, data_dir):
    values = tiny_config_dict(data_dir, model={"name": "deit_tinyy_patch16_224"})
    assert "unknown model 'deit_tinyy_patch16_224'" in run_cli(tmp_path, capsys, values)


def test_unknown_config_keys_and_bad_values(tmp_path, data_dir):
    path = write_config(tmp_path / "c.yaml", tiny_config_dict(data_dir, optim={"base_lrr": 1e-3}))
    with pytest.raises(ValueError, match="unknown config key 'optim.base_lrr'"):
        load_config(path)
    good = write_config(tmp_path / "good.yaml", tiny_config_dict(data_dir))
    with pytest.raises(ValueError, match="unknown config section 'trian'"):
        load_config(good, ["trian.seed=1"])
    with pytest.raises(ValueError, match="'train.global_batch_size': expected int"):
        load_config(good, ["train.global_batch_size=big"])
    with pytest.raises(ValueError, match="train.mixed_precision"):
        load_config(good, ["train.mixed_precision=fp8"])
    assert load_config(good, ["optim.base_lr=2e-3", "train.ema=false"]).optim.base_lr == 2e-3
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_checkpoint_of_another_architecture(tmp_path, capsys, data_dir):
    config = tiny_config(data_dir, model={"kwargs": {"patch_size": 8, "embed_dim": 48, "depth": 2, "num_heads": 2}})
    weights = tmp_path / "wide.safetensors"
    export_weights(create_model(config), weights, export_metadata(config.model.name, 10, 32, config.model.kwargs))
    err = run_cli(tmp_path, capsys, tiny_config_dict(data_dir), "--eval-only", "--checkpoint", str(weights))
    assert "does not match the model: model.kwargs differ from the checkpoint's model_kwargs " \
           "(embed_dim: checkpoint 48, config 32)" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match=r"does not match model 'deit_tiny_patch16_224': .*\(embed_dim: checkpoint 48"):
        create_model(tiny_config(data_dir, model={"init_checkpoint": str(weights)}))
    bare = tmp_path / "bare.safetensors"  # no model_kwargs recorded: the tensors are compared, in one line
    export_weights(create_model(config), bare, {"format": "pt", "model_name": config.model.name})
    err = run_cli(tmp_path, capsys, tiny_config_dict(data_dir), "--eval-only", "--checkpoint", str(bare))
    assert "size mismatch for 31 tensors (first 'blocks.0.attn.proj.bias': checkpoint [48], model [32])" in err
    assert "records no model_kwargs" in err and len(err.strip().splitlines()) == 1


def test_truncated_export_is_refused(tmp_path, capsys, data_dir, one_epoch_run):
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes((one_epoch_run / "model.safetensors").read_bytes()[:300])
    err = run_cli(tmp_path, capsys, tiny_config_dict(data_dir), "--eval-only", "--checkpoint", str(truncated))
    assert "truncated.safetensors" in err and "corrupt" in err


def test_corrupt_training_checkpoint_is_never_loaded(tmp_path, data_dir, one_epoch_run):
    run = tmp_path / "run"
    shutil.copytree(one_epoch_run, run)
    weights = run / "checkpoints" / "step_00000007" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside a tensor: still a valid safetensors file
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt: 'model.safetensors'"):
        runner.train(tiny_config(data_dir, sched={"epochs": 2, "warmup_epochs": 0}), run, resume="auto")


def test_resume_with_another_batch_size_is_refused(tmp_path, data_dir, one_epoch_run):
    config = tiny_config(data_dir, sched={"epochs": 2, "warmup_epochs": 0}, train={"global_batch_size": 4})
    with pytest.raises(ValueError, match="global_batch_size was 8, now 4"):
        runner.train(config, tmp_path, resume=str(one_epoch_run))
