"""MQAR's training step, eager or replayed as one CUDA graph (``benchmarks.mqar --cuda-graph``, ``--compile``).

A step of the MQAR models is small (two layers of width 128, 16k-131k tokens) and launches a few hundred
kernels, many of them short. The graphed step captures the whole step (forward, backward and the AdamW
update) once and then replays it on static input buffers: the same computation with the host out of the
loop; with the loss through ``torch.compile`` the glue between the kernels fuses too. On an H200
(benchmarks/README.md, MQAR) the graph alone saves 0-40% of a step, graph and compile together about a third.

What the capture needs, and how it keeps the run's training unchanged:

* AdamW with ``capturable=True`` and its learning rate as a device tensor, so that the per-epoch
  cosine (:func:`set_lr`) reaches the captured update; the same update rule as the eager AdamW.
* Warm-up steps before the capture (they compile and autotune the Triton kernels and allocate the
  optimizer's state) run on the first batch; the parameters, the optimizer's state and the CUDA RNG are
  put back afterwards, so the run continues as if they had not happened.
* Autocast without its weight cache (the cached casts would be taken from outside the graph).
* Fixed shapes: one graph per batch shape (an epoch's short last batch, the segments of a mixture),
  captured when the shape first comes, all on the same parameters and optimizer state.

A capture that fails (an op that synchronises with the host, say) warns and leaves the run eager; a
``torch.compile``'d loss that fails warns and runs uncompiled.
"""
import warnings
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, graphed: bool) -> torch.optim.AdamW:
    """AdamW (torch's betas and eps); ``graphed``: capturable, its lr a 0-d tensor on the parameters' device."""
    if not graphed:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    device = next(model.parameters()).device
    return torch.optim.AdamW(model.parameters(), lr=torch.tensor(lr, dtype=torch.float32, device=device),
                             weight_decay=weight_decay, capturable=True, foreach=True)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate to ``lr``: in place where it is a tensor (a captured step reads it)."""
    for group in opt.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def restore_lr_tensors(opt: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: a capturable optimizer's lr back to a 0-d fp32 tensor on its parameters'
    device (a checkpoint stores a float, or a tensor that was loaded onto the CPU)."""
    if not opt.defaults.get("capturable"):
        for group in opt.param_groups:
            group["lr"] = float(group["lr"])
        return
    for group in opt.param_groups:
        device = group["params"][0].device
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


def autocast(device, cache: bool = True):
    """bf16 autocast on CUDA (``cache=False`` inside a CUDA graph capture), nothing on the CPU."""
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)
    return torch.autocast("cpu", enabled=False)


class EagerStep:
    """One training step: ``loss_fn(inputs, labels)`` (the model's query logits and cross-entropy, under
    autocast), backward, AdamW. ``step(inputs, labels)`` returns the loss (a device scalar)."""

    mode = "eager"
    failed = False  # a GraphedStep whose capture failed (it then runs eagerly)

    def __init__(self, loss_fn: Callable, opt: torch.optim.Optimizer, device: torch.device):
        self.loss_fn, self.opt, self.device = loss_fn, opt, torch.device(device)
        if hasattr(loss_fn, "_torchdynamo_orig_callable"):  # a torch.compile'd loss
            self.mode += "+compile"

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        try:
            return self.train_step(inputs, labels)
        except Exception as err:  # noqa: BLE001 - a compiled loss that fails runs uncompiled from then on
            if not self.mode.endswith("+compile"):
                raise
            warnings.warn(f"the torch.compile'd MQAR loss failed ({type(err).__name__}: {err}); running it "
                          "uncompiled", RuntimeWarning)
            self.loss_fn = self.loss_fn._torchdynamo_orig_callable
            self.mode = self.mode[:-len("+compile")]
            return self.train_step(inputs, labels)

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with autocast(self.device):
            loss = self.loss_fn(inputs, labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()


class GraphedStep(EagerStep):
    """:class:`EagerStep` captured as one CUDA graph per batch shape (the first batch of each shape is
    captured, every later one replays it; past ``max_graphs`` shapes the step runs eagerly). The returned
    loss lives in the graph's static output: read (or add) it before the next call of that shape."""

    mode = "cuda_graph"

    def __init__(self, loss_fn: Callable, opt: torch.optim.Optimizer, device: torch.device, warmup: int = 3,
                 max_graphs: int = 16):
        super().__init__(loss_fn, opt, device)
        if not opt.defaults.get("capturable"):
            raise ValueError("GraphedStep needs a capturable optimizer (make_optimizer(..., graphed=True))")
        self.warmup, self.max_graphs = warmup, max_graphs
        self.graphs: Dict[tuple, Tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        key = (tuple(inputs.shape), tuple(labels.shape))
        if key not in self.graphs and not self.failed and len(self.graphs) < self.max_graphs:
            self.capture(key, inputs, labels)
        if key not in self.graphs:
            return super().__call__(inputs, labels)
        graph, static_inputs, static_labels, static_loss = self.graphs[key]
        static_inputs.copy_(inputs)
        static_labels.copy_(labels)
        graph.replay()
        return static_loss

    def capture(self, key: tuple, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """Warm up on ``inputs`` (side stream), put the model, optimizer and RNG back, capture the step."""
        static_inputs, static_labels = inputs.clone(), labels.clone()
        saved = self.snapshot()
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    super().__call__(static_inputs, static_labels)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.restore(saved)
            self.opt.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                with autocast(self.device, cache=False):
                    loss = self.loss_fn(static_inputs, static_labels)
                loss.backward()
                self.opt.step()
            self.graphs[key] = (graph, static_inputs, static_labels, loss.detach())
        except Exception as err:  # noqa: BLE001 - any op that cannot be captured: stay eager
            warnings.warn(f"CUDA graph capture of the MQAR step failed ({type(err).__name__}: {err}); "
                          "training eagerly", RuntimeWarning)
            torch.cuda.synchronize(self.device)
            self.restore(saved)
            self.failed = True

    def snapshot(self) -> dict:
        """Copies of the parameters, the optimizer's state and the CUDA RNG state."""
        params = [p for group in self.opt.param_groups for p in group["params"]]
        return dict(params=[p.detach().clone() for p in params],
                    state={p: {k: v.clone() for k, v in self.opt.state[p].items()}
                           for p in params if p in self.opt.state},
                    rng=torch.cuda.get_rng_state(self.device))

    @torch.no_grad()
    def restore(self, saved: dict) -> None:
        """Back to ``saved`` in place (the graph keeps the tensors' addresses): state the warm-up created
        from nothing is zeroed, which is what AdamW's first step starts from."""
        params = [p for group in self.opt.param_groups for p in group["params"]]
        for p, copy in zip(params, saved["params"]):
            p.copy_(copy)
        for p in params:
            before = saved["state"].get(p, {})
            for key, value in self.opt.state.get(p, {}).items():
                if key in before:
                    value.copy_(before[key])
                else:
                    value.zero_()
        torch.cuda.set_rng_state(saved["rng"], self.device)


def make_step(loss_fn: Callable, opt: torch.optim.Optimizer, device, graphed: bool) -> EagerStep:
    """:class:`GraphedStep` where ``graphed`` (CUDA only), else :class:`EagerStep`."""
    device = torch.device(device)
    if graphed and device.type != "cuda":
        raise ValueError(f"--cuda-graph needs a CUDA device, got {device}")
    return GraphedStep(loss_fn, opt, device) if graphed else EagerStep(loss_fn, opt, device)


def cross_entropy_loss(query_logits: Callable, model, dropout: float, queries: int, compile: bool = False) -> Callable:
    """``loss_fn(inputs, labels)``: mean cross-entropy over the labelled query rows (-100 ignored) of
    ``query_logits(model, inputs, labels, dropout, queries)``; ``compile``: through ``torch.compile``
    (inductor, static shapes; the model's parameters and state_dict stay as they are)."""
    def loss_fn(inputs, labels):
        logits, targets = query_logits(model, inputs, labels, dropout, queries)
        return F.cross_entropy(logits, targets)
    return torch.compile(loss_fn, dynamic=False) if compile else loss_fn
