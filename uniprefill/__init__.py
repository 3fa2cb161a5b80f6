"""uniprefill: architecture-agnostic long-context prefill acceleration.

At chosen full-attention layers, tokens are scored by the attention they receive from the
last queries; the smallest set of blocks holding a share `p` of it is kept and every later
sublayer runs on the kept tokens only. Importing this package initialises no GPU and
imports neither vLLM nor transformers.
"""

from .backend import UniPrefillBackend, compile, graph_reports, last_drop_report, uniprefill_backend
from .config import UniPrefillConfig


def _register_backend_name() -> None:
    """`import uniprefill` makes `backend="uniprefill"` work without the installed entry point
    (a source checkout on PYTHONPATH). Installed, the entry point names it and nothing is done
    here: registering would import torch._dynamo, which a lean import (and vLLM's plugin
    loading in every worker) should not pay for."""
    from importlib.metadata import entry_points

    if any(ep.name == "uniprefill" for ep in entry_points(group="torch_dynamo_backends")):
        return
    from torch._dynamo.backends import registry

    if "uniprefill" not in registry._COMPILER_FNS:  # noqa: SLF001  (no public "is registered" query)
        registry.register_backend(uniprefill_backend, name="uniprefill")


_register_backend_name()

__version__ = "0.1.0"
__all__ = ["UniPrefillBackend", "UniPrefillConfig", "compile", "graph_reports", "last_drop_report", "uniprefill_backend",
           "__version__"]
