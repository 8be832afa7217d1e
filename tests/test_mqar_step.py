"""MQAR's training step (hdla_vision/lm/mqar_step.py): the eager step, the learning-rate plumbing a CUDA graph
needs, the flag's errors on the CPU, and (GPU) the graphed step against the eager one."""
import pytest
import torch

from hdla_vision.lm import mqar_runner
from hdla_vision.lm.mqar import multiquery_ar
from hdla_vision.lm.mqar_step import (EagerStep, GraphedStep, cross_entropy_loss, make_optimizer, make_step,
                                      restore_lr_tensors, set_lr)

TINY = ["--tiny", "--cpu-threads", "1", "--state-dir", "unused"]


def tiny_model(device: str, mixer: str = "hdla"):
    args = mqar_runner.parse_args(TINY + ["--device", device, "--mixers", mixer])
    proto = mqar_runner.planned_protocols(args)[0]
    config = mqar_runner.model_config(args, mixer, proto["model_config"]["intermediate_size"])
    return mqar_runner.build_model(config, 0, device), proto


def tiny_batches(proto: dict, sizes, device: str):
    return [tuple(t.to(device) for t in multiquery_ar(proto["vocab_size"], n, proto["length"], proto["num_kv_pairs"],
                                                      seed=i, random_non_queries=False))
            for i, n in enumerate(sizes)]


def test_set_lr_changes_a_tensor_lr_in_place_and_a_float_lr_by_value():
    params = [torch.nn.Parameter(torch.ones(3))]
    tensor_lr = torch.tensor(0.1)
    opt = torch.optim.AdamW(params, lr=tensor_lr, foreach=False)
    set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] is tensor_lr and float(tensor_lr) == 0.25
    opt = make_optimizer(torch.nn.Linear(2, 2), 1e-3, 0.1, graphed=False)
    set_lr(opt, 0.5)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["weight_decay"] == 0.1


def test_restore_lr_tensors_makes_a_loaded_lr_a_float_for_the_eager_optimizer():
    opt = make_optimizer(torch.nn.Linear(2, 2), 1e-3, 0.1, graphed=False)
    opt.param_groups[0]["lr"] = torch.tensor(0.03)  # as a checkpoint of a graphed run loads it
    restore_lr_tensors(opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.03) and isinstance(opt.param_groups[0]["lr"], float)


def test_eager_step_trains_and_returns_the_loss_before_the_update():
    model, proto = tiny_model("cpu")
    (x, y), = tiny_batches(proto, [8], "cpu")
    loss_fn = cross_entropy_loss(mqar_runner.query_logits, model, 0.0, proto["num_kv_pairs"])
    with torch.no_grad():
        expected = loss_fn(x, y)
    before = [p.detach().clone() for p in model.parameters()]
    step = make_step(loss_fn, make_optimizer(model, 1e-2, 0.1, graphed=False), "cpu", graphed=False)
    assert isinstance(step, EagerStep) and step.mode == "eager"
    loss = step(x, y)
    assert torch.equal(loss, expected) and not loss.requires_grad
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_graphed_step_needs_cuda_and_a_capturable_optimizer():
    model, proto = tiny_model("cpu")
    loss_fn = cross_entropy_loss(mqar_runner.query_logits, model, 0.0, proto["num_kv_pairs"])
    opt = make_optimizer(model, 1e-2, 0.1, graphed=False)
    with pytest.raises(ValueError, match="cuda-graph"):
        make_step(loss_fn, opt, "cpu", graphed=True)
    with pytest.raises(ValueError, match="capturable"):
        GraphedStep(loss_fn, opt, torch.device("cpu"))
    with pytest.raises(ValueError, match="--cuda-graph"):
        mqar_runner.parse_args(TINY + ["--device", "cpu", "--cuda-graph", "on"])
    assert not mqar_runner.use_cuda_graph(mqar_runner.parse_args(TINY + ["--device", "cpu"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mixer,compile", [("hdla", False), ("gated_deltanet", False), ("hdla", True)])
def test_graphed_step_matches_the_eager_step(mixer, compile):
    """Same initialisation and batches (one short: a second graph, captured mid-run): the graphed run's losses
    and final weights match the eager run's to bf16 rounding, and the first loss is the eager one exactly (the
    warm-up steps before a capture leave the model, the optimizer and the RNG as they were). ``compile``: the
    graphed run's loss through torch.compile (its first loss then matches to rounding only)."""
    runs = []
    for graphed in (False, True):
        model, proto = tiny_model("cuda", mixer)
        data = tiny_batches(proto, [16, 16, 16, 5, 16, 16], "cuda")
        opt = make_optimizer(model, 3e-3, 0.1, graphed)
        step = make_step(cross_entropy_loss(mqar_runner.query_logits, model, 0.0, proto["num_kv_pairs"],
                                            compile and graphed), opt, "cuda", graphed)
        losses = []
        for i, (x, y) in enumerate(data):
            set_lr(opt, 3e-3 / (i + 1))
            losses.append(float(step(x, y)))
        assert not step.failed and (not graphed or len(step.graphs) == 2)
        runs.append((losses, torch.cat([p.detach().flatten().float() for p in model.parameters()])))
    (eager_losses, eager_w), (graph_losses, graph_w) = runs
    assert graph_losses[0] == eager_losses[0] or (compile and graph_losses[0] == pytest.approx(eager_losses[0], rel=1e-3))
    assert graph_losses == pytest.approx(eager_losses, rel=2e-2)
    assert float((graph_w - eager_w).norm() / eager_w.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True])
def test_graph_replays_draw_new_dropout_masks(compile):
    """With embedding dropout and lr 0 (the weights stay), replays of one batch give different losses: each replay
    draws fresh dropout masks (graph-safe RNG), compiled or not."""
    model, proto = tiny_model("cuda")
    (x, y), = tiny_batches(proto, [16], "cuda")
    opt = make_optimizer(model, 0.0, 0.0, graphed=True)
    step = make_step(cross_entropy_loss(mqar_runner.query_logits, model, 0.5, proto["num_kv_pairs"], compile), opt,
                     "cuda", graphed=True)
    losses = [float(step(x, y)) for _ in range(4)]
    assert not step.failed and step.mode == "cuda_graph" + ("+compile" if compile else "")
    assert len(set(losses)) == 4, losses


def test_a_failing_compiled_loss_falls_back_to_the_uncompiled_one():
    model, proto = tiny_model("cpu")
    (x, y), = tiny_batches(proto, [8], "cpu")
    plain = cross_entropy_loss(mqar_runner.query_logits, model, 0.0, proto["num_kv_pairs"])

    def broken(inputs, labels):
        raise RuntimeError("inductor failed")
    broken._torchdynamo_orig_callable = plain  # as torch.compile marks its wrappers
    step = make_step(broken, make_optimizer(model, 1e-2, 0.1, graphed=False), "cpu", graphed=False)
    assert step.mode == "eager+compile"
    with pytest.warns(RuntimeWarning, match="uncompiled"):
        loss = step(x, y)
    assert step.mode == "eager" and step.loss_fn is plain and torch.isfinite(loss)
