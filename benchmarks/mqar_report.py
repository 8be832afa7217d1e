"""Table and plot of MQAR runs: ``python -m benchmarks.mqar_report DIR --out-dir OUT``.

The report is ``hdla_vision.lm.mqar_report`` (its docstring says what it writes).
"""
from hdla_vision.lm.mqar_report import main

if __name__ == "__main__":
    main()
