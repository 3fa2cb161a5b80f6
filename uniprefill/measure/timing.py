"""Timing of one forward call: device sync, CUDA events on CUDA, peak memory.

On CUDA a call is timed with `torch.cuda.Event`s after a `torch.cuda.synchronize`, and the
peak of `torch.cuda.max_memory_allocated` is reset before each measurement; elsewhere the
wall clock (`time.perf_counter`) is used and no peak memory is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(fn(), seconds), with the device idle before the start and after the end."""
    synchronize(device)
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1000.0
    begin = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - begin


@dataclass(frozen=True)
class TimingStats:
    """Repeated timings of one call, in seconds; peak memory in bytes (CUDA only)."""

    median_s: float
    min_s: float
    max_s: float
    q1_s: float
    q3_s: float
    times_s: tuple[float, ...]
    peak_memory_bytes: int | None

    @classmethod
    def of(cls, times: list[float], peak: int | None) -> "TimingStats":
        ordered = sorted(times)
        if len(ordered) >= 2:
            q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        else:
            q1 = q3 = ordered[0]
        return cls(statistics.median(ordered), ordered[0], ordered[-1], q1, q3,
                   tuple(times), peak)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["times_s"] = list(self.times_s)
        return out


def measure(
    fn: Callable[[], Any], device: torch.device, *, warmup: int = 2, repeats: int = 5
) -> tuple[TimingStats, Any]:
    """Run `fn` `warmup` times untimed, then `repeats` times timed; (stats, last output)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0; got {repeats}, {warmup}")
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        out = None
        for _ in range(repeats):
            out, seconds = timed_call(fn, device)
            times.append(seconds)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return TimingStats.of(times, peak), out
