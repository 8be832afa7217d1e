"""The vision side works on the base install, without the "lm" and "train" extras.

Checks: every timm model this package registers runs forward in a fresh process in which
``transformers``, ``accelerate``, ``tensorboard`` and ``matplotlib`` cannot be imported; the
parts that need an extra say which one; and no module under ``hdla_vision/layers``, ``backbones`` or
``training`` imports ``hdla_vision.lm`` (read from the source, lazy imports inside functions too).
"""
import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hdla_vision"
VISION_PARTS = ("layers", "backbones", "training")

EXTRAS_PACKAGES = ("transformers", "accelerate", "tensorboard", "matplotlib")  # of the "lm" and "train" extras


def refusing(*packages: str) -> str:
    """The start of a script in which ``packages`` (and their submodules) cannot be imported."""
    return f"REFUSED = {packages!r}\n" + textwrap.dedent(
        """
        import json, sys

        class Refuse:
            '''A meta-path finder that makes the REFUSED packages unimportable.'''
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in REFUSED:
                    raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)", name=name)
                return None

        sys.meta_path.insert(0, Refuse())
        for package in REFUSED:
            try:
                __import__(package)
                raise SystemExit(f"the finder did not refuse {package}")
            except ImportError:
                pass
        """
    )


REFUSE_TRANSFORMERS = refusing("transformers")

BASE_INSTALL = refusing(*EXTRAS_PACKAGES) + textwrap.dedent(
    """
    import timm, torch
    import hdla_vision  # noqa: F401  registers the models
    from timm.models import model_entrypoint

    ours = sorted(n for n in timm.list_models() if model_entrypoint(n).__module__.startswith("hdla_vision."))
    ran = []
    for name in ours:
        torch.manual_seed(0)
        model = timm.create_model(name, img_size=32, depth=1, num_classes=3).eval()
        with torch.no_grad():
            out = model(torch.randn(1, 3, 32, 32))
        assert out.shape == (1, 3) and torch.isfinite(out).all(), name
        ran.append(name)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in REFUSED or m.startswith("hdla_vision.lm"))
    print(json.dumps({"ran": ran, "loaded": loaded}))
    """
)


def run_python(script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter at the repository root."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_every_timm_model_runs_on_the_base_install():
    """Without the extras' packages (transformers, Accelerate, TensorBoard, matplotlib)."""
    proc = run_python(BASE_INSTALL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = {"hdla_tiny", "hdla_small", "hdla_base", "gla_tiny", "deltanet_tiny", "gdn_tiny", "kda_tiny",
                "rwkv7_tiny", "gdp2_tiny", "gdp3_tiny", "hihdn_tiny", "hihgdn_tiny"}
    assert expected <= set(result["ran"]), result["ran"]
    assert result["loaded"] == [], f"modules loaded without being needed: {result['loaded']}"


LM_WITHOUT_TRANSFORMERS = REFUSE_TRANSFORMERS + textwrap.dedent(
    """
    try:
        import hdla_vision.lm  # noqa: F401
    except ImportError as err:
        print(json.dumps({"type": type(err).__name__, "message": str(err), "name": err.name}))
    else:
        raise SystemExit("hdla_vision.lm imported without transformers")
    """
)


TRAINING_WITHOUT_ACCELERATE = refusing("accelerate") + textwrap.dedent(
    """
    try:
        import hdla_vision.training  # noqa: F401
    except ImportError as err:
        print(json.dumps({"type": type(err).__name__, "message": str(err), "name": err.name}))
    else:
        raise SystemExit("hdla_vision.training imported without accelerate")
    """
)


def test_training_without_accelerate_names_the_extra():
    """``import hdla_vision.training`` without the "train" extra says which extra to install."""
    proc = run_python(TRAINING_WITHOUT_ACCELERATE)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["type"] == "ModuleNotFoundError" and result["name"] == "accelerate", result
    assert result["message"].startswith("hdla_vision.training needs accelerate"), result["message"]
    assert 'pip install "hdla-vision[train]"' in result["message"] and "\n" not in result["message"]


def test_lm_without_transformers_names_the_extra():
    """``import hdla_vision.lm`` on the base install says which extra to install, in one line."""
    proc = run_python(LM_WITHOUT_TRANSFORMERS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["type"] == "ModuleNotFoundError" and result["name"] == "transformers", result
    assert result["message"].startswith("hdla_vision.lm needs transformers"), result["message"]
    assert 'pip install "hdla-vision[lm]"' in result["message"] and "\n" not in result["message"]


def test_missing_extra_blames_only_the_missing_package():
    """An ImportError about another module (a broken transformers install) passes through unchanged."""
    from hdla_vision._extras import raise_missing_extra

    other = ModuleNotFoundError("No module named 'tokenizers'", name="tokenizers")
    with pytest.raises(ImportError) as caught:
        raise_missing_extra(other, "transformers", "lm", "hdla_vision.lm")
    assert caught.value is other
    missing = ModuleNotFoundError("No module named 'transformers.cache_utils'", name="transformers.cache_utils")
    with pytest.raises(ImportError, match=r'pip install "hdla-vision\[lm\]"') as caught:
        raise_missing_extra(missing, "transformers", "lm", "hdla_vision.lm")
    assert caught.value.__cause__ is missing


def imported_modules(source: str, module: str, is_package: bool = False) -> List[Tuple[int, str]]:
    """Absolute names of every module ``source`` imports (``(line, name)``), wherever the import
    statement sits; ``from X import y`` also yields ``X.y`` (y may be a submodule). ``module`` is
    the dotted name of the file, for relative imports. Calls ``importlib.import_module("...")`` /
    ``__import__("...")`` with a literal name count too."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{parent}.{base}" if base else parent
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def imports_of_lm(source: str, module: str, is_package: bool = False) -> List[str]:
    """``module:line name`` for each import of ``hdla_vision.lm`` or one of its submodules."""
    hits = {}
    for line, name in imported_modules(source, module, is_package):
        if (name == "hdla_vision.lm" or name.startswith("hdla_vision.lm.")) and line not in hits:
            hits[line] = f"{module}:{line} {name}"  # one per statement
    return list(hits.values())


@pytest.mark.parametrize("source,module,expected", [
    ("from ..lm.mixers import f", "hdla_vision.layers.x", 1),
    ("def f():\n    from hdla_vision.lm import mixers", "hdla_vision.training.y", 1),
    ("from .. import lm", "hdla_vision.backbones.z", 1),
    ("import hdla_vision.lm.cache as c", "hdla_vision.layers.x", 1),
    ("importlib.import_module('hdla_vision.lm')", "hdla_vision.layers.x", 1),
    ("from . import lm_helpers\nfrom ..layers import lm", "hdla_vision.layers.x", 0),  # hdla_vision.layers.lm
    ("from ..kernels import chunk_hdla", "hdla_vision.layers.x", 0),
])
def test_import_walker_finds_lm_imports(source, module, expected):
    """The walker below can fail: it finds each way of writing the import."""
    assert len(imports_of_lm(source, module)) == expected


def test_vision_modules_never_import_the_lm():
    checked, offenders = 0, []
    for part in VISION_PARTS:
        for path in sorted((PACKAGE / part).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            is_package = rel.name == "__init__"
            module = ".".join(rel.parent.parts if is_package else rel.parts)
            offenders += imports_of_lm(path.read_text(), module, is_package)
            checked += 1
    assert checked >= 15, f"only {checked} modules found under {VISION_PARTS}"
    assert not offenders, f"hdla_vision.lm needs transformers; these vision modules import it: {offenders}"
