"""Guards and fixtures shared by the test modules, and the ``backend`` parameter of the op tests
(tests/ops/, tests/backends.py)."""
import os

import pytest

from tests.backends import BACKENDS, MARKS
from tests.interpreted import OUTCOMES_ENV, OutcomeRecorder, run_interpreted_tests

_TRITON_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")
INTERPRETING = _TRITON_INTERPRET_AT_START == "1"  # this process runs the kernels under the interpreter


def pytest_collection_finish(session):
    """A test module that sets ``TRITON_INTERPRET`` while being imported leaves the kernels imported before
    it compiled-only while ``use_triton`` sends CPU tensors to them: every later CPU test then fails
    with "Cannot call @triton.jit'd outside of the scope of a kernel". Interpreted checks run in a
    subprocess instead (tests/interpreted.py)."""
    now = os.environ.get("TRITON_INTERPRET")
    if now != _TRITON_INTERPRET_AT_START:
        raise pytest.UsageError(f"TRITON_INTERPRET changed from {_TRITON_INTERPRET_AT_START!r} to {now!r} while "
                                "collecting the tests; run interpreted checks through tests/interpreted.py")


@pytest.fixture(autouse=True)
def leaves_the_triton_routing_alone(request):
    """After each test: ``TRITON_INTERPRET`` as at the start and every kernels module's ``use_triton`` the real one.
    A test that left CPU tensors routed to the Triton kernels (a patch not undone, the variable set) would make
    later tests in its process launch compiled kernels on CPU tensors ("0 active drivers"); this names it."""
    yield
    import sys

    now = os.environ.get("TRITON_INTERPRET")
    assert now == _TRITON_INTERPRET_AT_START, f"{request.node.nodeid} left TRITON_INTERPRET={now!r}"
    def real(fn):  # kernels/utils.py's own function
        return getattr(fn, "__module__", "") == "hdla_vision.kernels.utils" and fn.__qualname__ == "use_triton"

    patched = [name for name, module in list(sys.modules.items())
               if name.startswith(("hdla_vision.kernels", "kernels.")) and hasattr(module, "use_triton")
               and not real(module.use_triton)]
    assert not patched, f"{request.node.nodeid} left use_triton patched in {patched}"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A tiny ImageFolder dataset (10 classes of 32x32 images, tests/training_helpers.py), one per module."""
    from tests.training_helpers import tiny_dataset
    return tiny_dataset(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; a test that builds its own Accelerator starts and ends
    with them reset (use it with ``pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")``)."""
    from tests.training_helpers import reset_accelerate_state
    reset_accelerate_state()
    yield
    reset_accelerate_state()


# ----------------------------------------------------------------------------- the backend parameter
@pytest.fixture(params=[pytest.param(name, marks=MARKS[name], id=name) for name in BACKENDS])
def backend(request):
    """Where an op test runs the op: ``"torch"``, ``"interpreter"`` or ``"cuda"`` (tests/backends.py).
    "cuda" skips without CUDA. In the main process (``TRITON_INTERPRET`` unset) an "interpreter"
    item does not run its body: :func:`pytest_pyfunc_call` reports its outcome in the one interpreter
    subprocess, which runs every selected "interpreter" item when the first is reached; inside that
    subprocess only the "interpreter" items run, the others skip."""
    name = request.param
    if INTERPRETING and name != "interpreter":
        pytest.skip(f"the backend {name!r} does not run under TRITON_INTERPRET=1 (only 'interpreter' does)")
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
    return name


def backend_of(item) -> str | None:
    """The ``backend`` parameter of a test item (None for a test without one)."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("backend") if callspec is not None else None


def reported_from_subprocess(item) -> bool:
    """Whether the item is an "interpreter" item of the main process (its outcome comes from the
    interpreter subprocess)."""
    return not INTERPRETING and backend_of(item) == "interpreter"


_INTERPRETER_OUTCOMES = pytest.StashKey[dict]()


def interpreter_outcomes(session) -> dict:
    """``{node id: (outcome, text)}`` of every selected "interpreter" item, run when the first of them
    is reached, all in ONE pytest subprocess under ``TRITON_INTERPRET=1`` (tests/interpreted.py)."""
    stash = session.config.stash
    if _INTERPRETER_OUTCOMES not in stash:
        stash[_INTERPRETER_OUTCOMES] = run_interpreted_tests(
            [item.nodeid for item in session.items if reported_from_subprocess(item)])
    return stash[_INTERPRETER_OUTCOMES]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """An "interpreter" item of the main process passes, skips or fails as it did in the interpreter
    subprocess (with that failure's text) instead of running its body here."""
    if not reported_from_subprocess(pyfuncitem):
        return None
    outcome, text = interpreter_outcomes(pyfuncitem.session)[pyfuncitem.nodeid]
    if outcome == "skipped":
        pytest.skip(f"in the interpreter subprocess: {text}")
    if outcome != "passed":
        pytest.fail(f"in the interpreter subprocess (TRITON_INTERPRET=1):\n{text}", pytrace=False)
    return True


def pytest_configure(config):
    """Inside the interpreter subprocess: record every item's outcome (tests/interpreted.py)."""
    path = os.environ.pop(OUTCOMES_ENV, None)
    if path:
        config.pluginmanager.register(OutcomeRecorder(path), "interpreter-outcomes")
