"""uniprefill: architecture-agnostic long-context prefill acceleration.

At chosen full-attention layers, tokens are scored by the attention they receive from the
last queries; the smallest set of blocks holding a share `p` of it is kept and every later
sublayer runs on the kept tokens only. Importing this package initialises no GPU and
imports neither vLLM nor transformers.
"""

from .backend import UniPrefillBackend, compile, graph_reports, last_drop_report
from .config import UniPrefillConfig

__version__ = "0.1.0"
__all__ = ["UniPrefillBackend", "UniPrefillConfig", "compile", "graph_reports", "last_drop_report", "__version__"]
