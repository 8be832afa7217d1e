"""Optional dependencies: a missing extra is reported with the command that installs it."""
from __future__ import annotations

from typing import NoReturn


def missing_extra_message(part: str, module: str, extra: str) -> str:
    """The one-line explanation for ``part`` needing ``module`` from the ``extra`` extra."""
    return (f"{part} needs {module}, which is not installed: install the \"{extra}\" extra with "
            f"pip install \"hdla-vision[{extra}]\" (or pip install -e \".[{extra}]\" in a clone)")


def raise_missing_extra(err: ImportError, module: str, extra: str, part: str) -> NoReturn:
    """Re-raise ``err`` naming the extra if ``module`` itself is what could not be imported.

    Use it in ``except ImportError as err:`` around the import of ``module``. An ImportError
    about any other module (a broken install of ``module``, say) is re-raised unchanged, so
    the message never blames the wrong package.
    """
    name = err.name or ""
    if name == module or name.startswith(module + "."):
        raise ModuleNotFoundError(missing_extra_message(part, module, extra), name=name) from err
    raise err


def require_extra(modules: tuple[str, ...], extra: str, part: str) -> None:
    """Raise ModuleNotFoundError naming ``extra`` if any of ``modules`` is not installed.

    Looks the modules up without importing them (``importlib.util.find_spec``), so a part can
    check its whole extra at import time without paying for modules it loads later, lazily.
    """
    from importlib.util import find_spec

    for module in modules:
        try:
            found = find_spec(module) is not None
        except ImportError:  # a meta-path finder that refuses the module
            found = False
        if not found:
            raise ModuleNotFoundError(missing_extra_message(part, module, extra), name=module)
