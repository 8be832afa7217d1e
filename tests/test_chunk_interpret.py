"""The Triton kernels themselves, under TRITON_INTERPRET=1 on the CPU, against the float64
token loop: outputs, final states and all gradients, relative error < 1e-4 in fp32."""

import pytest

from tests.interpret_cases import CASES
from tests.interpreted import run_interpreted_json

TOL = 1e-4


@pytest.fixture(scope="module")
def interpreted_errors():
    return run_interpreted_json("tests.interpret_worker", timeout=1200)


@pytest.mark.interpret
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_triton_kernel_matches_float64_loop(interpreted_errors, case):
    errors = interpreted_errors[case]
    assert len(errors) >= 4, errors  # o, final state and gradients were all compared
    bad = {name: err for name, err in errors.items() if not err < TOL}  # NaN fails too
    assert not bad, f"{case}: relative errors above {TOL}: {bad}"
