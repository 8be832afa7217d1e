"""Guards shared by every test module."""
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
