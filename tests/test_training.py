"""Training engine on CPU: train + eval, exact resume, fine-tuning, exports, records."""
from __future__ import annotations

import warnings

import hdla_vision  # noqa: F401  (registers the timm models)
import pytest
import timm
import torch
from safetensors.torch import load_file
from timm.optim import create_optimizer_v2

from hdla_vision.training import checkpoint as ckpt
from hdla_vision.training import runner
from hdla_vision.training.data import EpochOrder
from hdla_vision.training.models import create_model
from hdla_vision.training.records import read_metrics
from tests.training_helpers import reset_accelerate_state, subset_dataset, tiny_config, train_killed_after_step

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singletons, per test




@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data_dir):
    """One uninterrupted 2-epoch run (mid-epoch checkpoints every 2 steps) shared by several tests."""
    reset_accelerate_state()
    out = tmp_path_factory.mktemp("uninterrupted")
    config = tiny_config(data_dir, train={"checkpoint_every_steps": 2, "keep_checkpoints": 10})
    row = runner.train(config, out)
    return out, row


def test_train_and_eval_writes_records_and_exports(trained_run):
    out, row = trained_run
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1]
    for key in ("train_loss", "val_top1", "val_top5", "val_ema_top1", "val_ema_top5", "lr", "best_top1"):
        assert isinstance(rows[-1][key], float)
    assert 0.0 <= rows[-1]["val_top1"] <= rows[-1]["val_top5"] <= 100.0
    assert rows[0]["images_per_process"] == [56]  # 60 images, batches of 8: 7 full batches
    assert rows[0]["distinct_samples"] == 56
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert row["param_checksum_per_process"] and len(row["param_checksum_per_process"]) == 1
    steps = [p.name for p in ckpt.list_checkpoints(out / "checkpoints")]
    assert "step_00000007" in steps and "step_00000014" in steps and "step_00000004" in steps


def test_export_loads_through_timm_pretrained_cfg_overlay(trained_run, data_dir):
    out, _ = trained_run
    config = tiny_config(data_dir)
    kwargs = dict(config.model.kwargs, img_size=32)
    model = timm.create_model(config.model.name, pretrained=True, num_classes=10,
                              pretrained_cfg_overlay=dict(file=str(out / "model.safetensors"), num_classes=10), **kwargs)
    saved = load_file(str(out / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)


def test_eval_only_reproduces_the_recorded_accuracy(trained_run, data_dir):
    out, row = trained_run
    config = tiny_config(data_dir)
    metrics = runner.evaluate_checkpoint(config, str(out / "model.safetensors"))
    assert metrics["top1"] == pytest.approx(row["val_top1"])
    assert metrics["top5"] == pytest.approx(row["val_top5"])


def test_killed_and_resumed_run_equals_uninterrupted_run(trained_run, data_dir, tmp_path, monkeypatch):
    """Stop right after the step-4 checkpoint (mid epoch 0), resume with 'auto': same final weights.

    The resumed process also loads data with a worker process, which must not change anything.
    """
    reference_dir, _ = trained_run
    config = tiny_config(data_dir, train={"checkpoint_every_steps": 2, "keep_checkpoints": 10})
    train_killed_after_step(config, tmp_path, 4, monkeypatch)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")][-1] == "step_00000004"

    reset_accelerate_state()
    resumed_config = tiny_config(data_dir, data={"num_workers": 1},
                                 train={"checkpoint_every_steps": 2, "keep_checkpoints": 10})
    runner.train(resumed_config, tmp_path, resume="auto")
    for name in ("model.safetensors", "model_ema.safetensors"):
        expected, got = load_file(str(reference_dir / name)), load_file(str(tmp_path / name))
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6, msg=f"{name}:{key}")
    ref_rows, rows = read_metrics(reference_dir / "metrics.jsonl"), read_metrics(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1]
    assert rows[0]["train_loss"] == pytest.approx(ref_rows[0]["train_loss"], abs=1e-5)
    assert rows[1]["val_top1"] == pytest.approx(ref_rows[1]["val_top1"])


def test_finetune_with_new_classes_and_image_size(trained_run, data_dir, tmp_path):
    """Start from the 10-class 32-pixel export: 5 classes at 48 pixels, layer-wise lr decay."""
    source, _ = trained_run
    five = subset_dataset(data_dir, tmp_path / "five", classes=5)
    config = tiny_config(five, model={"init_checkpoint": str(source / "model.safetensors"), "drop_path_rate": 0.0},
                         data={"num_classes": 5, "img_size": 48, "mixup": 0.0, "cutmix": 0.0},
                         optim={"layer_decay": 0.75}, sched={"epochs": 1, "warmup_epochs": 0},
                         train={"ema": False})
    model = create_model(config)
    saved = load_file(str(source / "model.safetensors"))
    state = model.state_dict()
    assert state["head.weight"].shape == (5, 32)
    assert state["pos_embed"].shape[1] == 1 + (48 // 8) ** 2 != saved["pos_embed"].shape[1]
    torch.testing.assert_close(state["blocks.1.attn.qkv.weight"], saved["blocks.1.attn.qkv.weight"])
    torch.testing.assert_close(state["patch_embed.proj.weight"], saved["patch_embed.proj.weight"])

    reset_accelerate_state()
    row = runner.train(config, tmp_path / "run")
    assert "val_top1" in row
    groups = create_optimizer_v2(create_model(config), "adamw", lr=1e-3, layer_decay=0.75).param_groups
    assert len({g["lr_scale"] for g in groups}) > 2  # one lr scale per depth


def test_linear_probe_trains_only_the_classifier(trained_run, data_dir, tmp_path):
    source, _ = trained_run
    config = tiny_config(data_dir, model={"init_checkpoint": str(source), "linear_probe": True,
                                          "drop_path_rate": 0.0},
                         sched={"epochs": 1, "warmup_epochs": 0}, train={"ema": False})
    runner.train(config, tmp_path)
    before, after = load_file(str(source / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == ["head.bias", "head.weight"]


def test_epoch_order_is_identical_per_epoch_and_changes_between_epochs():
    order = EpochOrder(50, batch_per_process=4, num_processes=2, seed=3)
    order.use_epoch(1)
    first, again = list(order), list(order)
    order.use_epoch(2)
    assert first == again and first != list(order)
    assert len(first) == 48 and len({i for i, _ in first}) == 48


def test_shipped_configs_load_and_scale_the_learning_rate():
    from hdla_vision.training.config import load_config
    from tests.training_helpers import REPO

    names = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert {"hdla_tiny", "hdla_tiny_deit", "hdla_small", "hdla_base", "deit_tiny", "finetune", "quickstart"} <= set(names)
    for name in names:
        load_config(REPO / "configs" / f"{name}.yaml")
    paper = load_config(REPO / "configs" / "hdla_tiny.yaml")
    assert runner.peak_learning_rate(paper) == pytest.approx(2.4e-3)
    assert paper.optim.betas == [0.9, 0.98] and paper.sched.warmup_epochs == 20 and paper.data.mixup == 0.0


def test_finetune_config_takes_the_model_from_the_export(trained_run, data_dir):
    """configs/finetune.yaml names no model: the export's metadata supplies name and kwargs."""
    from hdla_vision.training.config import load_config
    from tests.training_helpers import REPO, TINY_MODEL

    source = trained_run[0] / "model.safetensors"

    def finetune(*overrides):
        return load_config(REPO / "configs" / "finetune.yaml", [f"model.init_checkpoint={source}", "data.num_classes=5",
                                                                 "data.img_size=48", *overrides])

    config = finetune("model.kwargs={drop_rate: 0.2}")
    model = create_model(config)
    assert config.model.name == TINY_MODEL["name"]
    assert config.model.kwargs == {**TINY_MODEL["kwargs"], "drop_rate": 0.2}  # explicit values merged over saved
    assert model.state_dict()["head.weight"].shape == (5, 32) and model.head_drop.p == 0.2
    with pytest.raises(ValueError) as err:
        create_model(finetune("model.kwargs={embed_dim: 48, depth: 3}"))
    assert str(err.value).endswith("does not match model 'deit_tiny_patch16_224': model.kwargs differ from the "
                                   "checkpoint's model_kwargs (depth: checkpoint 2, config 3; embed_dim: checkpoint 32, "
                                   "config 48)")
    with pytest.raises(ValueError, match="holds a 'deit_tiny_patch16_224' model, the config asks for 'hdla_tiny'"):
        create_model(finetune("model.name=hdla_tiny"))


def test_global_batch_is_capped_by_the_training_set():
    from hdla_vision.training.config import config_from_dict
    from hdla_vision.training.data import cap_global_batch

    def capped(samples, processes=1, **sections):
        config = config_from_dict({"train": {"global_batch_size": 512}, **sections})
        cap_global_batch(config, samples, processes)
        return config.train.global_batch_size

    with pytest.warns(UserWarning, match=r"global_batch_size 512 is larger than the training set \(57 images"):
        assert capped(57, data={"mixup": 0.8}) == 56  # mixup pairs images: an even batch
    with pytest.warns(UserWarning):
        assert capped(57, processes=2, train={"global_batch_size": 512, "grad_accum_steps": 3}) == 54
    with pytest.warns(UserWarning, match=r"\(255 images per epoch\): using 255"):
        assert capped(300, processes=3, data={"repeated_aug": True}) == 255  # RepeatAugSampler: 256 // 3 per rank
    with pytest.warns(UserWarning, match="using 1,"):
        assert capped(1) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert capped(512) == 512  # fits: no warning
        assert capped(1, processes=2) == 512  # cannot fill one batch: EpochOrder's error says so


def test_checkpoint_holds_the_registered_states(trained_run):
    """Trainer state and EMA go through ``accelerator.register_for_checkpointing``, in the manifest."""
    out, _ = trained_run
    last = ckpt.list_checkpoints(out / "checkpoints")[-1]
    manifest = ckpt.verify_checkpoint(last, {})
    assert manifest["registered"] == ["trainer_state", "ema"]
    assert {"custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "model.safetensors"} <= set(manifest["files"])
    state = ckpt.TrainerState()
    state.load_state_dict(torch.load(last / "custom_checkpoint_0.pkl", weights_only=True))
    assert (state.epoch, state.batches_done, state.global_step) == (2, 0, 14)
    ema = torch.load(last / "custom_checkpoint_1.pkl", weights_only=True)
    torch.testing.assert_close(ema["head.weight"], load_file(str(out / "model_ema.safetensors"))["head.weight"])


def test_defaults_skip_the_consistency_checks_and_trackers(trained_run, data_dir, tmp_path):
    """``train.consistency_checks`` off (the default): no index records nor checksums; ``log_with: []``:
    no TensorBoard, still the JSON lines and the curves. Resuming it with EMA on is refused."""
    config = tiny_config(data_dir, sched={"epochs": 1, "warmup_epochs": 0},
                         train={"consistency_checks": False, "log_with": [], "ema": False})
    row = runner.train(config, tmp_path)
    assert "param_checksum_per_process" not in row and "distinct_samples" not in row
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["images_per_process"] == [56]
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "curves.png").is_file()
    reset_accelerate_state()
    with_ema = tiny_config(data_dir, sched={"epochs": 2, "warmup_epochs": 0},
                           train={"consistency_checks": False, "log_with": [], "ema": True})
    with pytest.raises(ValueError, match="has no EMA weights but this run uses model EMA"):
        runner.train(with_ema, tmp_path, resume="auto")
