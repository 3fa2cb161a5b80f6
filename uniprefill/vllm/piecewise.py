"""Token dropping under vLLM's default compilation (mode 3, VLLM_COMPILE): the rewrite in front of
vLLM's own backend, so that Inductor, vLLM's passes and piecewise CUDA graphs compile the rest.

In mode 3 vLLM builds a `VllmBackend` per compiled model and dynamo hands it the whole backbone
graph; it splits the graph at `compilation_config.splitting_ops` (attention, KV-cache updates),
compiles every piece between them with Inductor for the symbolic token count, and wraps each in a
piecewise CUDA graph for the small batch sizes. The user switches uniprefill on with the settings
alone, `compilation_config={"inductor_compile_config": {"uniprefill": {...}}}`, every other setting
left at vLLM's default. `install(VllmBackend)` (the plugin's `register()`, in every vLLM process)
wraps `VllmBackend.__call__`; for a backend whose config carries those settings it

1. removes the settings from the Inductor options the backend hands on (Inductor rejects unknown
   keys; they stay in vLLM's config and so in its compile-cache hash);
2. rewrites the graph as in modes 1 and 2 (`VllmTokenDropBackend.rewrite_graph`: the drop points,
   gathers, windowed sliding layers, scatter at the output), or leaves it as it is, with the
   reason logged, where that cannot run;
3. gives every node of the rewritten graph its fake value (`example_value`, which vLLM's split
   and piecewise compilation read; after a drop point the row count is the drop's unbacked size);
4. adds the rewrite's source files to the files vLLM hashes into its compile-cache directory
   (`add_rewrite_sources`; before step 2, so also where the graph then runs unrewritten), and
   `graph_ops.SPLITTING_OPS` to the splitting ops: the drop point, its row count, the
   per-step reset and the window attention then run in Python on every step, between the
   compiled pieces, as vLLM's attention does; and turns off Inductor's `benchmark_combo_kernel`
   (vLLM's default on): it needs a size hint for every symbol, which a drop's row count has not;
   gives the kept row counts backed symbols in the fake values the pieces are compiled from
   (`backed_rows`: with unbacked counts Inductor fuses and hints the pieces after a drop unlike
   vLLM's, and at p = 1 their numbers differ), and, where they stay unbacked, the token count's
   size hint (Inductor's `unbacked_symint_fallback`, unless the user set it);
5. calls vLLM's backend with the rewritten graph, and makes the runtime current around each call
   of the compiled function (`graph_ops.running`). The function keeps the ORIGINAL graph for
   vLLM's AOT-compile cache: an engine that loads it calls the backend again, and this wrapper
   rewrites it anew (with a fresh runtime).

CUDA graphs: a step that replays piecewise graphs keeps every row (`VllmDropRuntime.drop`,
`SkipReason.CUDA_GRAPH`; such steps are at most `max_cudagraph_capture_size` tokens); decode
steps under full graphs read the drop histories on the device (`vllm.graph_decode`).

Left unaccelerated, with the reason logged: Inductor graph partition (`use_inductor_graph_partition`,
no FX split), no splitting ops, single-size compilation (`compile_sizes`: vLLM's `create_concrete_args`
gives every symbol of a piece that one size, the kept rows included), and vLLM's "mega" AOT artifact
(`VLLM_USE_MEGA_AOT_ARTIFACT`, on by default with torch >= 2.12: a warm start rebuilds the compiled
pieces without calling the backend, so no runtime would be attached to the rewritten pieces).
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from .. import env
from . import backed_rows
from .checks import CONFIG_KEY, _get, config_from_compilation_config
from .class_patch import unwrap_method, wrap_method
from .graph_ops import SPLITTING_OPS, running

logger = logging.getLogger("uniprefill.vllm")

_MARK = "_uniprefill_piecewise"


def unaccelerated_reason(vllm_config: Any, mega_artifact: bool) -> str | None:
    """Why a mode-3 engine with uniprefill settings runs its graph as vLLM built it, or None."""
    cc = _get(vllm_config, "compilation_config")
    if _get(cc, "use_inductor_graph_partition", False):
        return ("use_inductor_graph_partition: Inductor splits the graph inside its own compilation, where the "
                "drop point cannot run between the pieces")
    if not _get(cc, "splitting_ops"):
        return "no splitting_ops: the graph is compiled whole, and the drop point must run in Python every step"
    if _get(cc, "compile_sizes"):
        return ("compile_sizes: vLLM compiles a piece for one size by giving every symbol of it that size, which "
                "would give the rows kept at a drop point the token count")
    if mega_artifact:
        return ("VLLM_USE_MEGA_AOT_ARTIFACT=1 (vLLM's default with torch >= 2.12): a warm start rebuilds the "
                "compiled pieces without calling the backend, so the rewritten pieces would run without their "
                "drop runtime; set VLLM_USE_MEGA_AOT_ARTIFACT=0 to drop")
    return None


def _mega_artifact() -> bool:
    try:
        from vllm import envs

        return bool(envs.VLLM_USE_MEGA_AOT_ARTIFACT)
    except (ImportError, AttributeError):
        return False


def rewrite_for_vllm_backend(backend: Any, graph: Any, example_inputs: Any) -> tuple[Any, Any, Any] | None:
    """(rewritten graph with fake values on every node, its runtime, its `backed_rows.BackedRows`), or
    None where the graph runs as vLLM built it (the reason logged). `backend` is the `VllmBackend` being
    called."""
    from .plugin import VllmTokenDropBackend, _vllm_version

    vllm_config = backend.vllm_config
    reason = unaccelerated_reason(vllm_config, _mega_artifact())
    if reason is not None:
        message = f"uniprefill: running the vLLM graph unaccelerated: {reason}"
        logger.warning(message)
        warnings.warn(message, stacklevel=3)
        return None
    drop_backend = VllmTokenDropBackend.from_vllm_config(vllm_config, _vllm_version(), aot_compile=None)
    rewritten = drop_backend.rewrite_graph(graph, example_inputs)
    if rewritten is None:
        return None
    set_example_values(rewritten)
    reason = backed_rows.skip_reason(vllm_config)
    if reason is None:
        backed = backed_rows.back_kept_row_counts(rewritten)
        logger.info("uniprefill: the pieces after the drop points are compiled for backed row counts %s",
                    backed.renamed)
    else:
        backed = backed_rows.BackedRows({})
        logger.info("uniprefill: the drop points' row counts stay unbacked in the compiled pieces: %s", reason)
    return rewritten, drop_backend.runtimes[-1], backed


def set_example_values(gm: Any) -> int:
    """`meta["example_value"]` (what vLLM's split and piecewise compilation read) on every node of a
    rewritten graph, from one fake run (`passes.fake_values`); the number of nodes set."""
    from ..passes.fake_values import propagate_fake_values

    propagate_fake_values(gm)
    count = 0
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            node.meta["example_value"] = node.meta["val"]
            count += 1
    return count


def add_rewrite_sources(compilation_config: Any) -> int:
    """Add the rewrite's source files (`passes.source_files`: the passes, the ops and kernels they insert,
    `uniprefill.vllm`) to `compilation_config.traced_files`, the files whose text vLLM hashes into its
    compile-cache directory with the config (`VllmBackend.__call__`); the number added. Without them an
    engine started after uniprefill changed would load pieces compiled from the graph the OLD code
    rewrote (vLLM loads a piece by its index, not by its graph); the settings themselves are in the
    config's hash already. Called for every backend call of an engine with the settings (vLLM clears the set
    after each call, and names the directory at the first). A vLLM without `traced_files`: nothing added."""
    from ..passes import source_files

    traced = getattr(compilation_config, "traced_files", None)
    if not isinstance(traced, set):
        return 0
    before = len(traced)
    traced.update(str(path) for _, path in source_files(extra_sources=("uniprefill.vllm",)))
    return len(traced) - before


def add_splitting_ops(compilation_config: Any) -> list[str]:
    """Append `SPLITTING_OPS` to `compilation_config.splitting_ops` (those missing); the ops added."""
    ops = compilation_config.splitting_ops
    added = [op for op in SPLITTING_OPS if op not in ops]
    ops.extend(added)
    return added


def install(backend_cls: Any) -> bool:
    """Wrap `backend_cls.__call__` (vLLM's `VllmBackend`) as the module docstring says; False when
    it was already installed."""
    return wrap_method(backend_cls, "__call__", _rewriting_call, _MARK)


def uninstall(backend_cls: Any) -> bool:
    """Undo `install`. False when it was not installed."""
    return unwrap_method(backend_cls, "__call__", _MARK)


def _rewriting_call(original):
    def __call__(self, graph, example_inputs):
        if config_from_compilation_config(self.compilation_config) is None:
            return original(self, graph, example_inputs)
        self.inductor_config.pop(CONFIG_KEY, None)
        # every backend of an engine with the settings, rewritten or not: vLLM names the cache directory at the
        # engine's first backend call (an encoder's, or a module left unrewritten) and later calls reuse it
        add_rewrite_sources(self.compilation_config)
        prepared = rewrite_for_vllm_backend(self, graph, example_inputs)
        if prepared is None:
            return original(self, graph, example_inputs)
        rewritten, runtime, backed = prepared
        add_splitting_ops(self.compilation_config)
        hint = backed_rows.token_count_hint(rewritten)
        if not backed.renamed and hint is not None and "unbacked_symint_fallback" not in self.inductor_config:
            # where the kept row counts stay unbacked (`backed_rows.skip_reason`), Inductor hints them with
            # its generic fallback (8192): give them the token count's hint (the size vLLM traced) instead
            self.inductor_config["unbacked_symint_fallback"] = hint
        if self.inductor_config.get("benchmark_combo_kernel") and not env.debug_keep_combo_benchmark():
            # benchmarking a combined kernel generates code that needs a size hint for every symbol, and
            # the rows kept at a drop point (an unbacked size) have none ("Cannot convert symbols to int",
            # H200, vLLM 0.26.0, several drop points): combine kernels without benchmarking them
            self.inductor_config["benchmark_combo_kernel"] = False
        compiled = original(self, rewritten, example_inputs)  # every piece compiled here, up front
        backed.forget_guards()
        if hasattr(compiled, "graph_module"):
            compiled.graph_module = graph  # what vLLM's AOT-compile cache saves: rewritten again on load
        call = compiled.optimized_call

        def optimized_call(*args, **kwargs):
            with running(runtime):
                return call(*args, **kwargs)

        compiled.optimized_call = optimized_call
        return compiled

    return __call__


def install_where_vllm_runs() -> bool:
    """`install` on vLLM's `VllmBackend` in a process where vLLM is imported; imports nothing without it."""
    if "vllm" not in sys.modules:
        return False
    from vllm.compilation.backends import VllmBackend

    return install(VllmBackend)
