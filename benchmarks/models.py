"""Training and inference throughput and peak memory: hdla_tiny against timm's deit_tiny_patch16_224.

Both models are built with ``dynamic_img_size=True`` and run at each resolution in the same
process, under bf16 autocast. A training step is forward + cross-entropy + backward + fused
AdamW step; inference is a forward under ``torch.inference_mode``. Times are
``triton.testing.do_bench`` medians after warm-up; peak memory is measured in a separate pass
(do_bench allocates its own L2-flush buffer) as ``torch.cuda.max_memory_allocated`` during
the step, model and optimizer state included (with CUDA graphs, during the call that records them:
a replay allocates nothing).

    python -m benchmarks.models                 # table; JSON to --out (default $OUT, else .)/models.json
    python -m benchmarks.models --profile       # also torch.profiler's top kernels of training (--profile-model)
                                                # and per block: the scan op, GEMMs, attention, ViT parts, glue
    python -m benchmarks.models --engine        # also the training engine's own step (Accelerate, EMA)
    python -m benchmarks.models --compile       # also each cell with torch.compile(model) (inductor)
    python -m benchmarks.models --cuda-graphs   # also with torch.compile(mode="reduce-overhead"): CUDA graphs
    python -m benchmarks.models --no-activation-recompute   # the mixers save their activations (more memory)

Compiled cells (``--compile [MODE ...]``, ``--cuda-graphs``) compile the model alone (the loss and the
optimizer step stay eager), with static shapes (``dynamic=False``) and a fresh dynamo cache per cell;
each row records its ``compile`` setting ("eager" or the torch.compile mode), and compiled rows the
number of graphs dynamo made and its graph breaks; ``first_call_s`` then includes the compilation.
``--no-eager`` leaves the eager cells out. Ratios compare each model with deit_tiny under the same
``compile`` setting, and ``compile_speedup`` each compiled cell with the same model's eager one.

``--engine`` times exactly ``engine._train_step`` (Accelerate bf16 autocast, AdamW from timm's
optimizer factory, gradient clipping) and the EMA update at each resolution and batch (``engine`` rows),
eager and under each compile setting as ``train.compile=true train.compile_mode=<mode>`` runs it.

Needs a CUDA device.
"""
import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
import timm
import triton.testing
from torch._dynamo.utils import counters

import hdla_vision  # noqa: F401  registers hdla_tiny
from benchmarks.timing import profile_steps
from hdla_vision.kernels.utils import kernel_family
from hdla_vision.layers.mixer import activation_recompute, set_activation_recompute
from hdla_vision.training.config import COMPILE_MODES, CUDA_GRAPH_MODES  # train.compile_mode's values
from tools.provenance import provenance

MODELS = ("hdla_tiny", "deit_tiny_patch16_224")
BASELINE = "deit_tiny_patch16_224"
RESOLUTIONS = (224, 512, 1024, 2048)
BATCH_SIZES = {224: 256, 512: 64, 1024: 16, 2048: 2}
EAGER = "eager"


def build(name: str, device: torch.device) -> torch.nn.Module:
    return timm.create_model(name, dynamic_img_size=True, num_classes=1000).to(device)


def compiled_forward(model: torch.nn.Module, compile_mode: str) -> Callable:
    """``model`` itself (``compile_mode`` "eager"), else ``torch.compile(model, mode=compile_mode)`` with
    static shapes, on a fresh dynamo cache (each cell compiles its own graphs, and counts them)."""
    if compile_mode == EAGER:
        return model
    torch._dynamo.reset()
    counters.clear()
    forward = torch.compile(model, mode=compile_mode, dynamic=False)
    if compile_mode not in CUDA_GRAPH_MODES:
        return forward

    def new_step_then_forward(images):
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be overwritten
        return forward(images)

    return new_step_then_forward


def train_step_fn(model: torch.nn.Module, batch: int, res: int, device: torch.device,
                  compile_mode: str = EAGER) -> Callable[[], None]:
    model.train()
    forward = compiled_forward(model, compile_mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    images = torch.randn(batch, 3, res, res, device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(forward(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def infer_step_fn(model: torch.nn.Module, batch: int, res: int, device: torch.device,
                  compile_mode: str = EAGER) -> Callable[[], None]:
    model.eval()
    forward = compiled_forward(model, compile_mode)
    images = torch.randn(batch, 3, res, res, device=device)

    def step():
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            forward(images)

    return step


def compile_counts() -> Dict:
    """What dynamo made since :func:`compiled_forward` cleared its counters: graphs and graph breaks."""
    return dict(graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()))


def peak_memory_mib(step: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def measure(name: str, mode: str, res: int, batch: int, device: torch.device, warmup_ms: int, rep_ms: int,
            compile_mode: str = EAGER) -> Dict:
    """One (model, mode, resolution, compile setting) cell: images/s from the median step time, peak memory."""
    row = dict(model=name, mode=mode, compile=compile_mode, resolution=res, batch=batch, tokens=(res // 16) ** 2)
    model = build(name, device)
    try:
        step = (train_step_fn if mode == "train" else infer_step_fn)(model, batch, res, device, compile_mode)
        start = time.perf_counter()
        step()  # first call: torch.compile, Triton compilation / autotuning, optimizer state allocation
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - start, 2)
        recording_peak = 0.0
        if compile_mode != EAGER:  # CUDA graph modes record their graphs on the second call; a replay
            recording_peak = peak_memory_mib(step)  # allocates nothing, so their peak is the recording's
            row.update(compile_counts())
        row["peak_mem_mib"] = round(max(recording_peak, peak_memory_mib(step)), 1)
        ms = triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        row["step_ms"] = round(ms, 3)
        row["images_per_s"] = round(batch * 1000.0 / ms, 1)
    except torch.cuda.OutOfMemoryError:
        row["error"] = "OOM"
    finally:
        del model
        torch.cuda.empty_cache()
    return row


def ratio_rows(rows: List[Dict]) -> List[Dict]:
    """Each model against deit_tiny (images/s and peak memory) under the same compile setting, per mode and
    resolution; ``compile_speedup``: a compiled cell's images/s over the same model's eager cell."""
    cells = {(r["model"], r["mode"], r.get("compile", EAGER), r["resolution"]): r
             for r in rows if "images_per_s" in r}
    out = []
    for (model, mode, compile_mode, res), r in cells.items():
        base = cells.get((BASELINE, mode, compile_mode, res))
        eager = cells.get((model, mode, EAGER, res))
        ratio = dict(model=model, mode=mode, compile=compile_mode, resolution=res)
        if base is not None and model != BASELINE:
            ratio.update(speed_ratio=round(r["images_per_s"] / base["images_per_s"], 3),
                         memory_ratio=round(r["peak_mem_mib"] / base["peak_mem_mib"], 3))
        if eager is not None and compile_mode != EAGER:
            ratio.update(compile_speedup=round(r["images_per_s"] / eager["images_per_s"], 3),
                         compile_memory=round(r["peak_mem_mib"] / eager["peak_mem_mib"], 3))
        if len(ratio) > 4:
            out.append(ratio)
    return out


def print_table(rows: List[Dict], ratios: List[Dict]) -> None:
    print(f"\n{'model':<24}{'mode':<7}{'compile':<17}{'res':>6}{'batch':>7}{'img/s':>11}{'ms/step':>10}"
          f"{'peak MiB':>11}{'graphs':>8}")
    for r in rows:
        head = f"{r['model']:<24}{r['mode']:<7}{r.get('compile', EAGER):<17}{r['resolution']:>6}{r['batch']:>7}"
        if "error" in r:
            print(f"{head}{r['error']:>11}")
            continue
        graphs = f"{r['graphs']}/{r['graph_breaks']}" if "graphs" in r else ""
        print(f"{head}{r['images_per_s']:>11.1f}{r['step_ms']:>10.2f}{r['peak_mem_mib']:>11.0f}{graphs:>8}")
    print(f"\n{'ratios':<24}{'mode':<7}{'compile':<17}{'res':>6}{'/deit img/s':>12}{'/deit mem':>10}"
          f"{'/eager img/s':>13}{'/eager mem':>11}")
    for r in ratios:
        cols = [f"{r[k]:.2f}" if k in r else "" for k in ("speed_ratio", "memory_ratio", "compile_speedup",
                                                            "compile_memory")]
        print(f"{r['model']:<24}{r['mode']:<7}{r['compile']:<17}{r['resolution']:>6}{cols[0]:>12}{cols[1]:>10}"
              f"{cols[2]:>13}{cols[3]:>11}")


PROFILE_STEPS = 3
# torch.profiler kernel names by part of a block: our scan kernels (the Triton JIT functions of
# hdla_vision.kernels), GEMMs (cuBLAS / CUTLASS: projections, MLP, patch embedding), attention
# (FlashAttention / SDPA: DeiT's), the parts a ViT block has too (LayerNorm, GELU, softmax), the
# optimizer, and the rest: elementwise glue (casts, copies, activations, norms, gates, reductions).
PART_PATTERNS = (("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "splitk")),
                 ("attention", ("flash", "fmha", "attention")),
                 ("vit_shared", ("layer_norm", "gelu", "softmax")),
                 ("optimizer", ("multi_tensor", "adam")))


def scan_kernel_names() -> set:
    """Names of the Triton kernels in the loaded ``hdla_vision.kernels`` modules (the scan op's)."""
    from triton.runtime.jit import JITFunction

    return {name for mod_name, mod in list(sys.modules.items()) if mod_name.startswith("hdla_vision.kernels")
            for name, obj in vars(mod).items() if isinstance(obj, JITFunction)}


def block_part(kernel: str, scan_names: set) -> str:
    """The part of a training step (:data:`PART_PATTERNS`) a CUDA kernel's name belongs to."""
    if kernel in scan_names:
        return "scan_op"
    low = kernel.lower()
    for part, patterns in PART_PATTERNS:
        if any(p in low for p in patterns):
            return part
    return "glue"


def profile_parts(events, blocks: int, steps: int) -> Dict[str, dict]:
    """{part: {ms per block, launches per block}} from torch.profiler's key averages over ``steps``
    training steps of a model with ``blocks`` blocks (the optimizer, the loss and the stem are
    spread over the blocks too: a step's cost per block)."""
    scan_names = scan_kernel_names()
    parts: Dict[str, dict] = {}
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA or not event.self_device_time_total:
            continue
        part = parts.setdefault(block_part(event.key, scan_names), {"ms": 0.0, "launches": 0.0})
        part["ms"] += event.self_device_time_total / 1e3 / steps / blocks
        part["launches"] += event.count / steps / blocks
    return parts


def profile_training(res: int, batch: int, device: torch.device, row_limit: int = 25, name: str = MODELS[0]):
    """torch.profiler's top CUDA kernels for a few training steps of model ``name`` (a table) and their
    time and launches per block by part (:func:`profile_parts`)."""
    model = build(name, device)
    step = train_step_fn(model, batch, res, device)
    for _ in range(2):
        step()
    events = profile_steps(step, PROFILE_STEPS, cpu=True).key_averages()
    parts = profile_parts(events, len(model.blocks), PROFILE_STEPS)
    return events.table(sort_by="self_device_time_total", row_limit=row_limit), parts


def format_parts(parts: Dict[str, dict]) -> str:
    total_ms = sum(p["ms"] for p in parts.values())
    total_launches = sum(p["launches"] for p in parts.values())
    lines = [f"{'part':12s} {'ms/block':>9s} {'share':>6s} {'launches/block':>15s}"]
    for part, p in sorted(parts.items(), key=lambda kv: -kv[1]["ms"]):
        lines.append(f"{part:12s} {p['ms']:9.3f} {p['ms'] / total_ms:6.1%} {p['launches']:15.1f}")
    lines.append(f"{'total':12s} {total_ms:9.3f} {'':6s} {total_launches:15.1f}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolutions", type=int, nargs="+", default=list(RESOLUTIONS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="one per resolution (default 256/64/16/2 for 224/512/1024/2048)")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=["train", "infer"], choices=["train", "infer"])
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=400)
    parser.add_argument("--profile", action="store_true", help="print the top kernels of a model's training")
    parser.add_argument("--profile-model", default=MODELS[0], help="the models --profile profiles (comma-separated)")
    parser.add_argument("--profile-res", type=int, nargs="+", default=[1024])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for models.json")
    parser.add_argument("--engine", action="store_true", help="also time the training engine's step")
    parser.add_argument("--compile", nargs="*", choices=COMPILE_MODES, default=None, metavar="MODE",
                        help=f"also measure torch.compile(model, mode=MODE) for each MODE of {', '.join(COMPILE_MODES)} "
                             "(no MODE: default)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also measure torch.compile(model, mode='reduce-overhead') (CUDA graphs)")
    parser.add_argument("--no-eager", action="store_true", help="leave out the eager cells (with --compile)")
    parser.add_argument("--no-activation-recompute", action="store_true",
                        help="the mixers and blocks save their activations instead of recomputing their prologue, "
                             "output stage and MLP activation in the backward (hdla_vision.layers.mixer)")
    args = parser.parse_args(argv)
    args.compile_modes = compile_settings(args)
    if not args.compile_modes:
        parser.error("--no-eager needs --compile or --cuda-graphs")
    if args.batch_sizes is None:
        unknown = [r for r in args.resolutions if r not in BATCH_SIZES]
        if unknown:
            parser.error(f"--batch-sizes is required for resolutions {unknown}")
        args.batch_sizes = [BATCH_SIZES[r] for r in args.resolutions]
    if len(args.batch_sizes) != len(args.resolutions):
        parser.error("--batch-sizes needs one value per resolution")
    if any(r % 16 for r in args.resolutions):
        parser.error("resolutions must be multiples of the patch size 16")
    return args


def compile_settings(args: argparse.Namespace) -> List[str]:
    """The compile settings to measure, in order: "eager" (unless --no-eager), the --compile modes
    ("default" for a bare --compile), "reduce-overhead" for --cuda-graphs."""
    modes = [] if args.no_eager else [EAGER]
    if args.compile is not None:
        modes += args.compile or ["default"]
    if args.cuda_graphs:
        modes.append("reduce-overhead")
    return list(dict.fromkeys(modes))


def measure_engine_step(name: str, batch: int, img_size: int, steps: int, warmup: int, precision: str,
                        compile_mode: str = EAGER) -> dict:
    """Images per second of exactly ``engine._train_step`` (Accelerate autocast, AdamW from timm's optimizer
    factory, gradient clipping) plus the EMA update, on random images already on the GPU; ``compile_mode``
    other than "eager": with ``train.compile`` (inductor) in that mode, the warm-up steps then include the
    compilation (and the CUDA graphs' recording, whose memory the peak includes)."""
    from accelerate.state import AcceleratorState
    from timm.optim import create_optimizer_v2
    from timm.utils import ModelEmaV3

    from hdla_vision.training.config import config_from_dict
    from hdla_vision.training.engine import TrainParts, _train_step
    from hdla_vision.training.models import create_model
    from hdla_vision.training.runner import compile_for_training, make_accelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    torch._dynamo.reset()
    config = config_from_dict({"model": {"name": name, "drop_path_rate": 0.1},
                               "data": {"img_size": img_size, "num_classes": 1000},
                               "train": {"mixed_precision": precision, "global_batch_size": batch}})
    accelerator = make_accelerator(config)
    model = create_model(config)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    ema = ModelEmaV3(accelerator.unwrap_model(model), decay=0.9999)
    parts = TrainParts(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=None,
                       criterion=torch.nn.CrossEntropyLoss(), train_loader=None, train_order=None, clip_grad=5.0,
                       compiled=None if compile_mode == EAGER else compile_for_training(model, "inductor", compile_mode))
    images = torch.randn(batch, 3, img_size, img_size, device=accelerator.device)
    targets = torch.randint(0, 1000, (batch,), device=accelerator.device)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            start = time.perf_counter()
        _train_step(parts, images, targets)
        ema.update(accelerator.unwrap_model(model))
    sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return {"model": name, "batch": batch, "img_size": img_size, "precision": precision,
            "compile": compile_mode,
            "img_per_s": batch * steps / seconds, "step_ms": 1000 * seconds / steps, "peak_gib": peak,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m benchmarks.models needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    set_activation_recompute(not args.no_activation_recompute)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    rows = []
    for res, batch in zip(args.resolutions, args.batch_sizes):
        for mode in args.modes:
            for name in args.models:
                for compile_mode in args.compile_modes:
                    row = measure(name, mode, res, batch, device, args.warmup_ms, args.rep_ms, compile_mode)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    ratios = ratio_rows(rows)
    print_table(rows, ratios)
    result = dict(
        **provenance(torch.cuda.get_device_name(device)),
        torch=torch.__version__, timm=timm.__version__, triton=triton.__version__,
        autocast="bfloat16", timing="triton.testing.do_bench median", compile_settings=args.compile_modes,
        activation_recompute=activation_recompute(), kernels=kernel_family(),
        compiled="torch.compile(model, mode=<compile>, dynamic=False); loss and optimizer step eager",
        rows=rows, ratios=ratios,
    )
    if args.profile:
        result["profile"] = []
        for name in args.profile_model.split(","):
            for res in args.profile_res:
                batch = BATCH_SIZES.get(res, 4)
                table, parts = profile_training(res, batch, device, name=name)
                print(f"\n{name} training, {res}px, batch {batch}: top kernels by CUDA time\n{table}")
                print(f"{name} {res}px: CUDA time and launches per block and step, by part\n{format_parts(parts)}")
                result["profile"].append(dict(model=name, resolution=res, batch=batch, parts=parts, table=table))
    if args.engine:
        result["engine"] = [measure_engine_step(name, batch, res, 30, 10, "bf16", compile_mode)
                            for res, batch in zip(args.resolutions, args.batch_sizes)
                            for name in args.models for compile_mode in args.compile_modes]
        print(json.dumps(result["engine"], indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "models.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
