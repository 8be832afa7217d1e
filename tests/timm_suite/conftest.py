"""Setup for the vendored timm model suite (timm_test_models.py): register our models with timm
before the suite lists them, and declare timm's markers (timm's pyproject.toml)."""
import hdla_vision  # noqa: F401  registers hdla_* and the seed *_tiny models

TIMM_MARKERS = ("base", "forward", "backward", "cfg", "cfg_nonstd", "torchscript", "features", "fxforward",
                "fxbackward", "timeout(seconds): pytest-timeout's limit, where that plugin is installed")


def pytest_configure(config):
    for marker in TIMM_MARKERS:
        config.addinivalue_line("markers", f"{marker}: timm model-suite marker")
