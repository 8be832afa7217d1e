"""The backends the op tests (tests/ops/) run each op on, as the ``backend`` fixture's values
(tests/conftest.py):

* ``"torch"``: CPU tensors in the main pytest process (``TRITON_INTERPRET`` unset), i.e. the
  vectorised PyTorch chunk form and the PyTorch decoding loops;
* ``"interpreter"``: CPU tensors under ``TRITON_INTERPRET=1``, i.e. the Triton kernels run by
  Triton's interpreter; these items all run in one pytest subprocess (tests/interpreted.py) and
  the main process reports each one's outcome there;
* ``"cuda"``: CUDA tensors, the compiled Triton kernels (skipped without CUDA; ``pytest -m gpu``).

A test takes the fixture for all three, or parametrizes it (``indirect``) with :func:`backends`
(some of them) or :func:`backend_cases` (cases of its own per backend: small shapes for the
interpreter, realistic ones for CUDA).
"""
import pytest
import torch

BACKENDS = ("torch", "interpreter", "cuda")
MARKS = {"torch": (), "interpreter": (pytest.mark.interpret,), "cuda": (pytest.mark.gpu,)}

FP32_TOL = 1e-4  # fp32 on the CPU (PyTorch form, interpreter) against the float64 loop
CUDA_TOL = 1e-2  # bf16 on CUDA, and fp32 there too (TF32 tensor-core products, ~3e-3 measured)


def backends(*names):
    """Parameters for ``@pytest.mark.parametrize("backend", backends(...), indirect=True)``: the
    named backends (all three by default), each with its marker."""
    return [pytest.param(name, marks=MARKS[name], id=name) for name in names or BACKENDS]


def backend_cases(case_id=str, **cases):
    """Parameters for ``@pytest.mark.parametrize("backend,case", backend_cases(torch=[...],
    interpreter=[...], cuda=[...]), indirect=["backend"])``: each backend with its own cases, the
    id ``<backend>-<case_id(case)>``."""
    unknown = set(cases) - set(BACKENDS)
    if unknown:
        raise ValueError(f"backend_cases: unknown backends {sorted(unknown)}; expected some of {BACKENDS}")
    return [pytest.param(name, case, marks=MARKS[name], id=f"{name}-{case_id(case)}")
            for name in BACKENDS for case in cases.get(name, ())]


def device_of(backend: str) -> str:
    """Where the backend's tensors live."""
    return "cuda" if backend == "cuda" else "cpu"


def on_backend(problem: dict, backend: str) -> dict:
    """``problem`` (names to arguments) with its tensors moved to the backend's device."""
    device = device_of(backend)
    return {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in problem.items()}


def dtypes_id(dtypes: dict) -> str:
    """A test id for ``{input name: dtype}``, e.g. ``q=bf16,g=fp32``."""
    short = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return ",".join(f"{name}={short[dtype]}" for name, dtype in dtypes.items())
