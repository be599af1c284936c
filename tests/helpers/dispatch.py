"""Counting the ops a piece of code dispatches (what op-level checkpointing and its tests reason about)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as counted: ...` -> counted.calls[str(op)]: how often each op dispatched inside. An op
    whose output a checkpoint takes from its cache never dispatches; ops run inside another op's implementation
    (a custom op's collective) are not seen."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))
