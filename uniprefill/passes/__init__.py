"""The graph passes of uniprefill, in the order they run on a dynamo graph (docs/architecture.md):

`classify` (layer kinds and attention sites) -> `plan` (token axes, input roles, masks checked by
value in `mask_meaning`, drop points from `drop_points`) -> `token_drop` (the rewrite, with
`attention_copy`, `sink_attention`, `shape_exprs`, `graph_calls`) -> `rewrite_result`.
`fake_values` gives the rewritten graph's nodes their `meta["val"]`; `pass_uuid` names the code
and settings of a rewrite, for caches that must never serve a graph rewritten by other code.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

# Everything whose code decides what a rewritten graph computes: the passes, the ops they insert,
# the kernels behind them (`uniprefill.kernels`, a folder of its own in a source checkout), the scan
# ops `uniprefill.compile` routes transformers' fallbacks through (`compat`, `scan_ops`) and the
# config they read.
_SOURCES = ("uniprefill.passes", "uniprefill.kernels", "uniprefill.ops", "uniprefill.attention_ops",
            "uniprefill.sink_ops", "uniprefill.record_ops", "uniprefill.scan_ops", "uniprefill.compat",
            "uniprefill.config")


def source_files(extra_sources: tuple[str, ...] = ()) -> list[tuple[str, Path]]:
    """(name, path) of every source file whose code decides what a rewritten graph computes (`_SOURCES`
    and `extra_sources`, modules or packages), in a fixed order."""
    out = []
    for name in _SOURCES + tuple(extra_sources):
        path = Path(importlib.import_module(name).__file__).resolve()
        files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
        out.extend((f"{name}/{file.relative_to(path.parent).as_posix()}", file) for file in files)
    return out


def pass_uuid(config, extra_sources: tuple[str, ...] = ()) -> str:
    """A hex digest of the rewrite's source files and `config.stable_hash()`, as Inductor's
    `CustomGraphPass.uuid()` and vLLM's `InductorPass.uuid()` name a pass: equal for the same code
    and settings in any process, different when either changes. `extra_sources`: more modules or
    packages whose code decides the rewrite (the vLLM backend adds `uniprefill.vllm`)."""
    digest = hashlib.sha256()
    for name, file in source_files(extra_sources):
        digest.update(name.encode())
        digest.update(file.read_bytes())
    digest.update(config.stable_hash().encode())
    return digest.hexdigest()
