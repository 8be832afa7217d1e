"""Model creation through ``timm.create_model``: from scratch, or from exported weights.

Fine-tuning (``model.init_checkpoint``) loads weights through timm's own pretrained path,
``pretrained_cfg_overlay=dict(file=...)``: a new ``num_classes`` re-initialises the
classifier and a new ``img_size`` resamples the position embedding (the model's
``checkpoint_filter_fn``). ``linear_probe`` freezes everything but the classifier.
Exports record the model name and ``model_kwargs`` in their metadata; ``resolve_model_config``
takes them from there, so any export of this project fine-tunes without repeating its
architecture in the config.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import timm
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hdla_vision.training.config import Config

EXPORT_FILE = "model.safetensors"
DEFAULT_MODEL = "hdla_tiny"
_RUN_SETTINGS = ("num_classes", "img_size", "drop_path_rate", "pretrained")  # config keys of their own, not kwargs
_UNSET = "unset"


def check_model_name(name: str) -> None:
    """Raise ``ValueError`` for a name timm does not know, suggesting close matches."""
    if timm.is_model(name):
        return
    stem = name.split("_")[0]
    close = timm.list_models(f"*{stem}*")[:10] if stem else []
    hint = f" Similar names: {close}." if close else ""
    raise ValueError(f"unknown model '{name}': timm has no model of that name "
                     f"(is the package that registers it imported?).{hint}")


def export_metadata(model_name: str, num_classes: int, img_size: int, model_kwargs: dict, **extra) -> dict:
    """String metadata stored in exported safetensors files."""
    meta = {"format": "pt", "model_name": model_name, "num_classes": str(num_classes),
            "img_size": str(img_size), "model_kwargs": json.dumps(model_kwargs, sort_keys=True)}
    meta.update({k: str(v) for k, v in extra.items()})
    return meta


def export_weights(model: torch.nn.Module, path: str | Path, metadata: dict) -> None:
    """Write ``model``'s state dict as safetensors (to a temp file, then renamed into place)."""
    path = Path(path)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(state, str(tmp), metadata=metadata)
    tmp.replace(path)


def read_export_metadata(path: str | Path) -> dict:
    """The metadata of an exported safetensors file; ``ValueError`` if it is unreadable."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint '{path}' does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"checkpoint '{path}' is not a readable safetensors file (corrupt or truncated?): {err}") from err


def resolve_weights_file(path: str | Path) -> Path:
    """A safetensors export, given directly or as a run / checkpoint directory containing one."""
    path = Path(path)
    if path.is_dir():
        for candidate in (path / EXPORT_FILE, path / "export" / EXPORT_FILE):
            if candidate.is_file():
                return candidate
        raise ValueError(f"checkpoint directory '{path}' contains no {EXPORT_FILE}")
    if path.suffix != ".safetensors":
        raise ValueError(f"checkpoint '{path}' must be a .safetensors file or a directory holding {EXPORT_FILE}")
    return path


def _create(name: str, img_size: int, **kwargs) -> torch.nn.Module:
    """timm.create_model, passing ``img_size`` only to models that take it (ViT-like)."""
    try:
        return timm.create_model(name, img_size=img_size, **kwargs)
    except TypeError as err:
        if "img_size" not in str(err):
            raise
        return timm.create_model(name, **kwargs)


def resolve_model_config(config: Config, checkpoint: Optional[str] = None) -> None:
    """Fill ``model.name`` and ``model.kwargs`` from an export's metadata, in place.

    ``checkpoint`` (default ``model.init_checkpoint``) records the model name and the
    ``model_kwargs`` it was built with. Values set in the config win: ``model.kwargs`` is
    merged over the saved ones key by key, and a ``model.name`` other than the saved one is
    an error. Without a checkpoint an unset ``model.name`` means ``hdla_tiny``.
    """
    m = config.model
    checkpoint = checkpoint if checkpoint is not None else m.init_checkpoint
    meta = read_export_metadata(resolve_weights_file(checkpoint)) if checkpoint else {}
    saved_name = meta.get("model_name")
    if m.name is None:
        m.name = saved_name or DEFAULT_MODEL
    elif saved_name is not None and saved_name != m.name:
        raise ValueError(f"checkpoint '{checkpoint}' holds a '{saved_name}' model, the config asks for '{m.name}' "
                         "(leave model.name unset to take the checkpoint's)")
    m.kwargs = {**saved_model_kwargs(meta, checkpoint), **m.kwargs}


def saved_model_kwargs(meta: dict, source) -> dict:
    """The architecture kwargs an export records (run settings such as num_classes left out)."""
    try:
        kwargs = json.loads(meta.get("model_kwargs", "{}"))
    except json.JSONDecodeError as err:
        raise ValueError(f"checkpoint '{source}': its model_kwargs metadata is not JSON: {err}") from err
    if not isinstance(kwargs, dict):
        raise ValueError(f"checkpoint '{source}': its model_kwargs metadata is not a mapping: {kwargs!r}")
    return {k: v for k, v in kwargs.items() if k not in _RUN_SETTINGS}


def create_model(config: Config) -> torch.nn.Module:
    """The model named in ``config.model``: fresh, or initialised from ``model.init_checkpoint``.

    Calls ``resolve_model_config`` first, so ``config.model`` afterwards names the model built.
    """
    resolve_model_config(config)
    m = config.model
    check_model_name(m.name)
    kwargs = dict(m.kwargs)
    kwargs.setdefault("num_classes", config.data.num_classes)
    kwargs.setdefault("drop_path_rate", m.drop_path_rate)
    img_size = kwargs.pop("img_size", config.data.img_size)
    if m.init_checkpoint is None:
        model = _create(m.name, img_size, **kwargs)
    else:
        model = _create_from_checkpoint(m.name, img_size, m.init_checkpoint, kwargs)
    if m.linear_probe:
        freeze_all_but_classifier(model)
    return model


def _create_from_checkpoint(name: str, img_size: int, checkpoint: str, kwargs: dict) -> torch.nn.Module:
    weights = resolve_weights_file(checkpoint)
    meta = read_export_metadata(weights)
    overlay = {"file": str(weights)}
    if "num_classes" in meta:  # the classifier size actually stored, so timm drops it only when it differs
        overlay["num_classes"] = int(meta["num_classes"])
    try:
        return _create(name, img_size, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    except RuntimeError as err:
        fresh = _create(name, img_size, **kwargs)
        raise ValueError(f"checkpoint '{weights}' does not match model '{name}': "
                         f"{mismatch_summary(weights, meta, kwargs, fresh)}") from err


def mismatch_summary(weights: Path, meta: dict, kwargs: Optional[dict], model: torch.nn.Module) -> str:
    """One line saying why ``weights`` does not fit ``model``: differing kwargs, else differing tensors."""
    saved = saved_model_kwargs(meta, weights)
    used = {k: v for k, v in (kwargs or {}).items() if k not in _RUN_SETTINGS}
    differing = sorted(k for k in saved.keys() | used.keys() if saved.get(k, _UNSET) != used.get(k, _UNSET))
    if "model_kwargs" in meta and kwargs is not None and differing:
        pairs = "; ".join(f"{k}: checkpoint {saved.get(k, _UNSET)}, config {used.get(k, _UNSET)}" for k in differing)
        return f"model.kwargs differ from the checkpoint's model_kwargs ({pairs})"
    with safe_open(str(weights), framework="pt") as handle:
        stored = {k: list(handle.get_slice(k).get_shape()) for k in handle.keys()}
    current = {k: list(v.shape) for k, v in model.state_dict().items()}
    groups = (("size mismatch for {} tensors", [k for k in current.keys() & stored.keys() if current[k] != stored[k]]),
              ("{} tensors missing from the checkpoint", current.keys() - stored.keys()),
              ("{} tensors not in the model", stored.keys() - current.keys()))
    parts = [text.format(len(keys)) + _first(keys, stored, current) for text, keys in groups if keys]
    hint = "" if "model_kwargs" in meta else "; the file records no model_kwargs: set model.kwargs to its architecture"
    return ", ".join(parts) + hint


def _first(keys, stored: dict, current: dict) -> str:
    key = sorted(keys)[0]
    shapes = f": checkpoint {stored[key]}, model {current[key]}" if key in stored and key in current else ""
    return f" (first '{key}'{shapes})"


def freeze_all_but_classifier(model: torch.nn.Module) -> None:
    """Linear probe: only the parameters of ``model.get_classifier()`` stay trainable."""
    head = model.get_classifier()
    if not isinstance(head, torch.nn.Module) or not any(True for _ in head.parameters()):
        raise ValueError(f"model.linear_probe: {type(model).__name__} has no classifier with parameters")
    for param in model.parameters():
        param.requires_grad_(False)
    for param in head.parameters():
        param.requires_grad_(True)


def load_weights(model: torch.nn.Module, path: str | Path, expected_name: Optional[str] = None,
                 model_kwargs: Optional[dict] = None) -> dict:
    """Load an exported safetensors file into ``model`` strictly; return its metadata.

    Raises ``ValueError`` naming the file when it is unreadable, holds another model, or
    its tensors do not match the model's; the mismatch is one line (the ``model_kwargs``
    that differ from ``model_kwargs``, else counts of differing tensors).
    """
    from safetensors.torch import load_file

    weights = resolve_weights_file(path)
    meta = read_export_metadata(weights)
    if expected_name and meta.get("model_name", expected_name) != expected_name:
        raise ValueError(f"checkpoint '{weights}' holds a '{meta['model_name']}' model, expected '{expected_name}'")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"checkpoint '{weights}' is corrupt or truncated: {err}") from err
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"checkpoint '{weights}' does not match the model: "
                         f"{mismatch_summary(weights, meta, model_kwargs, model)}") from err
    return meta
