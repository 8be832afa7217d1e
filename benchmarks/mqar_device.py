"""Carry MQAR runs across device calls: ``python -m benchmarks.mqar_device restore|export|collect``.

The module is ``hdla_vision.lm.mqar_device`` (its docstring gives the steps of one device session).
"""
from hdla_vision.lm.mqar_device import main

if __name__ == "__main__":
    main()
