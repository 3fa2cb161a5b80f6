"""Small helpers shared by the kernel modules; importing this module does not import Triton.

TRITON_INTERPRET, the one environment variable this package reads, is read here. Triton
itself decides between compiling and interpreting when `triton.jit` decorates a function,
and it decorates its own `triton.language` helpers when it is first imported, so the
variable must be set before anything in the process imports triton.
"""

from __future__ import annotations

import functools
import os

import torch

_TRUE = ("1", "true", "yes", "on")


def interpret_enabled() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small stand-in for the CPU interpreter."""
    if device.type != "cuda":
        return 4
    return _multiprocessor_count(device.index if device.index is not None else 0)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host.to(device)` for a small host tensor, without making the host wait for the GPU.

    A copy from pageable host memory to a CUDA device synchronises the stream first (CUDA's documented behaviour,
    whatever `non_blocking` says): it drains the queue of launched kernels and leaves the GPU idle while Python
    issues the next ones. A copy from a pinned staging tensor is queued behind them instead; PyTorch's caching host
    allocator keeps the staging tensor until the copy has read it (the source may change or die right after). The
    staging tensor is always a fresh contiguous one: `pin_memory()` would keep a strided view's strides (the copy
    would then make a pageable contiguous temporary) and return an already pinned source itself (a later write
    into it would race the queued copy).
    """
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    staging = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
    return staging.to(device, non_blocking=True)
