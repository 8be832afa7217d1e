"""Carry MQAR runs across device calls: ``python -m tools.mqar_device restore|export|collect``.

Device tooling of the MQAR benchmark (``python -m benchmarks.mqar``), used by ``tools/mqar_device.sh``.
The module is ``hdla_vision.lm.mqar_device`` (its docstring gives the steps of one device session).
"""
from hdla_vision.lm.mqar_device import main

if __name__ == "__main__":
    main()
