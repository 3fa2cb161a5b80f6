"""A CPU stand-in for CUDA-graph capture and replay of tensor code (test helper, not a test module).

A CUDA graph records the kernels a piece of code launched; a replay runs those kernels again on
the same memory, without the Python that launched them. `Capture` records every ATen op run
under it (a `TorchDispatchMode`), and `replay()` runs the recorded ops again: tensors the capture
produced are recomputed, every other tensor (the "persistent buffers" the caller refills in place
between capture and replay) is read as it is now. Code that folds a value into Python during the
capture (`.item()`, `.tolist()`, a host copy: a sync, which a real capture refuses) raises here,
and a result that depends on anything but the persistent buffers comes out stale at replay.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


class Capture(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []  # (op, args, kwargs, out): tensors kept alive, so ids stay unique

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a value was read on the host during the capture (a sync a CUDA graph capture refuses)")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> dict[int, torch.Tensor]:
        """Run the recorded ops again; returns {id(tensor produced at capture): its replayed value}."""
        values: dict[int, torch.Tensor] = {}

        def now(x):
            return values.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, out in self.ops:
            new = func(*tree_map(now, args), **tree_map(now, kwargs))
            for old, fresh in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                if isinstance(old, torch.Tensor):
                    values[id(old)] = fresh
        return values
