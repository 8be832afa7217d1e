"""MQAR recall benchmark under Zoology's protocol: ``python -m benchmarks.mqar --help``.

The runner is ``hdla_vision.lm.mqar_runner`` (its docstring gives the protocol and the commands).
"""
from hdla_vision.lm.mqar_runner import main

if __name__ == "__main__":
    main()
