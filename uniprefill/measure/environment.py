"""What a result was measured with: versions, device, git commit and date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from typing import Any

import torch

# fla-core / causal-conv1d: whether linear-attention models ran fla's kernels or transformers' fallbacks
_PACKAGES = ("torch", "transformers", "triton", "uniprefill", "fla-core", "causal-conv1d")


def package_versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata (nothing is imported)."""
    out: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def git_commit() -> str | None:
    """HEAD of the repository holding this package, if it is a git checkout; else the
    `UNIPREFILL_GIT_COMMIT` environment variable (a copy without `.git`, as on the GPU box)."""
    here = os.path.dirname(os.path.abspath(__file__))
    fallback = os.environ.get("UNIPREFILL_GIT_COMMIT") or None
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return fallback
    return (out.stdout.strip() or fallback) if out.returncode == 0 else fallback


def environment_info(device: torch.device) -> dict[str, Any]:
    return {
        "versions": package_versions(),
        "device": str(device),
        "device_name": device_name(device),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
    }
