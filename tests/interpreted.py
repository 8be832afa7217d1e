"""The one way the tests run Triton kernels under the interpreter: in a subprocess started with
``TRITON_INTERPRET=1`` from the repository root (so ``tests`` imports), with the default kernel family.
:func:`run_interpreted` runs a script or module, :func:`run_interpreted_json` a worker that prints its
results as JSON, :func:`run_interpreted_checks` a checks module (a pytest file without the ``test_``
prefix, so never collected on its own) and reports each check's outcome.

Triton decides at decoration time, i.e. when a kernel module is first imported, whether a kernel is
interpreted; setting the variable inside the main pytest process would leave the kernels imported
earlier compiled-only while ``use_triton`` routes CPU tensors to them (tests/conftest.py refuses a
collection that changes it)."""
import ast
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(args, timeout=1800):
    """``python *args`` under the interpreter (e.g. ``["-c", SCRIPT]`` or ``["-m", "tests.worker"]``):
    the finished ``subprocess.CompletedProcess`` with its text output."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    env.pop("HDLA_VISION_KERNELS", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_interpreted_json(module, timeout=1800):
    """What ``python -m module`` prints as JSON under the interpreter (asserts it exited cleanly)."""
    proc = run_interpreted(["-m", module], timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def run_interpreted_checks(checks_file, timeout=1800):
    """``({check id: PASSED / FAILED / ERROR / SKIPPED}, output tail)`` of ``checks_file`` (relative to
    the repository root) run under the interpreter."""
    proc = run_interpreted(["-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", checks_file], timeout)
    outcomes = dict((name, status) for status, name in
                    re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) \S+::(\S+)", proc.stdout, re.M))
    return outcomes, proc.stdout[-6000:] + proc.stderr[-2000:]


def check_functions(checks_file):
    """The names of the ``test_*`` functions defined in ``checks_file`` (read, not imported)."""
    with open(os.path.join(ROOT, checks_file)) as f:
        tree = ast.parse(f.read())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def outcomes_of(outcomes, function):
    """The outcomes of every parametrization of ``function``."""
    return {name: status for name, status in outcomes.items() if name.split("[")[0] == function}
