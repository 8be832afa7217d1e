"""MQAR recall benchmark (HDLA paper §4 / fig. 2, appendix D; Log-Linear Attention paper Table 2): three presets.

``--preset zoology`` (the default) is Zoology's ICLR'24 figure-2 protocol (HazyResearch/zoology
``zoology/experiments/paper_configs/iclr24_zoology_figure2/configs.py``, ``zoology/train.py`` and
``zoology/config.py`` as released with the paper, Dec. 2023), which the HDLA paper's appendix D follows:
  * data: a fixed training set of 100,000 and a fixed, disjoint test set of 3,000 examples per
    (length, key-value pairs, seed) (:func:`hdla_vision.lm.mqar.mqar_split`), vocab 8192, power-law
    query gaps (a = 0.01), filler token 0 (``--filler zero``, Zoology's ``random_non_queries=False``;
    ``--filler random`` is the ablation);
  * key-value pairs and batch sizes per length: 16 / 64 / 128 / 256 pairs and batches of
    256 / 128 / 64 / 64 at L = 256 / 512 / 1024 / 2048 (Zoology's configs and the Head-in-Head
    paper's table; other lengths need ``--kv-pairs`` and ``--batch-size``);
  * training: 64 epochs over the training set in a fresh shuffled order each epoch (Zoology's
    DataLoader of Dec. 2023 shuffles; the last batch may be short); AdamW (torch betas and eps),
    weight decay 0.1; cosine schedule stepped once per epoch (T_max = epochs, to 0, no warm-up);
    embedding dropout 0.1; no gradient clipping; bf16 autocast on CUDA (where the step runs as CUDA
    graphs of the torch.compile'd loss: ``--cuda-graph``, ``--compile``, hdla_vision/lm/mqar_step.py);
    test accuracy (share of query positions whose argmax is the right value) and loss after every
    epoch, stop once the accuracy is above 99%;
  * learning rates: Zoology's four, ``logspace(-4, -2, 4)``, at every length (``--lr-sweep zoology``);
    ``--lr-sweep paper`` takes the HDLA paper's appendix-D sweeps instead (logspace(-4, -2, 4) at 256,
    logspace(-5, -3, 4) at 512, [1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2] at 1024 and 2048);
    seeds 0 and 1 (a seed fixes the datasets, the initialisation, the shuffles and the dropout masks);
  * models (``MODELS["zoology"]``): two layers, d_model 128, 2 heads of key dim 64, tied embeddings,
    SwiGLU whose width balances each model near the paper's 1.65M parameters (printed and recorded);
    ``hdla`` (today's layer: short conv 4, decay bias), ``hdla_authors`` (the authors' layer: no short
    conv, bias-free rank-16 decay, rank-16 sigmoid gate before one RMSNorm over all heads; with no token
    shift anywhere in this model it is not expected to learn MQAR: a reference point, not a competitor),
    ``hdla_authors_conv`` (the same layer with the short conv 4 that every other model here has: Zoology
    gives its recurrent models a token shift too, ``Hybrid([BaseConv, mixer])`` plus fla's short conv in
    ``zoology/experiments/models_repo.py``), and the baselines as fla and Zoology build them:
    ``gated_deltanet`` with value width twice the key width
    (fla's expand_v = 2), ``gated_deltaproduct_2`` (n_h = 2) with expand_v = 2 and beta in (0, 2)
    (fla's allow_neg_eigval default for DeltaProduct).

``--preset legacy`` is this benchmark's earlier protocol (issue 5; the runs in
``benchmarks/results/mqar_h200_4000steps`` and ``mqar_h200_13000steps``), kept so those results can be
re-run: a fresh training batch every step (generator seed 1000003 * (seed + 1) + step), random filler,
1,000 test examples drawn at seed 12345, L/16 key-value pairs, 16,384-token batches (64 at L = 256,
32 at 512), ``--steps`` (3,000 by default; the results used 4,000 and 13,000) with a cosine per step
to 0 and no warm-up, AdamW weight decay 0.01, no embedding dropout, no early stop, the paper's
learning-rate sweeps, seed 0, SwiGLU 512 for every model and the baselines of then (value width =
key width, beta in (0, 1) for both Gated DeltaNet and Gated DeltaProduct). It departs from Zoology
in all of these; the test set is also scored every ``--eval-every`` steps (1,000), which changes
no training step.

Each run lives in ``<state-dir>/<run id>/``: ``run.json`` (protocol, parameter count, learning
curve, ms/step, status) rewritten after every epoch (legacy: every ``--eval-every`` steps),
``ckpt.pt`` (model, optimizer, RNG states and curve; written atomically, read with
``weights_only=True``) so a run cut by a time limit resumes at its last finished epoch with the
same curve, and ``DONE`` once finished (the checkpoint is then deleted). ``--deadline-s`` stops a
run cleanly before an epoch that would not finish in time.

    python -m benchmarks.mqar --mixers hdla --lengths 256 --lrs 1e-3 --seeds 0      # one run
    python -m benchmarks.mqar --write-queue tools/mqar_queue.txt                     # the sweep, one run a line
    bash tools/mqar_device.sh tools/mqar_queue.txt                                   # the queue on a GPU machine
    python -m benchmarks.mqar_report .mqar --out-dir benchmarks/results/mqar_zoology
    python -m benchmarks.mqar --preset legacy --mixers hdla --lengths 256 --lrs 2.2e-3 --steps 13000
    python -m benchmarks.mqar --tiny                                                 # CPU smoke run
    python -m benchmarks.mqar --preset loglinear_table2 --write-queue tools/mqar_loglinear_queue.txt

``--preset loglinear_table2`` is the Log-Linear Attention paper's MQAR (§4.1, Table 2): Zoology's
Based-era data mixture up to 256 tokens and 4 to 64 pairs, Zoology's two-layer model
(:mod:`hdla_vision.lm.zoology_lm`) at widths 16 / 32 / 64 (``--dims``, a sweep axis), Gated DeltaNet,
HDLA and their log-linear versions, five seeds; :mod:`hdla_vision.lm.mqar_loglinear` gives every
setting, its source and the report (Table 2's layout).

The device runner (``tools/mqar_device.sh`` with ``python -m tools.mqar_device``; see
:mod:`hdla_vision.lm.mqar_device`) fills the table over several device windows. (``benchmarks/mqar.py``
is the command line; this module, in the package, is what it runs and what the tests import.)
"""
import argparse
import fcntl
import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from hdla_vision.lm import HDLAConfig, HDLAForCausalLM
from hdla_vision.kernels.utils import kernel_family
from hdla_vision.layers import CHUNK_BACKENDS, set_chunk_backend
from hdla_vision.lm import mqar_loglinear as table2
from hdla_vision.lm.mqar import check_mqar_args, mqar_split, multiquery_ar
from hdla_vision.lm.mqar_step import autocast, cross_entropy_loss, make_optimizer, make_step, restore_lr_tensors, set_lr
from hdla_vision.lm.zoology_lm import ZoologyLM, ZoologyLMConfig

LENGTHS = [256, 512, 1024, 2048]
ZOOLOGY_KV_PAIRS = {256: 16, 512: 64, 1024: 128, 2048: 256}
ZOOLOGY_BATCH = {256: 256, 512: 128, 1024: 64, 2048: 64}
LEGACY_BATCH_TOKENS = 16_384
LEGACY_KV_DIVISOR = 16
LEGACY_TEST_SEED = 12_345
PAPER_PARAMS = 1.65e6
ZOOLOGY_LRS = np.logspace(-4, -2, 4).tolist()

# Each model: HDLAConfig settings; "value_expand" multiplies head_dim into head_dim_v (fla's expand_v).
MODELS = {
    "zoology": {
        # our HDLA with its deliberate choices: short conv, rank-16 decay with a bias (memory lengths
        # spread over 2..256 tokens at init), per-head RMSNorm then a SiLU gate
        "hdla": dict(mixer="hdla", short_conv_size=4, gate_act="silu", value_expand=1, mixer_kwargs={}),
        # HDLA as the authors' layer builds it: no short conv, bias-free rank-16 decay (lambda ~ 0.5),
        # rank-16 sigmoid gate before one RMSNorm over all heads
        "hdla_authors": dict(mixer="hdla_authors", short_conv_size=0, gate_act="sigmoid", value_expand=1,
                             mixer_kwargs={"decay_rank": 16, "gate_rank": 16}),
        # the authors' layer with the token shift the other models get from their short conv (MQAR needs one:
        # without it the layer at best recalls the bag of values in context, not the key's value)
        "hdla_authors_conv": dict(mixer="hdla_authors", short_conv_size=4, gate_act="sigmoid", value_expand=1,
                                  mixer_kwargs={"decay_rank": 16, "gate_rank": 16}),
        # fla's / Zoology's Gated DeltaNet: expand_v = 2, beta in (0, 1)
        "gated_deltanet": dict(mixer="gated_deltanet", short_conv_size=4, gate_act="silu", value_expand=2,
                               mixer_kwargs={"beta_range": 1.0}),
        # fla's Gated DeltaProduct, n_h = 2: expand_v = 2, negative eigenvalues allowed (beta in (0, 2))
        "gated_deltaproduct_2": dict(mixer="gated_deltaproduct", short_conv_size=4, gate_act="silu", value_expand=2,
                                     mixer_kwargs={"num_householder": 2, "beta_range": 2.0}),
    },
    # issue 5's models: short conv 4 everywhere, value width = key width, beta in (0, 1) for the baselines
    "legacy": {
        "hdla": dict(mixer="hdla", short_conv_size=4, gate_act="silu", value_expand=1,
                     mixer_kwargs={"beta_range": 2.0}),
        "gated_deltanet": dict(mixer="gated_deltanet", short_conv_size=4, gate_act="silu", value_expand=1,
                               mixer_kwargs={"beta_range": 1.0}),
        "gated_deltaproduct_2": dict(mixer="gated_deltaproduct", short_conv_size=4, gate_act="silu", value_expand=1,
                                     mixer_kwargs={"num_householder": 2, "beta_range": 1.0}),
    },
    # the Log-Linear Attention paper's Table 2 (hdla_vision/lm/mqar_loglinear.py): Zoology's LM, width 16/32/64
    table2.PRESET: table2.MODELS,
}

# What each preset sets for the flags left out, and the flags it does not use.
PRESET_DEFAULTS = {
    "zoology": dict(data="fixed", filler="zero", epochs=64, num_train=100_000, num_test=3_000, weight_decay=0.1,
                    embedding_dropout=0.1, early_stop=0.99, lr_sweep="zoology", seeds=[0, 1], eval_batch_size=250),
    "legacy": dict(data="stream", filler="random", steps=3_000, eval_every=1_000, num_test=1_000, weight_decay=0.01,
                   embedding_dropout=0.0, early_stop=None, lr_sweep="paper", seeds=[0], eval_batch_size=125,
                   intermediate_size=512),
    table2.PRESET: dict(data="mixture", filler="random", epochs=table2.EPOCHS, weight_decay=0.1, embedding_dropout=0.1,
                        early_stop=0.99, lr_sweep="based", seeds=list(table2.SEEDS), eval_batch_size=500,
                        batch_size=[table2.BATCH_SIZE], dims=list(table2.DIMS), vocab_size=table2.VOCAB_SIZE),
}
# settings a preset does not use (giving one raises); --preset loglinear_table2 fixes its data segments and
# builds each model from its width (--dims) alone
PRESET_UNUSED = {"zoology": ("steps", "eval_every", "dims"), "legacy": ("epochs", "num_train", "dims"),
                 table2.PRESET: ("steps", "eval_every", "num_train", "num_test", "kv_pairs", "lengths", "d_model",
                                 "num_heads", "head_dim", "target_params", "intermediate_size")}
SCHEDULES = {"fixed": "cosine per epoch (T_max = epochs, eta_min = 0), no warm-up",
             "mixture": "cosine per epoch (T_max = epochs, eta_min = 0), no warm-up",
             "stream": "cosine per step over the steps, to 0, no warm-up"}

# protocol keys that must match for a checkpoint to be resumed
RESUME_KEYS = ("preset", "mixer", "model_config", "data", "length", "num_kv_pairs", "lr", "seed", "filler",
               "batch_size", "epochs", "steps", "eval_every", "num_train", "num_test", "weight_decay",
               "embedding_dropout", "early_stop", "vocab_size", "segments", "d_model")


def paper_lr_sweep(length: int):
    """HDLA paper appendix D; lengths it does not list use the 256 sweep."""
    if length >= 1024:
        return [1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2]
    if length == 512:
        return np.logspace(-5, -3, 4).tolist()
    return np.logspace(-4, -2, 4).tolist()


def lr_sweep(name: str, length: int):
    """``"zoology"``: Zoology's ICLR'24 figure-2 sweep at every length; ``"paper"``: the HDLA paper's;
    ``"based"``: Zoology's sweep of the Based paper and its 2025 configs, ``logspace(-3, -1.5, 4)``."""
    if name == "based":
        return list(table2.BASED_LRS)
    return list(ZOOLOGY_LRS) if name == "zoology" else paper_lr_sweep(length)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESET_DEFAULTS), default="zoology",
                   help="protocol: Zoology's (default) or this benchmark's earlier one; flags override it")
    every_model = sorted({name for models in MODELS.values() for name in models})
    p.add_argument("--mixers", nargs="+", default=None, choices=every_model, help="default: the preset's models")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help=f"default {LENGTHS}")
    p.add_argument("--kv-pairs", type=int, nargs="+", default=None, help="one per length (default: the preset's)")
    p.add_argument("--batch-size", type=int, nargs="+", default=None, help="one per length (default: the preset's)")
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="one sweep for all lengths (default: --lr-sweep)")
    p.add_argument("--lr-sweep", choices=("zoology", "paper", "based"), default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--filler", choices=("zero", "random"), default=None)
    p.add_argument("--epochs", type=int, default=None, help="zoology: passes over the training set")
    p.add_argument("--steps", type=int, default=None, help="legacy: training steps")
    p.add_argument("--eval-every", type=int, default=None, help="legacy: steps between test evaluations")
    p.add_argument("--num-train", type=int, default=None, help="zoology: training examples")
    p.add_argument("--num-test", type=int, default=None)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--embedding-dropout", type=float, default=None)
    p.add_argument("--early-stop", type=float, default=None, help="stop once test accuracy is above this (>1: never)")
    p.add_argument("--vocab-size", type=int, default=None, help="default 8192")
    p.add_argument("--d-model", type=int, default=None, help="default 128")
    p.add_argument("--dims", type=int, nargs="+", default=None,
                   help=f"{table2.PRESET}: model widths, a sweep axis (default {list(table2.DIMS)})")
    p.add_argument("--num-heads", type=int, default=None, help="default 2")
    p.add_argument("--head-dim", type=int, default=None, help="default 64")
    p.add_argument("--target-params", type=float, default=None,
                   help="the SwiGLU width of each model is chosen to bring it nearest this parameter count (1.65M)")
    p.add_argument("--intermediate-size", type=int, default=None, help="fixed SwiGLU width (skips the balancing)")
    p.add_argument("--eval-batch-size", type=int, default=None)
    p.add_argument("--state-dir", default=None, help="runs' folders (default: $OUT/mqar or .mqar)")
    p.add_argument("--data-dir", default=None, help="cached datasets (default: <state-dir>/data)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds from now: no epoch is started that would not end before (resume later)")
    p.add_argument("--stop-after-epochs", type=int, default=None,
                   help="checkpoint and stop each run after this many epochs (legacy: evaluation blocks) in this "
                        "call (resume later)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cpu-threads", type=int, default=2, help="torch CPU threads (several runs share a machine)")
    p.add_argument("--chunk-backend", default="auto", choices=CHUNK_BACKENDS)
    p.add_argument("--cuda-graph", default="auto", choices=("auto", "on", "off"),
                   help="replay the training step as one CUDA graph (hdla_vision.lm.mqar_step; auto: on CUDA)")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                   help="the forward and loss through torch.compile (inductor; auto: on CUDA; a compile that "
                        "fails falls back to the uncompiled loss)")
    p.add_argument("--write-queue", default=None, metavar="FILE",
                   help="no training: write the planned runs to FILE, one '<run id> <arguments>' line each")
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes for the settings not given")
    args = p.parse_args(argv)
    args.explicit = {name for name, value in vars(args).items() if value is not None}
    if args.tiny:
        apply_tiny(args)
    apply_preset(args)
    check_args(args)
    if args.state_dir is None:
        args.state_dir = os.path.join(os.environ["OUT"], "mqar") if os.environ.get("OUT") else ".mqar"
    if args.data_dir is None:
        args.data_dir = os.path.join(args.state_dir, "data")
    return args


COMMON_DEFAULTS = dict(lengths=LENGTHS, vocab_size=8192, d_model=128, num_heads=2, head_dim=64,
                      target_params=PAPER_PARAMS)
TINY = dict(lengths=[16], kv_pairs=[4], batch_size=[16], lrs=[3e-3], seeds=[0], vocab_size=64, d_model=16,
            num_heads=2, head_dim=8, num_train=64, num_test=32, epochs=2, steps=6, eval_every=3, eval_batch_size=32,
            intermediate_size=32, dims=[16])


def apply_tiny(args) -> None:
    """CPU smoke sizes (``TINY``) for every setting not given (seconds for all models)."""
    for name, value in TINY.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def apply_preset(args) -> None:
    """The preset's values (``PRESET_DEFAULTS``, else ``COMMON_DEFAULTS``) for every setting not given;
    a setting that the preset does not use (``PRESET_UNUSED``) must not be given. ``loglinear_table2``
    also fixes its data segments (``args.segments``; tiny ones with ``--tiny``) and its one length
    (the longest training sequence)."""
    unused = PRESET_UNUSED[args.preset]
    for name in unused:
        if name in args.explicit:
            raise ValueError(f"--{name.replace('_', '-')} does not apply to --preset {args.preset}")
        setattr(args, name, None)
    for name, value in {**COMMON_DEFAULTS, **PRESET_DEFAULTS[args.preset]}.items():
        if name not in unused and getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.mixers is None:
        args.mixers = list(MODELS[args.preset])
    args.segments = table2.segments_for(args.tiny) if args.preset == table2.PRESET else None
    if args.segments is not None:
        args.lengths = [max(length for length, _, _ in args.segments["train"])]


def check_args(args) -> None:
    """Models of the preset; per-length lists with one value per length; lengths without the
    preset's values need them; positive sizes."""
    if args.cuda_graph == "on" and not args.device.startswith("cuda"):
        raise ValueError(f"--cuda-graph on needs a CUDA --device, got {args.device}")
    unknown = [m for m in args.mixers if m not in MODELS[args.preset]]
    if unknown:
        raise ValueError(f"--mixers {unknown} are not models of --preset {args.preset}: {list(MODELS[args.preset])}")
    if args.preset == table2.PRESET:
        check_table2_args(args)
        return
    for name, table in (("kv_pairs", ZOOLOGY_KV_PAIRS), ("batch_size", ZOOLOGY_BATCH)):
        given, flag = getattr(args, name), "--" + name.replace("_", "-")
        if given is not None and len(given) != len(args.lengths):
            raise ValueError(f"{flag} needs one value per length ({len(args.lengths)}), got {given}")
        if given is None and args.preset == "zoology":
            missing = [n for n in args.lengths if n not in table]
            if missing:
                raise ValueError(f"{flag} is needed for lengths without Zoology's values: {missing}")
    for name in ("epochs", "steps", "eval_every", "num_train", "num_test", "eval_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0.0 <= args.embedding_dropout < 1.0:
        raise ValueError(f"--embedding-dropout must be in [0, 1), got {args.embedding_dropout}")
    for length in args.lengths:
        check_mqar_args(args.vocab_size, length, per_length(args, "kv_pairs", length))
        if per_length(args, "batch_size", length) < 1:
            raise ValueError(f"--batch-size must be >= 1 at length {length}")


def check_table2_args(args) -> None:
    """``--preset loglinear_table2``: one batch size, widths that split into their heads, segments
    that the generator accepts, sizes and rates in range."""
    if len(args.batch_size) != 1 or args.batch_size[0] < 1:
        raise ValueError(f"--batch-size takes one value >= 1 with --preset {table2.PRESET}, got {args.batch_size}")
    for dim in args.dims:
        if dim < 1:
            raise ValueError(f"--dims must be positive, got {args.dims}")
        for mixer in args.mixers:
            table2.head_sizes(dim, MODELS[args.preset][mixer]["value_expand"])
    for length, pairs, _ in args.segments["train"] + args.segments["test"]:
        check_mqar_args(args.vocab_size, length, pairs)
    for name in ("epochs", "eval_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.embedding_dropout < 1.0:
        raise ValueError(f"--embedding-dropout must be in [0, 1), got {args.embedding_dropout}")


def per_length(args, name: str, length: int) -> int:
    """``--kv-pairs`` / ``--batch-size`` for one length (the preset's value when not given;
    ``loglinear_table2``: its one batch size, and no single pair count)."""
    if args.preset == table2.PRESET:
        return args.batch_size[0] if name == "batch_size" else None
    given = getattr(args, name)
    if given is not None:
        return given[args.lengths.index(length)]
    if args.preset == "legacy":
        return length // LEGACY_KV_DIVISOR if name == "kv_pairs" else LEGACY_BATCH_TOKENS // length
    return (ZOOLOGY_KV_PAIRS if name == "kv_pairs" else ZOOLOGY_BATCH)[length]


# -- models -------------------------------------------------------------------------------------
def model_config(args, mixer: str, intermediate_size, d_model=None):
    """HDLAConfig of one model of the preset at one SwiGLU width; ``loglinear_table2``: the
    ZoologyLMConfig of the model at width ``d_model`` (heads by :func:`table2.head_sizes`)."""
    settings = dict(MODELS[args.preset][mixer])
    expand = settings.pop("value_expand")
    if args.preset == table2.PRESET:
        heads, head_dim, head_dim_v = table2.head_sizes(d_model, expand)
        return ZoologyLMConfig(vocab_size=args.vocab_size, d_model=d_model, num_heads=heads, head_dim=head_dim,
                               head_dim_v=head_dim_v, **settings)
    return HDLAConfig(vocab_size=args.vocab_size, hidden_size=args.d_model, num_hidden_layers=2,
                      num_heads=args.num_heads, head_dim=args.head_dim, head_dim_v=expand * args.head_dim,
                      intermediate_size=intermediate_size, tie_word_embeddings=True, use_cache=False, **settings)


def make_model(config):
    """The model of a config: :class:`ZoologyLM` or :class:`HDLAForCausalLM`."""
    return ZoologyLM(config) if isinstance(config, ZoologyLMConfig) else HDLAForCausalLM(config)


def count_params(config) -> int:
    """Parameters of the model (tied embeddings counted once)."""
    return sum(p.numel() for p in make_model(config).parameters())


def balanced_intermediate_size(args, mixer: str) -> int:
    """SwiGLU width (a multiple of 8) bringing the model nearest ``--target-params`` (or the fixed width)."""
    if args.intermediate_size is not None or args.preset == table2.PRESET:
        return args.intermediate_size
    base = count_params(model_config(args, mixer, 8))
    per_unit = (count_params(model_config(args, mixer, 16)) - base) / 8
    width = 8 + (args.target_params - base) / per_unit
    return max(8, 8 * round(width / 8))


def build_model(config, seed: int, device: str):
    torch.manual_seed(seed)
    return make_model(config).to(device)


# -- data ---------------------------------------------------------------------------------------
def compact(t: torch.Tensor) -> torch.Tensor:
    """Token ids (and -100 labels) in int16 where the vocabulary fits, to keep 100k x L sets small."""
    return t.to(torch.int16) if int(t.max()) < 2 ** 15 else t.to(torch.int32)


def save_atomic(obj, path: Path) -> None:
    """torch.save to a temporary file beside ``path``, then rename (a cut never leaves half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_json_atomic(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def load_split(args, proto: dict):
    """Zoology's fixed (train, test) sets of one (length, pairs, seed), cached in ``--data-dir``; a
    file lock lets one of several concurrent runs draw them while the others wait and read the file."""
    length, num_kv, seed = proto["length"], proto["num_kv_pairs"], proto["seed"]
    name = f"mqar_v{args.vocab_size}_L{length}_kv{num_kv}_s{seed}_{args.filler}_n{args.num_train}_{args.num_test}.pt"
    path = Path(args.data_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            (tx, ty), (sx, sy) = mqar_split(args.vocab_size, length, num_kv, seed, args.num_train, args.num_test,
                                            random_non_queries=args.filler == "random")
            save_atomic(dict(train_x=compact(tx), train_y=compact(ty), test_x=compact(sx), test_y=compact(sy)), path)
    data = torch.load(path, weights_only=True)
    return (data["train_x"], data["train_y"]), (data["test_x"], data["test_y"])


def load_mixture(args, proto: dict):
    """``loglinear_table2``'s segments for one seed: ``(train, test)``, each a list of ``(inputs,
    labels)`` per segment (``[n, L]``, compact ints), in the order of ``proto["segments"]``. Each
    segment is drawn with its own seed (:func:`table2.segment_seed`), as Zoology's ``prepare_data``
    (no de-duplication between train and test); cached in ``--data-dir`` under a file lock."""
    segments, seed, filler = proto["segments"], proto["seed"], proto["filler"]
    shape = "_".join(f"{part[0]}{length}x{pairs}x{n}" for part in ("train", "test")
                     for length, pairs, n in segments[part])
    path = Path(args.data_dir) / f"mqar_mix_v{args.vocab_size}_s{seed}_{filler}_{shape}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            data = {}
            for part_index, part in enumerate(("train", "test")):
                for index, (length, pairs, n) in enumerate(segments[part]):
                    x, y = multiquery_ar(args.vocab_size, n, length, pairs, table2.segment_seed(seed, part_index, index),
                                         random_non_queries=filler == "random")
                    data[f"{part}_{index}_x"], data[f"{part}_{index}_y"] = compact(x), compact(y)
            save_atomic(data, path)
    data = torch.load(path, weights_only=True)
    return tuple([(data[f"{part}_{i}_x"], data[f"{part}_{i}_y"]) for i in range(len(segments[part]))]
                 for part in ("train", "test"))


def load_data(args, proto: dict, device: str):
    """``(train, test)`` on the device: the fixed sets (zoology), the segment lists (loglinear_table2),
    or ``(None, test)`` for the legacy stream, whose test set is drawn at one seed for every run seed
    as issue 5's runs did."""
    if proto["data"] == "mixture":
        return tuple([tuple(t.to(device) for t in segment) for segment in part] for part in load_mixture(args, proto))
    if proto["data"] == "fixed":
        return tuple(tuple(t.to(device) for t in part) for part in load_split(args, proto))
    test = multiquery_ar(proto["vocab_size"], proto["num_test"], proto["length"], proto["num_kv_pairs"],
                         seed=LEGACY_TEST_SEED, random_non_queries=proto["filler"] == "random")
    return None, tuple(t.to(device) for t in test)


def epoch_order(num: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled order of epoch ``epoch``: a function of (seed, epoch) alone, so resumes match."""
    return torch.randperm(num, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def cosine_lr(peak: float, epoch: int, epochs: int) -> float:
    """Zoology's CosineAnnealingLR(T_max=epochs, eta_min=0) stepped once per epoch, no warm-up
    (also the legacy per-step cosine, with steps for epochs)."""
    return 0.5 * peak * (1 + math.cos(math.pi * epoch / epochs))


def epoch_batches(proto: dict, train, epoch: int):
    """Zoology: ``(lr, inputs, labels)`` of every batch of one epoch over the fixed training set."""
    inputs, labels = train
    lr = cosine_lr(proto["lr"], epoch, proto["epochs"])
    order = epoch_order(len(inputs), proto["seed"], epoch).to(inputs.device)
    for i in range(0, len(order), proto["batch_size"]):
        idx = order[i:i + proto["batch_size"]]
        yield lr, inputs[idx].long(), labels[idx].long()


def mixture_batches(proto: dict, train, epoch: int):
    """loglinear_table2: ``(lr, inputs, labels)`` of every batch of one epoch, segment by segment in
    the same order every epoch (Zoology's batch list with ``shuffle=False``; the last batch of each
    segment may be short)."""
    lr = cosine_lr(proto["lr"], epoch, proto["epochs"])
    for inputs, labels in train:
        for i in range(0, len(inputs), proto["batch_size"]):
            yield lr, inputs[i:i + proto["batch_size"]].long(), labels[i:i + proto["batch_size"]].long()


def stream_batches(proto: dict, block: int, device: str):
    """Legacy: ``(lr, inputs, labels)`` of the steps of one evaluation block, each batch drawn fresh."""
    first = block * proto["eval_every"]
    for step in range(first, min(proto["steps"], first + proto["eval_every"])):
        inputs, labels = multiquery_ar(proto["vocab_size"], proto["batch_size"], proto["length"],
                                       proto["num_kv_pairs"], seed=1_000_003 * (proto["seed"] + 1) + step,
                                       random_non_queries=proto["filler"] == "random")
        yield cosine_lr(proto["lr"], step, proto["steps"]), inputs.to(device), labels.to(device)


def segment_batches(proto: dict, train, segment: int, device: str):
    """The batches of one curve point: an epoch (zoology, loglinear_table2) or a block of steps (legacy)."""
    if proto["data"] == "mixture":
        return mixture_batches(proto, train, segment)
    return epoch_batches(proto, train, segment) if proto["data"] == "fixed" else stream_batches(proto, segment, device)


def num_segments(proto: dict) -> int:
    if proto["data"] != "stream":
        return proto["epochs"]
    return -(-proto["steps"] // proto["eval_every"])


# -- training -----------------------------------------------------------------------------------
def use_cuda_graph(args) -> bool:
    """``--cuda-graph``: on, off, or auto (on where the run trains on CUDA)."""
    if args.cuda_graph == "auto":
        return args.device.startswith("cuda")
    return args.cuda_graph == "on"


def use_compile(args) -> bool:
    """``--compile``: on, off, or auto (on where the run trains on CUDA)."""
    if args.compile == "auto":
        return args.device.startswith("cuda")
    return args.compile == "on"


def step_mode(step) -> str:
    """How the step ran: "eager" or "cuda_graph", "+compile" where torch.compile'd (a failed capture: eager)."""
    return step.mode.replace("cuda_graph", "eager") if step.failed else step.mode


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def query_logits(model, inputs: torch.Tensor, labels: torch.Tensor, dropout: float, queries: Optional[int] = None):
    """Logits at the query positions only (the LM head over every position would dominate memory);
    the embeddings go through dropout (Zoology's embedding dropout) in training mode.

    ``queries=None``: every labelled position, example by example (``[Q, vocab]``, ``[Q]``; the boolean
    index waits for the device). ``queries`` (training): each example's first ``queries`` labelled
    positions (:func:`query_positions`, ``[B * queries, vocab]``; targets -100 past an example's own
    count, which cross-entropy ignores), with no host synchronisation in the step."""
    if isinstance(model, ZoologyLM):
        hidden = model.hidden_states(inputs, dropout)
    else:
        embeds = model.model.embed_tokens(inputs)
        if dropout > 0:
            embeds = F.dropout(embeds, dropout, model.training)
        hidden = model.model(inputs_embeds=embeds).last_hidden_state
    if queries is None:
        asked = labels != -100
        return model.lm_head(hidden[asked]).float(), labels[asked]
    positions = query_positions(labels, queries)
    rows = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return model.lm_head(rows.flatten(0, 1)).float(), labels.gather(1, positions).flatten()


def query_positions(labels: torch.Tensor, queries: int) -> torch.Tensor:
    """``labels [B, T]`` -> ``[B, queries]``: the positions of each example's labelled tokens in order, then
    (where an example holds fewer) unlabelled ones, by a stable sort on "is -100" (a static shape, no sync)."""
    return torch.argsort((labels == -100).to(torch.int8), dim=1, stable=True)[:, :queries]


def max_queries(proto: dict, train) -> int:
    """The most labelled positions of any training example (one device sync per epoch): MQAR asks every
    key once, so this is the largest number of key-value pairs among the training sets."""
    if proto["data"] == "stream":
        return proto["num_kv_pairs"]
    parts = train if proto["data"] == "mixture" else [train]
    return max(int((labels != -100).sum(1).max()) for _, labels in parts)


def train_segment(model, step, opt, batches, device: str) -> dict:
    """Train on ``batches`` (``(lr, inputs, labels)``) with ``step`` (:mod:`hdla_vision.lm.mqar_step`: eager or
    one CUDA graph); mean loss, the first lr and ms/step (synchronised)."""
    model.train()
    total, steps, first_lr = torch.zeros((), device=device), 0, None
    synchronize(device)
    start = time.time()
    for lr, inputs, labels in batches:
        set_lr(opt, lr)
        first_lr = lr if first_lr is None else first_lr
        total += step(inputs, labels)
        steps += 1
    synchronize(device)
    seconds = time.time() - start
    return dict(lr=first_lr, train_loss=total.item() / steps, steps=steps, ms_per_step=round(1000 * seconds / steps, 3),
                train_seconds=round(seconds, 2), step_mode=step_mode(step))


@torch.no_grad()
def evaluate(model, data, device, eval_batch: int) -> dict:
    """Test accuracy over all query positions and the mean cross-entropy per query."""
    model.eval()
    inputs, labels = data
    correct = loss = count = 0.0
    for i in range(0, len(inputs), eval_batch):
        with autocast(device):
            logits, targets = query_logits(model, inputs[i:i + eval_batch].long(), labels[i:i + eval_batch].long(), 0.0)
        correct += (logits.argmax(-1) == targets).sum().item()
        loss += F.cross_entropy(logits, targets, reduction="sum").item()
        count += targets.numel()
    return dict(test_accuracy=correct / count, test_loss=loss / count)


def example_accuracy(right: torch.Tensor, rows: torch.Tensor, num_examples: int) -> torch.Tensor:
    """Zoology's per-example accuracy: ``right [Q]`` (bool, one per query) and ``rows [Q]`` (the
    example of each query) -> ``[num_examples]``, the share of each example's queries answered right."""
    hits = torch.zeros(num_examples, device=right.device).index_add_(0, rows, right.float())
    asked = torch.zeros(num_examples, device=right.device).index_add_(0, rows, torch.ones_like(right, dtype=torch.float))
    if bool((asked == 0).any()):
        raise ValueError("every test example must hold at least one query")
    return hits / asked


@torch.no_grad()
def evaluate_segments(model, segments, device, eval_batch: int) -> dict:
    """Zoology's test metrics over test segments (``[(inputs, labels), ...]``): the accuracy of each
    example (share of its queries answered right) averaged over all examples, the same per number of
    key-value pairs (``test_accuracy_by_pairs``, Zoology's ``num_kv_pairs`` slices), and the mean
    cross-entropy per query."""
    model.eval()
    per_pairs, loss, queries = {}, 0.0, 0
    for inputs, labels in segments:
        scores = []
        for i in range(0, len(inputs), eval_batch):
            x, y = inputs[i:i + eval_batch].long(), labels[i:i + eval_batch].long()
            with autocast(device):
                logits, targets = query_logits(model, x, y, 0.0)
            rows = (y != -100).nonzero()[:, 0]  # the example of each query, in query_logits' order
            scores.append(example_accuracy(logits.argmax(-1) == targets, rows, len(x)))
            loss += F.cross_entropy(logits, targets, reduction="sum").item()
            queries += targets.numel()
        pairs = int((labels[0] != -100).sum())
        per_pairs[str(pairs)] = torch.cat(scores).tolist()
    every = [a for accs in per_pairs.values() for a in accs]
    return dict(test_accuracy=sum(every) / len(every), test_loss=loss / queries,
                test_accuracy_by_pairs={k: sum(v) / len(v) for k, v in per_pairs.items()})


# -- runs: protocol, checkpoints, resume ----------------------------------------------------------
def run_id(proto: dict) -> str:
    """``<preset>_<mixer>_L<length>_kv<pairs>_lr<lr>_s<seed>_<filler>`` (legacy: ``_steps<steps>`` too;
    loglinear_table2: ``<preset>_<mixer>_d<width>_lr<lr>_s<seed>_<filler>``)."""
    if proto["preset"] == table2.PRESET:
        return table2.run_id(proto)
    name = (f"{proto['preset']}_{proto['mixer']}_L{proto['length']}_kv{proto['num_kv_pairs']}_lr{proto['lr']:.3g}"
            f"_s{proto['seed']}_{proto['filler']}")
    return name + (f"_steps{proto['steps']}" if proto["data"] == "stream" else "")


def git_commit() -> str:
    """``$COMMIT`` (the device scripts set it: a device copy of the tree may sit inside another
    checkout, whose HEAD git would report), else git's short HEAD, else ``"unknown"``."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def describe_model(config) -> dict:
    if isinstance(config, ZoologyLMConfig):
        return config.describe()
    return dict(mixer=config.mixer, mixer_kwargs=config.mixer_kwargs, hidden_size=config.hidden_size,
                num_layers=config.num_hidden_layers, num_heads=config.num_heads, head_dim=config.head_dim,
                head_dim_v=config.head_dim_v, short_conv_size=config.short_conv_size, gate_act=config.gate_act,
                intermediate_size=config.intermediate_size, tie_word_embeddings=True)


def protocol(args, mixer, length, lr, seed, intermediate_size, params: int, d_model=None) -> dict:
    """Everything that defines one run (and some that describe where it ran); loglinear_table2 adds
    its width ``d_model`` and its data ``segments`` (train and test: [length, pairs, examples])."""
    config = model_config(args, mixer, intermediate_size, d_model)
    extra = {} if args.segments is None else dict(d_model=d_model, segments=args.segments, order="segments, no shuffle",
                                                  accuracy="mean over test examples of each one's query accuracy")
    sizes = ((args.num_train, args.num_test) if args.segments is None else
             tuple(sum(n for _, _, n in args.segments[part]) for part in ("train", "test")))
    return dict(
        preset=args.preset, mixer=mixer, model_config=describe_model(config),
        params=params, data=args.data, length=length, num_kv_pairs=per_length(args, "kv_pairs", length), lr=lr,
        lr_sweep=args.lr_sweep, seed=seed, filler=args.filler,
        batch_size=per_length(args, "batch_size", length), epochs=args.epochs, steps=args.steps,
        eval_every=args.eval_every, num_train=sizes[0], num_test=sizes[1], vocab_size=args.vocab_size, **extra,
        power_a=0.01, weight_decay=args.weight_decay, embedding_dropout=args.embedding_dropout,
        early_stop=args.early_stop, optimizer="AdamW(betas=(0.9, 0.999), eps=1e-8)", schedule=SCHEDULES[args.data],
        grad_clip=None, precision="bf16 autocast" if args.device.startswith("cuda") else "fp32",
        device=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device,
        chunk_backend=args.chunk_backend, kernels=kernel_family(), torch=str(torch.__version__), commit=git_commit(),
        runs_per_gpu=int(os.environ.get("MQAR_RUNS_PER_GPU", "1")),
    )


def rng_state(device: str) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.startswith("cuda"):
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: str) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def load_checkpoint(path: Path, proto: dict, model, opt, device: str) -> list:
    """Restore model, optimizer and RNG from ``path``; returns the curve so far. The run's protocol
    must match (``RESUME_KEYS``), else the error names what differs. Loaded on the CPU: the RNG states
    must stay CPU byte tensors (``torch.set_rng_state`` refuses a CUDA tensor), and ``load_state_dict``
    moves the weights and the optimizer's state to the parameters' device."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    differ = [k for k in RESUME_KEYS if ckpt["protocol"].get(k) != proto.get(k)]
    if differ:
        raise ValueError(f"checkpoint {path} was written for another protocol ({', '.join(differ)} differ): "
                         f"remove it or use another --state-dir")
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    restore_lr_tensors(opt)
    set_rng_state(ckpt["rng"], device)
    return ckpt["curve"]


def run_record(proto: dict, curve: list, status: str, stop_reason=None) -> dict:
    """run.json: protocol, curve and the summary numbers the report reads."""
    accs = [c["test_accuracy"] for c in curve]
    times = sorted(c["ms_per_step"] for c in curve)
    return dict(run_id=run_id(proto), protocol=proto, params=proto["params"], status=status, stop_reason=stop_reason,
                epochs_run=len(curve), epochs_planned=num_segments(proto), best_accuracy=max(accs, default=None),
                final_accuracy=accs[-1] if accs else None,
                ms_per_step=times[len(times) // 2] if times else None, curve=curve)


def stop_reason(curve: list, proto: dict):
    """'early_stop' above the threshold, 'epochs' / 'steps' after the last one, else None (go on)."""
    if curve and proto["early_stop"] is not None and curve[-1]["test_accuracy"] > proto["early_stop"]:
        return "early_stop"
    if len(curve) >= num_segments(proto):
        return "steps" if proto["data"] == "stream" else "epochs"
    return None


def time_left_for_epoch(curve: list, deadline) -> bool:
    """True without a deadline or when an epoch (train + test; the faster of the last two, since the
    first after a start also compiles the kernels) fits 1.2 times before it."""
    if deadline is None or not curve:
        return True
    last = min(c["train_seconds"] + c["eval_seconds"] for c in curve[-2:])
    return time.time() + 1.2 * last < deadline


def train_run(args, proto: dict, deadline=None, stop_after=None) -> dict:
    """Train (or resume) one run in ``<state-dir>/<run id>``; returns its run.json record."""
    folder = Path(args.state_dir) / run_id(proto)
    if (folder / "DONE").exists():
        return json.loads((folder / "run.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    device = args.device
    train, test = load_data(args, proto, device)
    model = build_model(model_config(args, proto["mixer"], proto["model_config"].get("intermediate_size"),
                                     proto.get("d_model")), proto["seed"], device)
    graphed = use_cuda_graph(args)
    opt = make_optimizer(model, proto["lr"], proto["weight_decay"], graphed)
    ckpt = folder / "ckpt.pt"
    curve = load_checkpoint(ckpt, proto, model, opt, device) if ckpt.exists() else []
    loss_fn = cross_entropy_loss(query_logits, model, proto["embedding_dropout"], max_queries(proto, train),
                                 compile=use_compile(args))
    step = make_step(loss_fn, opt, device, graphed)
    done_here, reason = 0, stop_reason(curve, proto)
    while reason is None and time_left_for_epoch(curve, deadline) and (stop_after is None or done_here < stop_after):
        curve.append(one_segment(args, model, step, opt, (train, test), proto, curve))
        save_atomic(dict(protocol=proto, model=model.state_dict(), optimizer=opt.state_dict(), rng=rng_state(device),
                         curve=curve), ckpt)
        reason, done_here = stop_reason(curve, proto), done_here + 1
        write_json_atomic(run_record(proto, curve, "running" if reason is None else "done", reason),
                          folder / "run.json")
        print(f"  {run_id(proto)} epoch {len(curve)}: {format_epoch(curve[-1])}", flush=True)
    record = run_record(proto, curve, "paused" if reason is None else "done", reason)
    write_json_atomic(record, folder / "run.json")
    if reason is not None:
        (folder / "DONE").write_text(reason + "\n")
        ckpt.unlink(missing_ok=True)
    return record


def one_segment(args, model, step, opt, data, proto, curve) -> dict:
    """Train one epoch (legacy: one block of steps), then test: the next point of the learning curve."""
    train, test = data
    segment = len(curve)
    point = dict(epoch=segment + 1, **train_segment(model, step, opt, segment_batches(proto, train, segment, args.device),
                                                    args.device))
    point["step"] = (curve[-1]["step"] if curve else 0) + point["steps"]
    start = time.time()
    score = evaluate_segments if proto["data"] == "mixture" else evaluate
    point.update(score(model, test, args.device, args.eval_batch_size))
    point["eval_seconds"] = round(time.time() - start, 2)
    return point


def format_epoch(point: dict) -> str:
    return (f"step {point['step']} lr {point['lr']:.2e} train loss {point['train_loss']:.3f} "
            f"test loss {point['test_loss']:.3f} acc {100 * point['test_accuracy']:.2f}% "
            f"({point['ms_per_step']} ms/step)")


# -- the sweep ----------------------------------------------------------------------------------
def plan(args):
    """Runs, smallest length first, then seed: (mixer, length, lr, seed, None); loglinear_table2:
    smallest width first, then seed, then the models from the cheapest (linear before log-linear):
    (mixer, length, lr, seed, width)."""
    runs = []
    widths = sorted(args.dims) if args.preset == table2.PRESET else [None]
    mixers = sorted(args.mixers, key=table2.model_order) if args.preset == table2.PRESET else args.mixers
    for length in sorted(args.lengths):
        for width in widths:
            for seed in args.seeds:
                for mixer in mixers:
                    for lr in (args.lrs if args.lrs is not None else lr_sweep(args.lr_sweep, length)):
                        runs.append((mixer, length, lr, seed, width))
    return runs


def planned_protocols(args, verbose: bool = False) -> list:
    """The protocol of every planned run (the SwiGLU widths balanced once per model; loglinear_table2:
    no MLP, a parameter count per model and width)."""
    widths = {mixer: balanced_intermediate_size(args, mixer) for mixer in args.mixers}
    params = {(mixer, d): count_params(model_config(args, mixer, widths[mixer], d))
              for mixer, _, _, _, d in plan(args)}
    if verbose:
        for (mixer, d), count in params.items():
            size = f"SwiGLU {widths[mixer]}" if d is None else f"d_model {d}, {table2.heads_for(d)} head(s)"
            print(f"  {args.preset}/{mixer}: {size}, {count / 1e6:.4f}M parameters", flush=True)
    return [protocol(args, mixer, length, lr, seed, widths[mixer], params[(mixer, d)], d)
            for mixer, length, lr, seed, d in plan(args)]


QUEUE_KEPT = ("epochs", "steps", "eval_every", "num_train", "num_test", "weight_decay", "embedding_dropout",
              "early_stop", "vocab_size", "d_model", "num_heads", "head_dim", "target_params", "intermediate_size",
              "eval_batch_size")


def queue_line(args, proto: dict) -> str:
    """'<run id> <arguments>' for one run (the settings given to --write-queue kept): the workers of
    tools/mqar_device.sh skip ids that are finished."""
    words = [f"--preset {proto['preset']}", f"--mixers {proto['mixer']}",
             f"--lrs {proto['lr']!r}", f"--lr-sweep {proto['lr_sweep']}", f"--seeds {proto['seed']}",
             f"--filler {proto['filler']}"]
    words.insert(2, f"--lengths {proto['length']}" if proto.get("d_model") is None else f"--dims {proto['d_model']}")
    if {"kv_pairs", "batch_size"} & args.explicit:
        words += [f"--kv-pairs {proto['num_kv_pairs']}"] if proto["num_kv_pairs"] is not None else []
        words += [f"--batch-size {proto['batch_size']}"]
    words += [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in QUEUE_KEPT if name in args.explicit]
    return run_id(proto) + " " + " ".join(words + (["--tiny"] if args.tiny else []))



def main(argv=None):
    args = parse_args(argv)
    deadline = None if args.deadline_s is None else time.time() + args.deadline_s
    set_chunk_backend(args.chunk_backend)
    torch.set_num_threads(args.cpu_threads)
    protos = planned_protocols(args, verbose=True)
    if args.write_queue:
        Path(args.write_queue).write_text("".join(queue_line(args, p) + "\n" for p in protos))
        print(f"wrote {len(protos)} runs to {args.write_queue}")
        return []
    records = []
    for proto in protos:
        records.append(train_run(args, proto, deadline, args.stop_after_epochs))
        r = records[-1]
        print(f"{r['run_id']}: {r['status']} after {r['epochs_run']} epochs, "
              f"best {100 * (r['best_accuracy'] or 0):.2f}%",
              flush=True)
    return records
