"""Counting the ``hdla_vision`` custom ops a piece of code calls (which scan path ran, how often)."""
import collections

from torch.utils._python_dispatch import TorchDispatchMode


class OurOpCalls(TorchDispatchMode):
    """Counts the calls of the ``hdla_vision`` ops (e.g. ``"hdla_vision::chunk_hdla"``) while entered."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "hdla_vision":
            self.calls[func.name()] += 1
        return func(*args, **(kwargs or {}))
