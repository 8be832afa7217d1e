"""The package's imports run one way (issue 18, "Done when"):

    kernels -> layers (mixers) -> backbones / lm -> training

A module may import from its own part or from a lower layer, never from a higher one, and the two
parts of one layer (backbones, lm) not from each other. Every ``.py`` under ``hdla_vision/`` and
``kernels/`` (installed as ``hdla_vision.kernels``) is parsed with ``ast``; every ``import`` and
``from ... import`` (also inside functions: a lazy import is still a dependency) and every
``importlib.import_module`` / ``__import__`` of a constant name is resolved to a module of the
package, relative imports included.
"""
import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hdla_vision"
SOURCE_DIRS = {"hdla_vision": ROOT / "hdla_vision", "hdla_vision.kernels": ROOT / "kernels"}

# The layers, from the README's "What is in it": the part (a module prefix) -> its layer.
# Higher numbers may import lower ones. ``_extras`` (the missing-extra messages) imports nothing of
# the package and is used by every part that has an extra. The package's ``__init__`` (registers
# the timm models) and ``export`` (the ``python -m hdla_vision.export`` CLI over the backbones) sit
# on top and may import anything.
LAYERS = {
    "hdla_vision._extras": 0,
    "hdla_vision.kernels": 1,
    "hdla_vision.layers": 2,
    "hdla_vision.backbones": 3,
    "hdla_vision.lm": 3,
    "hdla_vision.training": 4,
    "hdla_vision.export": 5,
    "hdla_vision": 5,  # the package's __init__ only: every submodule has a longer part above
}
TOP_LAYER = 5


def module_files() -> Dict[str, Path]:
    """Every module of the package by its installed name (a package by its ``__init__.py``)."""
    modules = {}
    for prefix, folder in SOURCE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([prefix, *parts])
            if name in modules:  # kernels/ lies outside hdla_vision/, so no name is found twice
                raise AssertionError(f"{name} is both {modules[name]} and {path}")
            modules[name] = path
    return modules


MODULES = module_files()


def part_of(module: str) -> Optional[str]:
    """The longest prefix of ``module`` in :data:`LAYERS` (None outside the package)."""
    matches = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def _absolute(importer: str, level: int, module: Optional[str]) -> str:
    """``from <level dots><module> import ...`` inside ``importer`` as an absolute module name."""
    if level == 0:
        return module or ""
    package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
    base = package.split(".")
    if level - 1 >= len(base):
        raise AssertionError(f"{importer}: relative import beyond the top-level package")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _in_package(name: str) -> Optional[str]:
    """The package module ``name`` refers to (``kernels.x`` is ``hdla_vision.kernels.x``), or None."""
    if name == "kernels" or name.startswith("kernels."):
        name = "hdla_vision." + name
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    while name not in MODULES:  # an attribute of a module (``from m import f``): its module
        name = name.rpartition(".")[0]
    return name


def imports_of(importer: str) -> Iterator[Tuple[int, str]]:
    """``(line, imported package module)`` for every import in ``importer``."""
    tree = ast.parse(MODULES[importer].read_text(), filename=str(MODULES[importer]))
    for node in ast.walk(tree):
        names: List[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(importer, node.level, node.module)
            # ``from pkg import sub`` imports the submodule sub where there is one
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _called_name(node.func) in ("import_module", "__import__")):
            names = [node.args[0].value]
        for name in names:
            target = _in_package(name)
            if target is not None:
                yield node.lineno, target


def _called_name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def edges() -> Set[Tuple[str, int, str]]:
    """``(importer, line, imported)`` over the whole package."""
    return {(importer, line, target) for importer in MODULES for line, target in imports_of(importer)}


def violations(found) -> List[str]:
    """The imports that go up a layer, or across between the two parts of one layer."""
    bad = []
    for importer, line, target in sorted(found):
        src, dst = part_of(importer), part_of(target)
        if src == dst or LAYERS[src] == TOP_LAYER or LAYERS[dst] < LAYERS[src]:
            continue
        direction = "up" if LAYERS[dst] > LAYERS[src] else "across"
        bad.append(f"{MODULES[importer].relative_to(ROOT)}:{line}: {importer} ({src}, layer {LAYERS[src]}) "
                   f"imports {target} ({dst}, layer {LAYERS[dst]}): {direction}")
    return bad


def test_every_module_has_a_layer():
    assert len(MODULES) > 40
    assert not [m for m in MODULES if part_of(m) is None]
    assert {part_of(m) for m in MODULES} == set(LAYERS)  # every part of the map exists


def test_the_walker_sees_the_imports_it_must_see():
    """Relative, absolute, ``from pkg import submodule`` and lazy (in-function) imports all resolve."""
    found = {(importer, target) for importer, _, target in edges()}
    expected = {
        ("hdla_vision.lm.modeling_hdla", "hdla_vision.layers"),  # from ..layers import f
        ("hdla_vision.lm.modeling_hdla", "hdla_vision.layers.gates"),  # from ..layers.gates import f
        ("hdla_vision.lm.configuration_hdla", "hdla_vision.layers.mixer"),  # from ..layers.mixer import f
        ("hdla_vision.layers.seed", "hdla_vision.kernels"),  # from hdla_vision.kernels import f
        ("hdla_vision", "hdla_vision.backbones"),  # from . import backbones
        ("hdla_vision.kernels.hdla.fused_recurrent", "hdla_vision.kernels.custom_ops"),  # lazy, in a function
        ("hdla_vision.training.runner", "hdla_vision.training.checkpoint"),  # from hdla_vision.training import checkpoint
    }
    assert expected <= found, expected - found


def test_the_check_flags_upward_and_sideways_imports():
    fake = {("hdla_vision.kernels.ops", 1, "hdla_vision.layers.hdla"),
            ("hdla_vision.layers.hdla", 2, "hdla_vision.lm.modeling_hdla"),
            ("hdla_vision.backbones.hdla", 3, "hdla_vision.lm.cache"),
            ("hdla_vision.lm.modeling_hdla", 4, "hdla_vision.training.config"),
            ("hdla_vision.training.runner", 5, "hdla_vision.lm"),  # down: fine
            ("hdla_vision.export", 6, "hdla_vision.training.models")}  # the top: fine
    flagged = {v.split(": ")[1].split()[0]: v.split(": ")[-1] for v in violations(fake)}
    assert flagged == {"hdla_vision.kernels.ops": "up", "hdla_vision.layers.hdla": "up",
                       "hdla_vision.backbones.hdla": "across", "hdla_vision.lm.modeling_hdla": "up"}


@pytest.mark.parametrize("layer", sorted(set(LAYERS.values())))
def test_imports_run_one_way(layer):
    found = {e for e in edges() if LAYERS[part_of(e[0])] == layer}
    bad = violations(found)
    assert not bad, "imports against the layer order kernels -> layers -> backbones / lm -> training:\n" + "\n".join(bad)
