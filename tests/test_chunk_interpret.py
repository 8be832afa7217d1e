"""The Triton kernels themselves, under TRITON_INTERPRET=1 on the CPU, against the float64
token loop: outputs, final states and all gradients, relative error < 1e-4 in fp32."""
import json
import os
import subprocess
import sys

import pytest

from tests.interpret_cases import CASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4


@pytest.fixture(scope="module")
def interpreted_errors():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "tests.interpret_worker"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.interpret
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_triton_kernel_matches_float64_loop(interpreted_errors, case):
    errors = interpreted_errors[case]
    assert len(errors) >= 4, errors  # o, final state and gradients were all compared
    bad = {name: err for name, err in errors.items() if not err < TOL}  # NaN fails too
    assert not bad, f"{case}: relative errors above {TOL}: {bad}"
