"""Host arithmetic on a step's small host arrays, for the vLLM runtime's layouts and selection.

A torch op on the host costs microseconds of dispatch each, and a small model's step is bound by the host
(docs/results/vllm-gemma-profile-own-h200-2026-12-05): the host arithmetic runs in numpy on `.numpy()` views,
results are wrapped with `torch.from_numpy` (no copy), and what the device needs goes there in one copy per dtype
(`_to_device`), staged in pinned memory (`kernels._common.to_device`): a copy from pageable memory would make the
host wait for every kernel queued before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from uniprefill.kernels._common import to_device


def offsets_np(lens: np.ndarray) -> np.ndarray:
    """int64 [R + 1]: 0 then the running sums of `lens`."""
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def ranges_np(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """int64: the concatenated [start, start + len) ranges, without a Python loop."""
    lens = np.asarray(lens, dtype=np.int64)
    offsets = offsets_np(lens)
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - offsets[:-1], lens)
    return shift + np.arange(int(offsets[-1]), dtype=np.int64)


def _ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Concatenated [start, start + len) ranges of host `starts` / `lens`, host int64, without a Python loop."""
    return torch.from_numpy(ranges_np(starts.numpy(), lens.numpy()))


_NUMPY_INTS = {torch.int32: np.int32, torch.int64: np.int64}


def _to_device(arrays: Sequence[np.ndarray], dtypes: Sequence[torch.dtype], device) -> list[torch.Tensor]:
    """The host int arrays on `device` as the given dtypes (int32 / int64): one copy per distinct dtype (each a
    launch on the host's path), each array a view of it starting at a multiple of 16 bytes."""
    out: list[torch.Tensor | None] = [None] * len(arrays)
    for dtype in dict.fromkeys(dtypes):
        members = [i for i, d in enumerate(dtypes) if d == dtype]
        np_dtype = _NUMPY_INTS[dtype]
        align = 16 // np.dtype(np_dtype).itemsize
        starts = offsets_np(np.array([-(-len(arrays[i]) // align) * align for i in members], dtype=np.int64))
        host = np.zeros(int(starts[-1]), dtype=np_dtype)
        for i, start in zip(members, starts[:-1]):
            host[start:start + len(arrays[i])] = arrays[i]
        moved = to_device(torch.from_numpy(host), device)  # from pinned memory: no stream sync
        for i, start in zip(members, starts[:-1]):
            out[i] = moved[start:start + len(arrays[i])]
    return out
