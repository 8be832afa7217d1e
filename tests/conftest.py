"""Guards and fixtures shared by the test modules."""
import os

import pytest

_TRITON_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")


def pytest_collection_finish(session):
    """A test module that sets ``TRITON_INTERPRET`` while being imported leaves the kernels imported before
    it compiled-only while ``use_triton`` sends CPU tensors to them: every later CPU test then fails
    with "Cannot call @triton.jit'd outside of the scope of a kernel". Interpreted checks run in a
    subprocess instead (tests/interpreted.py)."""
    now = os.environ.get("TRITON_INTERPRET")
    if now != _TRITON_INTERPRET_AT_START:
        raise pytest.UsageError(f"TRITON_INTERPRET changed from {_TRITON_INTERPRET_AT_START!r} to {now!r} while "
                                "collecting the tests; run interpreted checks through tests/interpreted.py")


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
