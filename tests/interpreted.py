"""The one way the tests run Triton kernels under the interpreter: in a subprocess started with
``TRITON_INTERPRET=1`` from the repository root (so ``tests`` imports), with the default kernel family.
:func:`run_interpreted` runs a script or module, :func:`run_interpreted_json` a worker that prints its
results as JSON, :func:`run_interpreted_checks` a checks module (a pytest file without the ``test_``
prefix, so never collected on its own) and reports each check's outcome, :func:`run_interpreted_tests`
the ``backend="interpreter"`` items of the op tests (tests/ops/, tests/conftest.py), all in one process.

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
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The subprocess of run_interpreted_tests writes its outcomes to the file this names.
OUTCOMES_ENV = "HDLA_VISION_TEST_OUTCOMES"


def interpreter_env(extra=None):
    """This process's environment with ``TRITON_INTERPRET=1``, the repository root importable, the
    default kernel family and state-pass groups, and the variables ``extra``."""
    env = dict(os.environ, **(extra or {}), TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    env.pop("HDLA_VISION_KERNELS", None)
    env.pop("HDLA_VISION_STATE_GROUPS", None)  # the launchers' own rule unless a check forces groups
    return env


def run_interpreted(args, timeout=1800):
    """``python *args`` under the interpreter (e.g. ``["-c", SCRIPT]`` or ``["-m", "tests.worker"]``):
    the finished ``subprocess.CompletedProcess`` with its text output."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=interpreter_env(), capture_output=True, text=True,
                          timeout=timeout)


def run_interpreted_json(module, timeout=1800, args=()):
    """What ``python -m module *args`` prints as JSON under the interpreter (asserts it exited cleanly)."""
    proc = run_interpreted(["-m", module, *args], timeout)
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


class OutcomeRecorder:
    """A pytest plugin for the interpreter subprocess of :func:`run_interpreted_tests` (tests/conftest.py
    registers it there): every item's outcome, ``[passed | skipped | failed, text]`` (the failure's
    text or the skip's reason), written as JSON ``{node id: [outcome, text]}`` to ``path`` at the end."""

    SEVERITY = {"passed": 0, "skipped": 1, "failed": 2}  # a failed teardown after a passed call fails

    def __init__(self, path):
        self.path = path
        self.outcomes = {}

    def pytest_runtest_logreport(self, report):
        if report.failed:
            entry = ["failed", f"[{report.when}] {report.longreprtext}"]
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            entry = ["skipped", reason.removeprefix("Skipped: ")]
        elif report.when == "call":
            entry = ["passed", ""]
        else:
            return
        known = self.outcomes.get(report.nodeid)
        if known is None or self.SEVERITY[entry[0]] > self.SEVERITY[known[0]]:
            self.outcomes[report.nodeid] = entry

    def pytest_sessionfinish(self, session):
        with open(self.path, "w") as f:
            json.dump(self.outcomes, f)


def run_interpreted_tests(node_ids, timeout=2400):
    """Run the pytest items ``node_ids`` (relative to the repository root) in ONE pytest subprocess
    under the interpreter: ``{node id: (passed | skipped | failed, text)}``. An item that left no
    outcome (the subprocess crashed, ran past ``timeout`` or did not find it) is failed with the tail
    of the subprocess's output."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "outcomes.json")
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *node_ids]
        try:
            proc = subprocess.run(args, cwd=ROOT, env=interpreter_env({OUTCOMES_ENV: path}), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout)
            status, output = f"exit status {proc.returncode}", proc.stdout
        except subprocess.TimeoutExpired as err:
            status, output = f"ran past {timeout} s", err.stdout or ""
            output = output.decode(errors="replace") if isinstance(output, bytes) else output
        recorded = {}
        if os.path.exists(path):
            with open(path) as f:
                recorded = json.load(f)
    missing = ("failed", f"no outcome from the interpreter subprocess ({status}):\n{output[-8000:]}")
    return {node_id: tuple(recorded.get(node_id, missing)) for node_id in node_ids}
