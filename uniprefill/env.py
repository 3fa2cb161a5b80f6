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
    UNIPREFILL_VLLM_REWRITE_DUMP: a folder; when set, the vLLM plugin writes each rewritten
        graph's code there (`rewrite_dump_dir()`), for debugging on the GPU box.
    UNIPREFILL_DEBUG_KEEP_FA3_PLAN: "1" keeps vLLM's FA3 plan in the decode graphs of the layers
        after a drop point (`debug_keep_fa3_plan()`): a diagnosis aid, sound at p = 1 only
        (`uniprefill.vllm.graph_decode`).
    UNIPREFILL_DEBUG_KEEP_COMBO_BENCHMARK: "1" leaves Inductor's `benchmark_combo_kernel` as vLLM
        set it in a rewritten mode-3 graph (`debug_keep_combo_benchmark()`): a diagnosis aid of
        p = 1 parity (`uniprefill.vllm.piecewise`), which may fail to compile.
    UNIPREFILL_DEBUG_PER_ROW_WINDOW: "1" runs the per-row paged-window kernel for every row of vLLM's sliding
        layers after a drop, also where the tiled one runs otherwise (requests of many rows) (`debug_per_row_window()`,
        `uniprefill.vllm.window`): an A/B aid, never a setting.
    UNIPREFILL_DEBUG_UNSPLIT_WINDOW: "1" runs each row of the per-row paged-window kernel on one program, also in
        steps of few rows (decode), where it is split over several programs otherwise (`debug_unsplit_window()`,
        `uniprefill.vllm.window.split_count`): an A/B aid, never a setting.
    TRITON_INTERPRET: Triton's own switch ("1": run Triton kernels in its CPU interpreter);
        `uniprefill.kernels` reads it (kernels/_common.py) to allow Triton on CPU tensors.
        tests/conftest.py sets it when there is no CUDA device.

Read only to warn that they are gone (`legacy_vllm_switches()`): UNIPREFILL_VLLM_DROP,
    UNIPREFILL_VLLM_DECODE_GRAPHS, UNIPREFILL_VLLM_ALLOW_UNTESTED. They were switches of the vLLM
    plugin; they are the config fields `vllm_drop`, `vllm_decode_graphs` and `vllm_allow_untested`
    now, given in the same dict as the other options.

Set, never read:
    HF_HUB_OFFLINE: `force_hub_offline()` sets it to "1" before a model is loaded, so that
        nothing is fetched from a model hub at run time. The loaders also pass
        `local_files_only=True`, which holds even when `huggingface_hub` was imported (and
        read the variable) earlier.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "force_hub_offline", "gemma_dir", "haystack_path", "legacy_vllm_switches", "minference_csrc",
           "prepare_vllm_channel", "rewrite_dump_dir", "smollm2_dir"]


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


LEGACY_VLLM_SWITCHES = {"UNIPREFILL_VLLM_DROP": "vllm_drop", "UNIPREFILL_VLLM_DECODE_GRAPHS": "vllm_decode_graphs",
                        "UNIPREFILL_VLLM_ALLOW_UNTESTED": "vllm_allow_untested"}


def legacy_vllm_switches() -> dict[str, str]:
    """The former vLLM switches set in this environment -> the config field that replaced each."""
    return {name: field for name, field in LEGACY_VLLM_SWITCHES.items() if os.environ.get(name, "").strip()}


def rewrite_dump_dir() -> Path | None:
    """UNIPREFILL_VLLM_REWRITE_DUMP, or None when unset or empty."""
    value = os.environ.get("UNIPREFILL_VLLM_REWRITE_DUMP", "").strip()
    return Path(value).expanduser() if value else None


def debug_keep_fa3_plan() -> bool:
    """UNIPREFILL_DEBUG_KEEP_FA3_PLAN == "1" (a diagnosis aid of the vLLM decode graphs, never a setting)."""
    return os.environ.get("UNIPREFILL_DEBUG_KEEP_FA3_PLAN", "") == "1"


def debug_keep_combo_benchmark() -> bool:
    """UNIPREFILL_DEBUG_KEEP_COMBO_BENCHMARK == "1" (a diagnosis aid of the vLLM mode-3 rewrite, never a setting)."""
    return os.environ.get("UNIPREFILL_DEBUG_KEEP_COMBO_BENCHMARK", "") == "1"


def debug_unsplit_window() -> bool:
    """UNIPREFILL_DEBUG_UNSPLIT_WINDOW == "1" (an A/B aid of the vLLM sliding layers' window kernel, never a setting)."""
    return os.environ.get("UNIPREFILL_DEBUG_UNSPLIT_WINDOW", "") == "1"


def debug_per_row_window() -> bool:
    """UNIPREFILL_DEBUG_PER_ROW_WINDOW == "1" (an A/B aid of the vLLM sliding layers' window kernel, never a setting)."""
    return os.environ.get("UNIPREFILL_DEBUG_PER_ROW_WINDOW", "") == "1"


def prepare_vllm_channel() -> None:
    """The environment vLLM reads at import for the uniprefill channel (its EngineCore process
    inherits it): `VLLM_USE_AOT_COMPILE=0` (mode 2 with a custom backend cannot AOT-compile,
    docs/vllm.md) and, unless set, `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (`collect_drop_totals`
    sends a function through `collective_rpc`). Call it before importing vLLM."""
    os.environ["VLLM_USE_AOT_COMPILE"] = "0"
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
