"""timm's own model test-suite (``tests/test_models.py`` of the installed timm release, fetched from
its source distribution and patched to list our models: tools/timm_suite.py) on our tiny models, run
the way timm runs it on its ViT family, in a subprocess (the suite sets TorchScript executor flags
when imported). Without a reachable package index for the first download the suite tests skip.

What CI runs (2 CPU cores; at 224 px every full-width 12-block model runs through the PyTorch chunk
form of the kernels, and the suite's 224 px forward, backward and forward_intermediates tests take
30-60 s each for one model), in one subprocess:
- ``hdla_tiny``: ``test_model_default_cfgs_non_std`` (the config and model-API contract, ``device``
  / ``dtype`` factory arguments, forward on the meta device), ``test_model_forward_fx`` and
  ``test_model_backward_fx`` (the mixers as FX leaves), ``test_model_forward_intermediates_features``.
  Left to the full run: ``test_model_forward``, ``test_model_backward``,
  ``test_model_forward_intermediates`` (the same code paths as tests/test_backbone.py's
  forward/backward, grad-checkpointing and forward_intermediates tests, there at 32-64 px) and
  ``test_prune_intermediate_layers_contract``, which timm itself leaves out of its CI as slow.
- the nine seed ``*_tiny`` models and the two log-linear ones (``loglinear_hdla_tiny``,
  ``loglinear_gdn_tiny``) share that backbone; what depends on their mixer classes
  (``device`` / ``dtype`` reaching every gate module, meta-device forward, FX leaves) is checked
  for each of them at a small size by tests/test_backbone.py (the suite's meta-device config test
  alone takes 12-17 s per model here).
``HDLA_FULL_TIMM_SUITE=1 python -m pytest tests/test_timm_models.py`` runs all eight tests the
suite selects for each of the twelve tiny names (about an hour on 2 cores).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import timm

import hdla_vision  # noqa: F401  registers the models
from tools.timm_suite import OUR_MODULES, IndexUnreachable, SuiteFetchError, add_after_list, patch_suite, suite_dir

TINY = sorted(name for name in timm.list_models(module=list(OUR_MODULES)) if name.endswith("_tiny"))
FULL = os.environ.get("HDLA_FULL_TIMM_SUITE") == "1"
SLOW_IN_CI = "test_prune_intermediate_layers_contract"


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    """The patched suite's directory (timm's pyproject.toml, tests/conftest.py, tests/test_models.py)."""
    try:
        return suite_dir(tmp_path_factory.mktemp("timm_suite"))
    except IndexUnreachable as error:
        pytest.skip(f"no package index reachable to download timm's source distribution: {error}")


def run_suite(suite: Path, keyword: str) -> str:
    """Run the patched suite on the tests matching ``keyword`` (pytest -k); return its output."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-c", str(suite / "pyproject.toml"), "tests/test_models.py",
           "-k", keyword, "-p", "no:cacheprovider", "-rfEs", "-W", "ignore::pytest.PytestUnknownMarkWarning"]
    proc = subprocess.run(cmd, cwd=suite, capture_output=True, text=True, timeout=3600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def passed(output: str) -> int:
    found = re.search(r"(\d+) passed", output)
    return int(found.group(1)) if found else 0


def test_patch_lists_our_models():
    """The patch adds our names after each filter list and registers our models before the lists."""
    source = ("import torch\nfrom timm.models import get_notrace_modules, get_notrace_functions\n"
              "FEAT_INTER_FILTERS = [\n    'vit',\n]\nNON_STD_FILTERS = [\n    'vit_*',\n]\n"
              "EXCLUDE_JIT_FILTERS = [\n    'hiera_*',\n]\nX = 1\n")
    namespace = {"list_models": lambda module: [f"{m}_tiny" for m in module]}
    exec(patch_suite(source).replace("import hdla_vision", "pass  #"), namespace)
    assert namespace["FEAT_INTER_FILTERS"] == ["vit", "hdla", "seed", "loglinear"]
    assert namespace["NON_STD_FILTERS"] == ["vit_*", "hdla_tiny", "seed_tiny", "loglinear_tiny"]
    assert namespace["EXCLUDE_JIT_FILTERS"] == ["hiera_*", "hdla_tiny", "seed_tiny", "loglinear_tiny"]


def test_patch_fails_loudly_without_its_anchors():
    with pytest.raises(SuiteFetchError, match="NON_STD_FILTERS"):
        add_after_list("FEAT_INTER_FILTERS = [\n    'vit',\n]\n", "NON_STD_FILTERS", "['x']")
    with pytest.raises(SuiteFetchError, match="get_notrace_modules"):
        patch_suite("NON_STD_FILTERS = [\n]\n")


def test_tiny_names_listed():
    assert "hdla_tiny" in TINY and len(TINY) == 12, TINY
    assert {"loglinear_hdla_tiny", "loglinear_gdn_tiny"} <= set(TINY)


CI_TESTS = {
    "hdla_tiny": ["test_model_default_cfgs_non_std", "test_model_forward_fx", "test_model_backward_fx",
                  "test_model_forward_intermediates_features"],
}
SUITE_TESTS_PER_MODEL = 8  # forward, backward, cfgs_non_std, intermediates(_features), prune contract, fx fwd / bwd


def name_keyword(name: str) -> str:
    """A -k expression for ``name``'s tests alone (``gdn_tiny`` is a substring of ``hihgdn_tiny``)."""
    return " and ".join([name] + [f"not {other}" for other in TINY if name in other and other != name])


def test_timm_suite_ci_subset(suite):
    """The subset of the module docstring, all in one run of the suite (it lists 18k tests at start)."""
    keyword = " or ".join(
        f"({name_keyword(name)} and ({' or '.join(tests)}))" for name, tests in CI_TESTS.items()
    )
    output = run_suite(suite, keyword)
    expected = sum(len(tests) for tests in CI_TESTS.values())
    assert passed(output) == expected and "skipped" not in output, output[-3000:]


@pytest.mark.skipif(not FULL, reason="the whole suite takes minutes per model on a CPU: HDLA_FULL_TIMM_SUITE=1 runs it")
@pytest.mark.parametrize("name", TINY)
def test_timm_suite_full(suite, name):
    output = run_suite(suite, name_keyword(name))
    assert passed(output) == SUITE_TESTS_PER_MODEL and "skipped" not in output, output[-3000:]
