"""Runs the Triton kernels under TRITON_INTERPRET=1 on CPU tensors and prints their errors
against the float64 token loop as JSON. Started in a subprocess by tests/test_chunk_interpret.py,
because Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. at import. Never import
this module from a test: it sets TRITON_INTERPRET for its whole process."""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

from hdla_vision.kernels import chunk_generalized, chunk_hdla  # noqa: E402
from tests.interpret_cases import CASES  # noqa: E402
from tests.oracle import compare_with_loop, generalized_problem, hdla_problem  # noqa: E402

def main(names):
    results = {}
    for name, kind, problem, kwargs in CASES:
        if names and name not in names:
            continue
        make = hdla_problem if kind == "hdla" else generalized_problem
        op = chunk_hdla if kind == "hdla" else chunk_generalized
        results[name] = compare_with_loop(op, kind, make(**problem), **kwargs)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
