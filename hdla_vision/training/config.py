"""Training configuration: a typed schema, read from YAML with a safe loader.

A config file is a mapping of sections (``model``, ``data``, ``optim``, ``sched``,
``train``) to keys. Every key must exist in the schema below: an unknown key, a missing
section name or a value of the wrong type raises ``ValueError`` naming the dotted key.
Command-line overrides use the same dotted names: ``optim.base_lr=1e-3``.

Values are read as YAML with one change: only ``true`` / ``false`` are booleans (YAML 1.2),
so ``train.mixed_precision=no`` stays the string ``"no"``. Boolean keys also take
``yes`` / ``no`` / ``on`` / ``off``, and string keys with an "off" setting
(``train.mixed_precision``, ``data.auto_augment``) take ``no`` / ``off`` / ``false`` / ``none``.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

# train.compile_mode: inductor's torch.compile modes; "reduce-overhead" and "max-autotune" replay CUDA graphs
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class ModelConfig:
    name: Optional[str] = None  # timm model name; None: init_checkpoint's model, else hdla_tiny
    kwargs: dict = field(default_factory=dict)  # extra timm.create_model kwargs (depth, embed_dim, ...),
    # merged over those recorded in init_checkpoint's metadata
    drop_path_rate: float = 0.1
    init_checkpoint: Optional[str] = None  # weights to start from (fine-tuning): .safetensors or a run dir
    linear_probe: bool = False  # freeze everything but the classifier


@dataclass
class DataConfig:
    dataset: str = ""  # timm dataset name; "" = ImageFolder (train/, val/ under data_dir)
    data_dir: Optional[str] = None  # "quickstart" = the generated dataset in the cache dir
    train_split: str = "train"
    val_split: str = "val"
    num_classes: int = 1000
    img_size: int = 224
    crop_pct: Optional[float] = None  # None: from the model's pretrained_cfg
    interpolation: str = "bicubic"
    mean: Optional[list] = None  # None: from the model's pretrained_cfg
    std: Optional[list] = None
    scale: list = field(default_factory=lambda: [0.08, 1.0])  # RandomResizedCrop area range
    hflip: float = 0.5
    color_jitter: float = 0.3
    auto_augment: Optional[str] = "rand-m9-mstd0.5-inc1"
    reprob: float = 0.25
    mixup: float = 0.0
    cutmix: float = 0.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    label_smoothing: float = 0.1
    repeated_aug: bool = False
    num_repeats: int = 3
    num_workers: int = 8
    pin_memory: bool = True
    quickstart_train_per_class: int = 500
    quickstart_val_per_class: int = 100


@dataclass
class OptimConfig:
    opt: str = "adamw"
    base_lr: float = 5e-4  # peak lr = base_lr * global_batch_size / lr_base_size
    lr_base_size: int = 512
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.05
    layer_decay: Optional[float] = None  # layer-wise lr decay (fine-tuning), e.g. 0.75
    clip_grad: Optional[float] = None  # max global grad norm


@dataclass
class SchedConfig:
    epochs: int = 300
    warmup_epochs: float = 5.0
    warmup_lr: float = 1e-6
    min_lr: float = 1e-5


@dataclass
class TrainConfig:
    global_batch_size: int = 1024  # summed over processes and accumulation steps
    grad_accum_steps: int = 1
    mixed_precision: str = "bf16"  # "no", "bf16", "fp16"
    seed: int = 0
    ema: bool = True
    ema_decay: float = 0.99996
    ema_warmup: bool = False  # timm ModelEmaV3 decay warmup (for short runs)
    eval_every_epochs: int = 1
    checkpoint_every_steps: int = 0  # 0: only at the end of each epoch
    keep_checkpoints: int = 2
    log_every_steps: int = 20
    progress_bar: bool = True
    log_with: list = field(default_factory=lambda: ["tensorboard"])  # Accelerate trackers ("wandb", ...; [] none)
    consistency_checks: bool = False  # record every sample index and cross-check parameters across processes
    compile: bool = False  # torch.compile the model for the training step (after accelerator.prepare)
    compile_backend: str = "inductor"  # torch.compile backend with train.compile ("aot_eager": no code generation)
    compile_mode: str = "default"  # inductor's mode (COMPILE_MODES): "reduce-overhead" runs CUDA graphs


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader whose only booleans are true/false (yes/no/on/off stay strings)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def parse_yaml(text: str) -> Any:
    """Safe YAML parsing with YAML 1.2 booleans (see the module docstring)."""
    return yaml.load(text, Loader=_Loader)


_BOOL_WORDS = {"yes": True, "on": True, "true": True, "no": False, "off": False, "false": False}
_OFF_WORDS = ("no", "off", "false", "none")
_OFF_SETTING = {"train.mixed_precision": "no", "data.auto_augment": None}  # string keys that can be switched off


def _allowed_types(annotation: str, owner: type) -> tuple:
    hint = typing.get_type_hints(owner)[annotation]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(typing.get_origin(a) or a for a in args)
    return (typing.get_origin(hint) or hint,)


def _coerce(value: Any, allowed: tuple, dotted: str) -> Any:
    if dotted in _OFF_SETTING and (value is False or (isinstance(value, str) and value.lower() in _OFF_WORDS)):
        return _OFF_SETTING[dotted]
    if isinstance(value, str) and bool in allowed and value.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.lower()]
    if isinstance(value, bool) and bool not in allowed:
        raise ValueError(f"config key '{dotted}': expected {_names(allowed)}, got bool {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and float in allowed and int not in allowed:
        return float(value)
    if isinstance(value, str) and float in allowed and str not in allowed:
        try:  # YAML 1.1 reads "1e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if isinstance(value, tuple) and list in allowed:
        return list(value)
    if not isinstance(value, allowed):
        raise ValueError(f"config key '{dotted}': expected {_names(allowed)}, got {type(value).__name__} {value!r}")
    return value


def _names(allowed: tuple) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in allowed)


def _apply_section(section: Any, values: dict, prefix: str) -> None:
    if not isinstance(values, dict):
        raise ValueError(f"config section '{prefix}' must be a mapping, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(section)}
    for key, value in values.items():
        dotted = f"{prefix}.{key}"
        if key not in known:
            raise ValueError(f"unknown config key '{dotted}' (known keys of '{prefix}': {sorted(known)})")
        setattr(section, key, _coerce(value, _allowed_types(key, type(section)), dotted))


def config_from_dict(values: dict) -> Config:
    """Build a Config from nested dicts, rejecting unknown sections and keys."""
    config = Config()
    if values is None:
        return config
    if not isinstance(values, dict):
        raise ValueError(f"a config must be a mapping of sections, got {type(values).__name__}")
    sections = {f.name for f in dataclasses.fields(Config)}
    for name, section_values in values.items():
        if name not in sections:
            raise ValueError(f"unknown config section '{name}' (known sections: {sorted(sections)})")
        _apply_section(getattr(config, name), section_values or {}, name)
    validate(config)
    return config


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a YAML config (safe loader) and apply ``section.key=value`` overrides."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file '{path}' does not exist")
    try:
        values = parse_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"config file '{path}' is not valid YAML: {err}") from err
    for override in overrides:
        _merge_override(values, override)
    return config_from_dict(values)


def _merge_override(values: dict, override: str) -> None:
    if "=" not in override:
        raise ValueError(f"override '{override}' must look like section.key=value")
    dotted, raw = override.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"override '{override}': the key must be section.key, got '{dotted}'")
    section, key = parts
    if not isinstance(values.setdefault(section, {}), dict):
        raise ValueError(f"override '{override}': section '{section}' is not a mapping")
    try:
        values[section][key] = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        reason = getattr(err, "problem", None) or err
        raise ValueError(f"override '{override}': the value is not valid YAML ({reason})") from err


def validate(config: Config) -> None:
    """Check value ranges that types alone cannot express."""
    checks = [
        (config.train.global_batch_size > 0, "train.global_batch_size", "a positive integer"),
        (config.train.grad_accum_steps > 0, "train.grad_accum_steps", "a positive integer"),
        (config.train.mixed_precision in ("no", "bf16", "fp16"), "train.mixed_precision", "'no', 'bf16' or 'fp16'"),
        (config.data.num_classes > 0, "data.num_classes", "a positive integer"),
        (config.data.img_size > 0, "data.img_size", "a positive integer"),
        (config.sched.epochs > 0, "sched.epochs", "a positive integer"),
        (config.sched.warmup_epochs >= 0, "sched.warmup_epochs", ">= 0"),
        (0.0 <= config.data.label_smoothing < 1.0, "data.label_smoothing", "in [0, 1)"),
        (len(config.optim.betas) == 2, "optim.betas", "two numbers"),
        (len(config.data.scale) == 2, "data.scale", "two numbers"),
        (config.optim.layer_decay is None or 0 < config.optim.layer_decay <= 1, "optim.layer_decay", "in (0, 1]"),
        (config.train.keep_checkpoints >= 1, "train.keep_checkpoints", ">= 1"),
        (config.train.checkpoint_every_steps >= 0, "train.checkpoint_every_steps", ">= 0"),
        (all(isinstance(name, str) and name for name in config.train.log_with), "train.log_with",
         "a list of Accelerate tracker names"),
        (config.train.compile_backend.isidentifier(), "train.compile_backend",
         "a torch.compile backend name ('inductor', 'aot_eager', ...)"),
        (config.train.compile_mode in COMPILE_MODES, "train.compile_mode",
         "one of " + ", ".join(map(repr, COMPILE_MODES))),
        (config.train.compile_mode == "default" or config.train.compile_backend == "inductor", "train.compile_mode",
         "'default' unless train.compile_backend is 'inductor' (the modes are inductor's)"),
    ]
    for ok, key, expected in checks:
        if not ok:
            raise ValueError(f"config key '{key}' must be {expected}, got {_lookup(config, key)!r}")


def _lookup(config: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)
