"""``train.compile``: the training step through ``torch.compile`` (backend ``aot_eager`` here: AOTAutograd's
forward and backward graphs, no code generation) trains exactly as eager, saves plain state dicts, and
resumes exactly. A one-block hdla_tiny of width 32 on the tiny dataset, one epoch of 7 steps."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from hdla_vision.training import checkpoint as ckpt
from hdla_vision.training import runner
from hdla_vision.training.config import config_from_dict
from hdla_vision.training.models import create_model
from hdla_vision.training.records import read_metrics
from tests.training_helpers import reset_accelerate_state, tiny_config, train_killed_after_step

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

MODEL = {"name": "hdla_tiny", "kwargs": {"patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2},
         "drop_path_rate": 0.1}


def _config(data_dir, compile_: bool, **train):
    return tiny_config(data_dir, model=MODEL, sched={"epochs": 1, "warmup_epochs": 0},
                       train={"compile": compile_, "compile_backend": "aot_eager", "checkpoint_every_steps": 2,
                              "keep_checkpoints": 10, "log_with": [], "consistency_checks": False, **train})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    """The same 7-step run eager and compiled: ``{False: eager dir, True: compiled dir, "graphs": {False: the
    graphs dynamo compiled during the eager run, True: during the compiled one}}``."""
    out = {"graphs": {}}
    for compile_ in (False, True):
        reset_accelerate_state()
        torch._dynamo.reset()
        counters.clear()
        out[compile_] = tmp_path_factory.mktemp(f"compile_{compile_}")
        runner.train(_config(data_dir, compile_), out[compile_])
        out["graphs"][compile_] = counters["stats"]["unique_graphs"]
    reset_accelerate_state()
    return out


def _assert_same_weights(got_dir, expected_dir, atol=1e-6):
    for name in ("model.safetensors", "model_ema.safetensors"):
        expected, got = load_file(str(expected_dir / name)), load_file(str(got_dir / name))
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=atol, msg=f"{name}:{key}")


def test_compiled_training_equals_eager(runs):
    """One graph (the training step's forward; evaluation runs eagerly), the same loss and accuracy, the
    same final and EMA weights."""
    assert runs["graphs"] == {False: 0, True: 1}
    eager, compiled = (read_metrics(runs[c] / "metrics.jsonl") for c in (False, True))
    assert len(eager) == len(compiled) == 1
    assert compiled[0]["train_loss"] == pytest.approx(eager[0]["train_loss"], abs=1e-6)
    assert compiled[0]["val_top1"] == pytest.approx(eager[0]["val_top1"])
    _assert_same_weights(runs[True], runs[False])


def test_compiled_run_saves_plain_state_dicts(runs, data_dir):
    """The checkpoint's model and EMA and the exports hold the model's own keys (no ``_orig_mod.``)."""
    keys = set(create_model(config_from_dict({"model": MODEL, "data": {"num_classes": 10, "img_size": 32}}))
               .state_dict())
    last = ckpt.list_checkpoints(runs[True] / "checkpoints")[-1]
    assert set(load_file(str(last / "model.safetensors"))) == keys
    assert set(torch.load(last / "custom_checkpoint_1.pkl", weights_only=True)) == keys  # the EMA
    for name in ("model.safetensors", "model_ema.safetensors", "best.safetensors"):
        assert set(load_file(str(runs[True] / name))) == keys, name


def test_compiled_run_resumes_exactly(runs, data_dir, tmp_path, monkeypatch):
    """Killed after the step-4 checkpoint and resumed (compiled again): the uninterrupted compiled run's weights."""
    train_killed_after_step(_config(data_dir, True), tmp_path, 4, monkeypatch)
    reset_accelerate_state()
    torch._dynamo.reset()  # compile again, as a new process would
    runner.train(_config(data_dir, True), tmp_path, resume="auto")
    _assert_same_weights(tmp_path, runs[True])
    resumed, reference = (read_metrics(d / "metrics.jsonl") for d in (tmp_path, runs[True]))
    assert resumed[-1]["train_loss"] == pytest.approx(reference[-1]["train_loss"], abs=1e-6)


def test_unknown_compile_backend_is_refused(data_dir, tmp_path):
    """Named in the error before anything is built; a name that is no identifier already by the schema."""
    with pytest.raises(ValueError, match="config key 'train.compile_backend' must be a torch.compile backend, "
                                         "got 'no_such_backend' \\(known: .*inductor"):
        runner.train(_config(data_dir, True, compile_backend="no_such_backend"), tmp_path)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="config key 'train.compile_backend' must be a torch.compile backend name"):
        _config(data_dir, True, compile_backend="in ductor")


def test_compile_mode_is_checked_against_backend(data_dir):
    """An unknown mode and a mode with a backend other than inductor are refused by the schema, each naming
    its key; CUDA graphs with gradient accumulation are accepted (runner.grads_in_place)."""
    with pytest.raises(ValueError, match="config key 'train.compile_mode' must be one of 'default', "
                                         "'reduce-overhead'.*got 'fast'"):
        _config(data_dir, True, compile_mode="fast")
    with pytest.raises(ValueError, match="config key 'train.compile_mode' must be 'default' unless "
                                         "train.compile_backend is 'inductor'"):
        _config(data_dir, True, compile_mode="reduce-overhead")  # _config's backend is aot_eager
    assert runner.grads_in_place(_config(data_dir, True, compile_backend="inductor", compile_mode="reduce-overhead",
                                         grad_accum_steps=2))
    assert not runner.grads_in_place(_config(data_dir, True, compile_backend="inductor",
                                             compile_mode="reduce-overhead"))
    assert not runner.grads_in_place(_config(data_dir, True, compile_backend="inductor",
                                             compile_mode="max-autotune-no-cudagraphs", grad_accum_steps=2))


def test_gradients_kept_in_place_accumulate_as_freed_ones(data_dir, tmp_path, monkeypatch):
    """``grads_in_place`` (what CUDA graphs with accumulation run: every .grad allocated up front, zeroed instead
    of freed) trains a 2-micro-step run to the same weights, bit for bit, as .grad freed after each update; and
    the .grad tensors are the ones allocated before the first step."""
    runs, allocate = {}, runner.allocate_grads
    for in_place in (False, True):
        reset_accelerate_state()
        monkeypatch.setattr(runner, "grads_in_place", lambda config, in_place=in_place: in_place)
        allocated = {}

        def allocate_and_keep(model, allocated=allocated):
            allocate(model)
            allocated.update(model=model, grads={name: p.grad for name, p in model.named_parameters()})
        monkeypatch.setattr(runner, "allocate_grads", allocate_and_keep)
        runs[in_place] = tmp_path / f"in_place_{in_place}"
        runner.train(_config(data_dir, False, grad_accum_steps=2), runs[in_place])
        assert bool(allocated) == in_place
        if in_place:
            assert all(p.grad is allocated["grads"][name] for name, p in allocated["model"].named_parameters())
    _assert_same_weights(runs[True], runs[False], atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("accumulation", [1, 2])
def test_cuda_graph_training_equals_eager(data_dir, tmp_path, accumulation):
    """``train.compile_mode=reduce-overhead`` on CUDA: the step replays CUDA graphs (none skipped) and trains
    as the eager run does (fp32, 7 steps; inductor's fused kernels round differently from eager's), also with
    the gradients of two micro-steps accumulated (``runner.grads_in_place``)."""
    dirs = {}
    for compile_ in (False, True):
        reset_accelerate_state()
        torch._dynamo.reset()
        counters.clear()
        dirs[compile_] = tmp_path / f"compile_{compile_}"
        runner.train(_config(data_dir, compile_, compile_backend="inductor", compile_mode="reduce-overhead",
                             grad_accum_steps=accumulation), dirs[compile_])
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == 1
    eager, graphed = (read_metrics(dirs[c] / "metrics.jsonl") for c in (False, True))
    assert graphed[0]["train_loss"] == pytest.approx(eager[0]["train_loss"], rel=1e-4)
    for name in ("model.safetensors", "model_ema.safetensors"):
        expected, got = load_file(str(dirs[False] / name)), load_file(str(dirs[True] / name))
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-3, atol=1e-4, msg=f"{name}:{key}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_run_resumes_exactly(data_dir, tmp_path, monkeypatch):
    """Killed after the step-4 checkpoint and resumed with ``reduce-overhead`` (compiled and recorded again):
    the uninterrupted CUDA-graph run's weights and loss."""
    graphs = dict(compile_backend="inductor", compile_mode="reduce-overhead")
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    runner.train(_config(data_dir, True, **graphs), reference)
    reset_accelerate_state()
    torch._dynamo.reset()
    train_killed_after_step(_config(data_dir, True, **graphs), resumed, 4, monkeypatch)
    reset_accelerate_state()
    torch._dynamo.reset()
    runner.train(_config(data_dir, True, **graphs), resumed, resume="auto")
    _assert_same_weights(resumed, reference)
    got, expected = (read_metrics(d / "metrics.jsonl") for d in (resumed, reference))
    assert got[-1]["train_loss"] == pytest.approx(expected[-1]["train_loss"], abs=1e-6)
