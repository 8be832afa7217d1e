"""What autograd keeps for the backward: bytes per token of one block (or the whole model), by tensor.

The activations a training step holds between its forward and its backward are the tensors autograd saves
(``torch.autograd.graph.saved_tensors_hooks`` sees each one as it is packed, the inputs that the
non-reentrant ``torch.utils.checkpoint`` keeps for its recomputation included). This tool runs one forward of a vision backbone's
block (``--whole``: the whole model on images) and counts each saved storage once, with

* ``bytes``, ``shape``, ``dtype`` (the storage's size; the shape of its first saved view);
* ``producer``: the aten or custom op that allocated the storage (views leave it to their base), and the
  module that ran it;
* ``savers``: the torch functions that packed it (``linear``, ``silu``, ``hdla_vision.chunk_hdla``,
  ``checkpoint``: the inputs ``torch.utils.checkpoint`` keeps for its recomputation ...), as many times as
  it was packed (``?``: by no torch function, e.g. an ``autograd.Function`` of its own).

Modes (``--mode``):

* ``fake-cuda`` (default): a ``FakeTensorMode`` on CUDA tensors, no GPU needed. CUDA autocast is switched
  on below ``torch.autocast`` (which refuses without a device), so every op takes the dtype the GPU run gives
  it; the chunk ops run their fake implementations, whose ``x`` output (what the Triton backward saves: the
  chunk16 reads ``X [B, T, H, r_ab, V]`` fp32, or the chunk64 states ``h [B, H, NT, K, V]``) has the GPU's
  shape and dtype for the family ``HDLA_VISION_KERNELS`` names; timm's attention takes the flash kernel, as
  the GPU does for bf16 and head dim 64 (a fake CPU-only run would fall back to the math path, which saves
  the attention matrix). Any resolution and batch, in seconds.
* ``cpu``: real CPU tensors under CPU bf16 autocast (``--dtype fp32``: none); with ``TRITON_INTERPRET=1``
  the chunk ops run the Triton kernels in the interpreter (small sizes), else the PyTorch chunk form, which
  saves no ``x``. Cross-checks the fake accounting on real tensors.

Parameters are not counted, nor tensors computed from parameters alone (autocast's bf16 copies of the
weights, counted apart as ``weight_bytes``: they grow with the parameters, not with the tokens); the block's
input is. :meth:`Account.predicted_peak_bytes` turns whole-model counts into a peak-memory estimate: saved
bytes, the weight copies, and 16 bytes per parameter (fp32 weight, gradient and AdamW's two moments); its
ratio to deit_tiny's is ``predicted_peak_ratio``. It leaves out the backward's transients, of which the
largest is the workspace of one scan's Triton backward: ``--op-scratch`` (:func:`hdla_backward_scratch`)
measures it per token, on CPU tensors with the kernels interpreted.

    python -m tools.saved_memory                                      # hdla/gla/gdn/kda/deit tiny blocks, 224 px
    python -m tools.saved_memory --models hdla_tiny --resolutions 1024 --batch 16 --top 20
    python -m tools.saved_memory --whole --resolutions 224 1024       # the whole models, and predicted ratios
    python -m tools.saved_memory --kernels chunk64                    # the chunk64 family's saved states
    TRITON_INTERPRET=1 python -m tools.saved_memory --op-scratch --kernels chunk64   # one HDLA backward's transient
    TRITON_INTERPRET=1 python -m tools.saved_memory --mode cpu --kernels chunk64 --resolutions 64 --batch 2
"""
import argparse
import contextlib
import json
import os
import sys
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence
from unittest import mock

import timm
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import hdla_vision  # noqa: F401  registers the timm models

BASELINE = "deit_tiny_patch16_224"
MODELS = ("hdla_tiny", "gla_tiny", "gdn_tiny", "kda_tiny", BASELINE)
BATCH_SIZES = {224: 256, 512: 64, 1024: 16, 2048: 2}  # benchmarks.models' batches
MODES = ("fake-cuda", "cpu")
BYTES_PER_PARAMETER = 16  # fp32 weight + gradient + AdamW's exp_avg and exp_avg_sq


@dataclass
class SavedStorage:
    """One storage autograd keeps for the backward."""

    nbytes: int
    shape: tuple
    dtype: str
    producer: str
    module: str
    savers: List[str] = field(default_factory=list)


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (fake tensors have no data pointer; the storage object's C pointer
    is unique while the storage lives)."""
    return t.untyped_storage()._cdata


def op_name(func) -> str:
    """``aten.silu.default`` -> ``silu``; a custom op keeps its namespace: ``hdla_vision.chunk_hdla``."""
    name = getattr(func, "__name__", str(func))
    if isinstance(func, torch._ops.OpOverload):
        namespace, base = func.namespace, func._schema.name.split("::")[-1]
        return base if namespace == "aten" else f"{namespace}.{base}"
    return name


class ModuleStack:
    """The qualified name of the module running now, from forward pre/post hooks on every submodule."""

    def __init__(self, model: torch.nn.Module):
        self.names = {module: name for name, module in model.named_modules()}
        self.stack: List[str] = []
        self.handles = []

    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def enter(self, name: str) -> None:
        self.stack.append(name)

    def leave(self) -> None:
        self.stack.pop()

    def __enter__(self):
        for module, name in self.names.items():
            self.handles.append(module.register_forward_pre_hook(lambda m, args, n=name: self.enter(n)))
            self.handles.append(module.register_forward_hook(lambda m, args, out: self.leave()))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


class ProducerLog(TorchDispatchMode):
    """Below autograd: which op (and module) allocated each output storage. Outputs that share a storage
    with an input (views, in-place ops) keep their base's producer."""

    def __init__(self, modules: ModuleStack, parameters: set):
        super().__init__()
        self.modules = modules
        self.producers: Dict[int, tuple] = {}
        self.parameters = parameters
        self.weight_copies: set = set()  # storages made from a parameter alone (autocast's bf16 weights)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        from_weights = bool(inputs) and inputs <= self.parameters | self.weight_copies
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and storage_key(t) not in inputs:
                key = storage_key(t)  # a freed storage's key may come back: overwrite what it said
                self.producers[key] = (op_name(func), self.modules.current())
                (self.weight_copies.add if from_weights else self.weight_copies.discard)(key)
        return out


class SaverLog(TorchFunctionMode):
    """Above autograd: the torch function being called (``linear``, ``silu``, a custom op ...), the
    one whose autograd node packs the tensors saved while it runs (nested calls are its own)."""

    def __init__(self):
        super().__init__()
        self.current: Optional[str] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        outer, self.current = self.current, op_name(func)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer


class Ledger:
    """Counts what autograd saves while it is entered: :attr:`saved` maps storage keys to
    :class:`SavedStorage`. Parameters, and tensors computed from parameters alone (autocast's bf16
    copies of the weights: per parameter, not per token), are left out; :attr:`weight_bytes` counts
    the saved ones of the latter."""

    def __init__(self, model: torch.nn.Module):
        self.modules = ModuleStack(model)
        self.parameters = {storage_key(p) for p in model.parameters()}
        self.producers = ProducerLog(self.modules, self.parameters)
        self.savers = SaverLog()
        self.saved: Dict[int, SavedStorage] = {}
        self.weights_saved: Dict[int, int] = {}
        self.stack = contextlib.ExitStack()

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights_saved.values())

    def record(self, t: torch.Tensor, saver: str) -> None:
        key = storage_key(t)
        if key in self.parameters or t.numel() == 0:
            return
        if key in self.producers.weight_copies:
            self.weights_saved[key] = t.untyped_storage().nbytes()
            return
        if key not in self.saved:
            producer, module = self.producers.producers.get(key, ("(input)", ""))
            self.saved[key] = SavedStorage(t.untyped_storage().nbytes(), tuple(t.shape), str(t.dtype).removeprefix(
                "torch."), producer, module)
        self.saved[key].savers.append(saver)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.record(t, self.savers.current or "?")
        return t

    def checkpoint(self, original):
        """``torch.utils.checkpoint.checkpoint`` whose saves are named ``checkpoint``: the non-reentrant one
        packs its inputs for the recomputation through the hooks (the region's own saves go to its hooks)."""
        def named(function, *args, **kwargs):
            outer, self.savers.current = self.savers.current, "checkpoint"
            try:
                return original(function, *args, **kwargs)
            finally:
                self.savers.current = outer
        return named

    def __enter__(self):
        self.stack.enter_context(self.modules)
        self.stack.enter_context(self.producers)
        self.stack.enter_context(self.savers)
        self.stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t))
        self.stack.enter_context(mock.patch.object(torch.utils.checkpoint, "checkpoint",
                                                   self.checkpoint(torch.utils.checkpoint.checkpoint)))
        return self

    def __exit__(self, *exc):
        self.stack.close()

    def total(self) -> int:
        return sum(s.nbytes for s in self.saved.values())


@contextlib.contextmanager
def device_autocast(device: str, dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Autocast on ``device`` as ``torch.autocast`` sets it, without its check that the device exists
    (fake CUDA tensors on a host without a GPU). ``dtype`` None: no autocast."""
    if dtype is None:
        yield
        return
    enabled, previous = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, previous)


def flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as the flash kernel the GPU picks for timm's attention (bf16, head dim 64, no mask)."""
    if attn_mask is not None or enable_gqa:
        raise ValueError("attn_mask / enable_gqa: the accounting models the flash kernel only")
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


@dataclass
class Setting:
    """Where and how the forward runs: ``mode`` (``MODES``) and the autocast dtype (None: fp32)."""

    mode: str = "fake-cuda"
    autocast: Optional[torch.dtype] = torch.bfloat16

    @property
    def device(self) -> str:
        return "cuda" if self.mode == "fake-cuda" else "cpu"


@contextlib.contextmanager
def placed(model: torch.nn.Module, setting: Setting) -> Iterator[torch.nn.Module]:
    """``model`` on the setting's device, inside its tensor mode (fake CUDA: a fake copy; flash attention)."""
    if setting.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {setting.mode!r}")
    if setting.mode == "cpu":
        yield model
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), mock.patch.object(F, "scaled_dot_product_attention",
                                                                       flash_attention):
        yield model.to("cuda")


def build(name: str, img_size: int, depth: Optional[int] = None) -> torch.nn.Module:
    kwargs = {} if depth is None else dict(depth=depth)
    return timm.create_model(name, img_size=img_size, dynamic_img_size=True, num_classes=1000, **kwargs).train()


def block_tokens(model: torch.nn.Module, img_size: int) -> int:
    """Tokens a block sees at ``img_size``: patches plus prefix (class) tokens."""
    grid = model.patch_embed.dynamic_feat_size((img_size, img_size))
    return grid[0] * grid[1] + model.num_prefix_tokens


def saved_by_block(name: str, img_size: int, batch: int, setting: Setting = Setting(),
                   block: int = 0) -> "Account":
    """What one block keeps for its backward: its input ``[batch, tokens, C]`` (fp32, requiring grad, as
    the residual stream arrives) through ``model.blocks[block]``."""
    model = build(name, img_size, depth=block + 1)
    tokens = block_tokens(model, img_size)
    with placed(model, setting) as model:
        x = torch.randn(batch, tokens, model.embed_dim, device=setting.device, requires_grad=True)
        with Ledger(model) as ledger, device_autocast(setting.device, setting.autocast):
            model.blocks[block](x)
    return Account(name, img_size, batch, tokens, setting.mode, str(setting.autocast), "block", ledger.saved,
                   sum(p.numel() for p in model.blocks[block].parameters()), ledger.weight_bytes)


def saved_by_model(name: str, img_size: int, batch: int, setting: Setting = Setting()) -> "Account":
    """What the whole model keeps for its backward from images ``[batch, 3, img_size, img_size]``."""
    model = build(name, img_size)
    tokens = block_tokens(model, img_size)
    with placed(model, setting) as model:
        images = torch.randn(batch, 3, img_size, img_size, device=setting.device)
        with Ledger(model) as ledger, device_autocast(setting.device, setting.autocast):
            model(images)
    return Account(name, img_size, batch, tokens, setting.mode, str(setting.autocast), "model", ledger.saved,
                   sum(p.numel() for p in model.parameters()), ledger.weight_bytes)


class LiveStorages(TorchDispatchMode):
    """The storages the ops create while it is entered and that are still alive (weak references): the
    peak of their bytes (:attr:`peak`)."""

    def __init__(self):
        super().__init__()
        self.live: Dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and storage_key(t) not in inputs and storage_key(t) not in self.live:
                storage = t.untyped_storage()
                self.live[storage_key(t)] = storage.nbytes()
                weakref.finalize(storage, self.live.pop, storage_key(t), None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def hdla_backward_scratch(family: str, batch: int, tokens: int, heads: int = 3, dim: int = 64) -> int:
    """Peak bytes the Triton backward of one HDLA scan allocates (workspaces and gradients) for bf16 inputs
    ``[batch, tokens, heads, dim]``: the transient on top of what is saved, once per op call. Runs the
    family's forward and backward functions (not the custom op, which a dispatch mode sees as one call)
    on CPU tensors: needs ``TRITON_INTERPRET=1``."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("hdla_backward_scratch runs the kernels on the CPU: set TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(0)
    shape = (batch, tokens, heads, dim)
    q, v = (torch.randn(shape, generator=gen).bfloat16() for _ in range(2))
    k = F.normalize(torch.randn(shape, generator=gen), dim=-1).bfloat16()
    beta, g = 2 * torch.rand(shape[:3], generator=gen), -torch.rand(shape, generator=gen)
    do = torch.randn(shape, generator=gen).bfloat16()
    live = LiveStorages()
    if family == "chunk64":
        from hdla_vision.kernels.generalized import bwd, fwd

        _, _, h = fwd.generalized_forward(q, k, v, None, None, g, 1.0, None, False, hdla_beta=beta)
        with live:
            bwd.generalized_backward(do, None, q, k, v, None, None, g, 1.0, None, h, False, hdla_beta=beta)
    elif family == "chunk16":
        from hdla_vision.kernels.hdla import chunk

        _, final, x = chunk.triton_hdla_forward(q, k, v, beta, g, 1.0, None, False)
        with live:
            chunk.triton_hdla_backward(do, None, q, k, v, beta, g, None, x, final, 1.0, False)
    else:
        raise ValueError(f"family must be 'chunk16' or 'chunk64', got {family!r}")
    return live.peak


@dataclass
class Account:
    """The saved storages of one forward and their totals."""

    model: str
    img_size: int
    batch: int
    tokens: int
    mode: str
    autocast: str
    scope: str  # "block" or "model"
    saved: Dict[int, SavedStorage]
    parameters: int
    weight_bytes: int  # saved tensors computed from parameters alone (autocast's weight copies)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved.values())

    @property
    def bytes_per_token(self) -> float:
        return self.total_bytes / (self.batch * self.tokens)

    @property
    def bytes_per_image(self) -> float:
        return self.total_bytes / self.batch

    def predicted_peak_bytes(self) -> int:
        """Whole model: saved activations and weight copies, plus weights, gradients and AdamW state."""
        return self.total_bytes + self.weight_bytes + BYTES_PER_PARAMETER * self.parameters

    def rows(self) -> List[SavedStorage]:
        return sorted(self.saved.values(), key=lambda s: (-s.nbytes, s.module, s.producer))

    def by_group(self) -> Dict[str, int]:
        """Bytes by (module, producer, dtype): where the memory goes."""
        groups: Dict[str, int] = defaultdict(int)
        for s in self.saved.values():
            groups[f"{s.module or '-'} | {s.producer} | {s.dtype}"] += s.nbytes
        return dict(sorted(groups.items(), key=lambda kv: -kv[1]))

    def summary(self) -> Dict:
        return dict(model=self.model, img_size=self.img_size, batch=self.batch, tokens=self.tokens, mode=self.mode,
                    autocast=self.autocast, scope=self.scope, kernels=os.environ.get("HDLA_VISION_KERNELS") or
                    "chunk16", saved_mib=round(self.total_bytes / 2**20, 1), weight_copies_mib=round(self.weight_bytes / 2**20, 2),
                    bytes_per_token=round(self.bytes_per_token, 1), bytes_per_image=round(self.bytes_per_image))


def ratio_to_baseline(accounts: Sequence[Account]) -> List[Dict]:
    """Each account against deit_tiny's at the same resolution and batch: saved bytes per image (blocks),
    and the predicted peak (whole models)."""
    base = {(a.img_size, a.batch, a.scope): a for a in accounts if a.model == BASELINE}
    out = []
    for a in accounts:
        b = base.get((a.img_size, a.batch, a.scope))
        if b is None or a.model == BASELINE:
            continue
        row = dict(model=a.model, img_size=a.img_size, scope=a.scope,
                   saved_ratio=round(a.bytes_per_image / b.bytes_per_image, 3))
        if a.scope == "model":
            row["predicted_peak_ratio"] = round(a.predicted_peak_bytes() / b.predicted_peak_bytes(), 3)
            row["predicted_peak_mib"] = round(a.predicted_peak_bytes() / 2**20)
        out.append(row)
    return out


def print_account(a: Account, top: int) -> None:
    s = a.summary()
    print(f"\n{a.model} {a.scope} {a.img_size} px, batch {a.batch}, {a.tokens} tokens ({a.mode}, autocast "
          f"{a.autocast}, {s['kernels']}): {s['saved_mib']} MiB, {s['bytes_per_token']} B/token")
    print(f"  {'B/token':>9}  {'dtype':<9}{'shape':<26}{'producer':<28}{'module':<28}savers")
    per_token = a.batch * a.tokens
    for r in a.rows()[:top]:
        print(f"  {r.nbytes / per_token:9.1f}  {r.dtype:<9}{str(list(r.shape)):<26}{r.producer:<28}"
              f"{r.module:<28}{','.join(r.savers)}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--resolutions", type=int, nargs="+", default=[224])
    parser.add_argument("--batch", type=int, default=None, help="default: benchmarks.models' batch per resolution")
    parser.add_argument("--mode", choices=MODES, default="fake-cuda")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="autocast dtype (fp32: none)")
    parser.add_argument("--whole", action="store_true", help="the whole model instead of one block")
    parser.add_argument("--top", type=int, default=12, help="storages listed per account")
    parser.add_argument("--kernels", choices=("chunk16", "chunk64"), default=None,
                        help="the Triton kernel family (sets HDLA_VISION_KERNELS; default: as the environment says)")
    parser.add_argument("--out", default=None, help="write the summaries and ratios as JSON here")
    parser.add_argument("--op-scratch", action="store_true",
                        help="instead: the peak bytes per token one HDLA scan's Triton backward allocates (bf16, 3 "
                             "heads of 64, the first resolution's tokens, --batch or 2; needs TRITON_INTERPRET=1)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.kernels:
        os.environ["HDLA_VISION_KERNELS"] = args.kernels
    setting = Setting(args.mode, torch.bfloat16 if args.dtype == "bf16" else None)
    if args.op_scratch:
        family, batch = os.environ.get("HDLA_VISION_KERNELS") or "chunk16", args.batch or 2
        tokens = (args.resolutions[0] // 16) ** 2
        peak = hdla_backward_scratch(family, batch, tokens)
        print(json.dumps(dict(kernels=family, batch=batch, tokens=tokens, backward_scratch_bytes_per_token=round(
            peak / (batch * tokens)))))
        return 0
    accounts = []
    for res in args.resolutions:
        batch = args.batch or BATCH_SIZES.get(res, 1)
        for name in args.models:
            count = saved_by_model if args.whole else saved_by_block
            accounts.append(count(name, res, batch, setting))
            print_account(accounts[-1], args.top)
    ratios = ratio_to_baseline(accounts)
    print()
    for r in ratios:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(accounts=[dict(a.summary(), groups=a.by_group(),
                                          storages=[asdict(s) for s in a.rows()]) for a in accounts],
                           ratios=ratios), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
