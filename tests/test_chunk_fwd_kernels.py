"""The forward kernels of ``kernels/generalized/fwd.py`` (F1 prepare, F2 state pass, F3 output): the
checks of tests/chunk_fwd_checks.py (output, final state and per-chunk states against the float64
token loops, fp32, relative error < 1e-4) run in one pytest subprocess under ``TRITON_INTERPRET=1``
and reported here per check function (every parametrization must pass)."""
import pytest

from tests.interpreted import check_functions, outcomes_of, run_interpreted_checks

CHECKS = "tests/chunk_fwd_checks.py"


@pytest.fixture(scope="module")
def interpreted_outcomes():
    return run_interpreted_checks(CHECKS)


@pytest.mark.interpret
@pytest.mark.parametrize("function", check_functions(CHECKS))
def test_forward_kernels_interpreted(interpreted_outcomes, function):
    outcomes, log = interpreted_outcomes
    mine = outcomes_of(outcomes, function)
    assert mine and set(mine.values()) == {"PASSED"}, f"{function}: {mine or 'not run'}\n{log}"
