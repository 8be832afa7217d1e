"""timm's own model test-suite, fetched from the installed timm release's source distribution and
patched to list our models the way it lists timm's ViT family.

Nothing of timm's is kept in this repository: ``suite_dir()`` downloads ``timm-<version>.tar.gz``
with ``pip download`` once per version into ``$HDLA_VISION_CACHE/timm_sdist`` (default
``~/.cache/hdla_vision``), extracts its ``tests/test_models.py``, ``tests/conftest.py`` and
``pyproject.toml`` (timm's pytest markers) into a fresh directory, and adds to the suite's filter
lists, in place:
- ``import hdla_vision`` after timm's imports (registers our models before the suite lists them);
- ``FEAT_INTER_FILTERS``: our modules, which have ``forward_intermediates`` (as timm's ViTs);
- ``NON_STD_FILTERS``: our model names (token outputs, as ``vit_*``);
- ``EXCLUDE_JIT_FILTERS``: our model names (TorchScript cannot script the Triton kernels).
A patch anchor that this timm release does not have raises ``SuiteFetchError``, so a new timm
fails loudly instead of running an unpatched suite. A download that fails because no package
index can be reached raises ``IndexUnreachable`` (the tests skip on it); any other failure raises.

``python -m tools.timm_suite`` prints the patched suite's directory (to run it by hand:
``python -m pytest -c <dir>/pyproject.toml <dir>/tests/test_models.py -k hdla_tiny``).
"""
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import timm

from hdla_vision.training.quickstart import default_cache_dir

OUR_MODULES = ("hdla", "seed", "loglinear")  # timm's module names of our registered models
IMPORT_ANCHOR = "from timm.models import get_notrace_modules, get_notrace_functions\n"
OUR_NAMES = "HDLA_VISION_MODELS"
REGISTER_OURS = (
    "import hdla_vision  # hdla-vision: registers our models\n"
    f"{OUR_NAMES} = list_models(module={list(OUR_MODULES)!r})\n"
)
LIST_ADDITIONS = {
    "FEAT_INTER_FILTERS": f"{list(OUR_MODULES)!r}  # hdla-vision: ViT forward_intermediates",
    "NON_STD_FILTERS": f"{OUR_NAMES}  # hdla-vision: token outputs, as timm's vit_*",
    "EXCLUDE_JIT_FILTERS": f"{OUR_NAMES}  # hdla-vision: TorchScript cannot script the Triton kernels",
}
EXTRACTED = ("tests/__init__.py", "tests/conftest.py", "tests/test_models.py", "pyproject.toml")
UNREACHABLE = re.compile(
    r"NewConnectionError|Max retries exceeded|Network is unreachable|Name or service not known|"
    r"Temporary failure in name resolution|Connection refused|ConnectTimeoutError|ProxyError"
)


class SuiteFetchError(RuntimeError):
    """The suite could not be fetched or patched (not a network outage)."""


class IndexUnreachable(SuiteFetchError):
    """No package index could be reached to download timm's source distribution."""


def sdist_path(version: str = timm.__version__) -> Path:
    """timm ``version``'s source distribution, downloaded once into the cache directory."""
    cache = default_cache_dir() / "timm_sdist"
    target = cache / f"timm-{version}.tar.gz"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as download:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--retries", "1",
               "--timeout", "20", f"timm=={version}", "-d", download]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            unreachable = UNREACHABLE.search(output)
            if unreachable:
                raise IndexUnreachable(f"pip download timm=={version}: {unreachable.group(0)}")
            raise SuiteFetchError(f"pip download timm=={version} failed:\n{output[-3000:]}")
        found = Path(download) / target.name
        if not found.is_file():
            raise SuiteFetchError(f"pip download gave {sorted(p.name for p in Path(download).iterdir())}, "
                                  f"not {target.name}")
        found.replace(target)  # atomic: a concurrent run sees the whole file or none
    return target


def add_after_list(source: str, name: str, addition: str) -> str:
    """``source`` with ``{name} += {addition}`` after the module-level list ``{name} = [...]``."""
    pattern = re.compile(rf"^{name} = \[\n.*?^\]\n", re.MULTILINE | re.DOTALL)
    found = list(pattern.finditer(source))
    if len(found) != 1:
        raise SuiteFetchError(f"timm's test_models.py has {len(found)} top-level `{name} = [...]` lists, not 1")
    end = found[0].end()
    return source[:end] + f"{name} += {addition}\n" + source[end:]


def patch_suite(source: str) -> str:
    """timm's ``tests/test_models.py`` text with our models registered and listed (module docstring)."""
    if source.count(IMPORT_ANCHOR) != 1:
        raise SuiteFetchError(f"timm's test_models.py does not have the line {IMPORT_ANCHOR.strip()!r} once")
    source = source.replace(IMPORT_ANCHOR, IMPORT_ANCHOR + REGISTER_OURS)
    for name, addition in LIST_ADDITIONS.items():
        source = add_after_list(source, name, addition)
    return source


def suite_dir(dest: Path, version: str = timm.__version__) -> Path:
    """Extract timm ``version``'s suite into ``dest`` (patched); return ``dest``."""
    with tarfile.open(sdist_path(version)) as sdist:
        prefix = f"timm-{version}/"
        for member in EXTRACTED:
            data = sdist.extractfile(prefix + member)
            if data is None:
                raise SuiteFetchError(f"{prefix + member} is not a file in timm's source distribution")
            text = data.read().decode()
            if member == "tests/test_models.py":
                text = patch_suite(text)
            (dest / member).parent.mkdir(parents=True, exist_ok=True)
            (dest / member).write_text(text)
    return dest


if __name__ == "__main__":
    print(suite_dir(Path(tempfile.mkdtemp(prefix="timm_suite_"))))
