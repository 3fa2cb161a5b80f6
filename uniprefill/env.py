"""The one module of uniprefill that reads (or sets) environment variables.

Every variable uniprefill looks at is listed here, and nowhere else reads `os.environ`.

Read:
    UNIPREFILL_CACHE_DIR: root folder of uniprefill's caches (converted model folders).
        Default: `~/.cache/uniprefill`.
    UNIPREFILL_GEMMA_DIR: folder holding the plain Hugging Face copy of Gemma-3-270M that
        `uniprefill.models.gemma` converts from the GGUF once and loads afterwards.
        Default: `<UNIPREFILL_CACHE_DIR>/gemma-3-270m`.
    UNIPREFILL_SMOLLM2_DIR: likewise for SmolLM2-135M (`uniprefill.models.smollm2`).
        Default: `<UNIPREFILL_CACHE_DIR>/smollm2-135m`.

    UNIPREFILL_MINFERENCE_CSRC: the `csrc` folder of an unpacked minference sdist, whose CUDA
        index builder `uniprefill.peers.minference_loader` compiles for the MInference peer when
        the installed package has no `minference.cuda` (`minference_csrc()`).

    UNIPREFILL_HAYSTACK: essay haystack file for `uniprefill demo/eval` when --haystack is not
        given (`haystack_path()`).
    UNIPREFILL_VLLM_DROP: "1" turns on the experimental token dropping inside vLLM
        (`vllm_drop_enabled()`; `uniprefill.vllm_plugin`). First GPU runs on 2026-12-01
        (docs/vllm.md): off by default, and vLLM then runs unaccelerated with the reason logged.
    UNIPREFILL_VLLM_DECODE_GRAPHS: "1" lets the dropping vLLM engine decode under CUDA graphs
        (`compilation_config.cudagraph_mode="FULL_DECODE_ONLY"`; `vllm_decode_graphs_enabled()`,
        `uniprefill.runtime.vllm_graph_decode`): built and tested on CPU, first run on the H200 on
        2026-12-01 (docs/vllm.md), still a second switch; without it that mode is refused when dropping.
    UNIPREFILL_VLLM_ALLOW_UNTESTED: "1" lets the dropping vLLM engine start on a vLLM version
        other than the verified ones (`vllm_untested_allowed()`); without it such an engine is
        refused at construction, since the rewrite reads vLLM internals that may have changed.
    UNIPREFILL_VLLM_REWRITE_DUMP: a folder; when set, the vLLM plugin writes each rewritten
        graph's code there (`rewrite_dump_dir()`), for debugging on the GPU box.
    TRITON_INTERPRET: Triton's own switch ("1": run Triton kernels in its CPU interpreter);
        `uniprefill.kernels` reads it (kernels/_common.py) to allow Triton on CPU tensors.
        tests/conftest.py sets it when there is no CUDA device.

Set, never read:
    HF_HUB_OFFLINE: `force_hub_offline()` sets it to "1" before a model is loaded, so that
        nothing is fetched from a model hub at run time. The loaders also pass
        `local_files_only=True`, which holds even when `huggingface_hub` was imported (and
        read the variable) earlier.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "force_hub_offline", "gemma_dir", "haystack_path", "minference_csrc", "rewrite_dump_dir", "smollm2_dir",
           "vllm_decode_graphs_enabled", "vllm_drop_enabled"]


def _path_from_env(name: str, default: Path) -> Path:
    value = os.environ.get(name, "").strip()
    return Path(value).expanduser() if value else default


def cache_dir() -> Path:
    """Root of uniprefill's caches (`UNIPREFILL_CACHE_DIR`, default `~/.cache/uniprefill`)."""
    return _path_from_env("UNIPREFILL_CACHE_DIR", Path.home() / ".cache" / "uniprefill")


def gemma_dir() -> Path:
    """Folder of the converted Gemma-3-270M (`UNIPREFILL_GEMMA_DIR`)."""
    return _path_from_env("UNIPREFILL_GEMMA_DIR", cache_dir() / "gemma-3-270m")


def smollm2_dir() -> Path:
    """Folder of the converted SmolLM2-135M (`UNIPREFILL_SMOLLM2_DIR`)."""
    return _path_from_env("UNIPREFILL_SMOLLM2_DIR", cache_dir() / "smollm2-135m")


def force_hub_offline() -> None:
    """Forbid model-hub downloads for this process (sets `HF_HUB_OFFLINE=1`)."""
    os.environ["HF_HUB_OFFLINE"] = "1"


def minference_csrc() -> str | None:
    """UNIPREFILL_MINFERENCE_CSRC, or None when unset or empty."""
    value = os.environ.get("UNIPREFILL_MINFERENCE_CSRC", "").strip()
    return value or None


def haystack_path() -> str | None:
    """UNIPREFILL_HAYSTACK, or None when unset or empty."""
    value = os.environ.get("UNIPREFILL_HAYSTACK", "").strip()
    return value or None


def vllm_drop_enabled() -> bool:
    """UNIPREFILL_VLLM_DROP == "1": the experimental vLLM rewrite may run."""
    return os.environ.get("UNIPREFILL_VLLM_DROP", "").strip() == "1"


def vllm_decode_graphs_enabled() -> bool:
    """UNIPREFILL_VLLM_DECODE_GRAPHS == "1": a dropping vLLM engine may decode under CUDA graphs."""
    return os.environ.get("UNIPREFILL_VLLM_DECODE_GRAPHS", "").strip() == "1"


def vllm_untested_allowed() -> bool:
    """UNIPREFILL_VLLM_ALLOW_UNTESTED == "1": dropping may run on an unverified vLLM version."""
    return os.environ.get("UNIPREFILL_VLLM_ALLOW_UNTESTED", "").strip() == "1"


def rewrite_dump_dir() -> Path | None:
    """UNIPREFILL_VLLM_REWRITE_DUMP, or None when unset or empty."""
    value = os.environ.get("UNIPREFILL_VLLM_REWRITE_DUMP", "").strip()
    return Path(value).expanduser() if value else None
