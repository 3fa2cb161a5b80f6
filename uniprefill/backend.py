"""The `torch.compile` backend "uniprefill".

Three ways in:

* `torch.compile(model, backend="uniprefill", options={"p": 0.95})`: resolved through the
  `torch_dynamo_backends` entry point with no import needed; `options` are exactly the
  `UniPrefillConfig` field names.
* `uniprefill.compile(model, UniPrefillConfig(...))`: compiles with dynamic shapes (one
  graph for every prompt length) and keeps the backend on the result, so
  `uniprefill.last_drop_report(compiled)` and `uniprefill.graph_reports(compiled)` work.
* `torch.compile(model, backend=UniPrefillBackend(config))`.

Each graph dynamo hands over is rewritten by `uniprefill.passes.token_drop`. A graph that
cannot be rewritten safely runs unchanged with a warning naming the reason (or raises
under `strict=True`); its reason is kept in `backend.graphs` for users and tests. The
rewritten graph runs as plain PyTorch ops (no Inductor): prefill time is dominated by
matrix products and attention, which the rewrite shortens.

Output contract: logits and hidden states keep their original shapes. The last position's
values are the method's answer; rows of dropped tokens hold the hidden state they had when
dropped (logits computed from those states when the caller asks for all positions).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .config import UniPrefillConfig
from .runtime.history import DropHistory, DropRecorder

logger = logging.getLogger("uniprefill.passes")


@dataclass
class GraphReport:
    """What the backend did with one dynamo graph."""

    rewritten: bool
    reason: str = ""
    layers: list = field(default_factory=list)
    drop_layers: tuple[int, ...] = ()
    counts: dict = field(default_factory=dict)
    single_row_only: bool = False
    single_row_reason: str = ""

    def __str__(self) -> str:
        head = "rewritten" if self.rewritten else f"left unchanged: {self.reason}"
        lines = [f"graph {head}"]
        if self.rewritten:
            lines.append(f"  drop layers {list(self.drop_layers)}; rewrites {self.counts}")
            if self.single_row_only:
                lines.append(f"  batches of several rows run unaccelerated: {self.single_row_reason}")
        lines += [f"  {layer}" for layer in self.layers]
        return "\n".join(lines)


class UniPrefillBackend:
    """A dynamo backend bound to one `UniPrefillConfig` and one drop recorder."""

    def __init__(self, config: UniPrefillConfig | None = None) -> None:
        self.config = config or UniPrefillConfig()
        self.recorder = DropRecorder(self.config.policy)
        self.graphs: list[GraphReport] = []
        self._warned: set[str] = set()
        self.graph_calls = 0  # calls that reached a graph this backend compiled (rewritten or not)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        from .passes.token_drop import RewriteSkipped, TokenDropPass

        if self.config.debug:
            logger.info("uniprefill: graph before rewrite\n%s", gm.print_readable(print_output=False))
        try:
            result = TokenDropPass(gm, self.config, self.recorder).run()
        except RewriteSkipped as exc:
            reason = str(exc)
            self.graphs.append(GraphReport(False, reason))
            if self.config.strict:
                raise RuntimeError(f"uniprefill cannot rewrite this graph: {reason}") from exc
            self._warn(f"uniprefill: running a graph unaccelerated: {reason}")
            return self._counted(gm.forward)
        report = GraphReport(True, "", result.layers, result.drop_layers, result.counts,
                             result.single_row_only, result.single_row_reason)
        self.graphs.append(report)
        if self.config.debug:
            logger.info("uniprefill: graph after rewrite\n%s", result.graph_module.print_readable(print_output=False))
        return self._guarded(gm, result)

    def _counted(self, forward):
        def run(*args):
            self.graph_calls += 1
            return forward(*args)

        return run

    def _guarded(self, original: fx.GraphModule, result):
        """Run the rewrite, except for inputs it must not see (short prompts, several rows it can't pack,
        masks or positions the rewrite does not model: `passes.mask_inputs`)."""
        from .passes.mask_inputs import failed_check

        tokens_pos = _tokens_position(result.graph_module)
        min_tokens = self.config.effective_min_tokens
        rewritten = result.graph_module

        def run(*args):
            tokens = args[tokens_pos]
            self.recorder.last = None
            self.graph_calls += 1
            if tokens.shape[1] < min_tokens:
                return original(*args)
            unsound = failed_check(result.input_checks, args, tokens.shape[0], tokens.shape[1])
            if unsound:
                if self.config.strict:
                    raise RuntimeError(f"uniprefill cannot accelerate this call: {unsound}")
                self._warn(f"uniprefill: this call runs unaccelerated: {unsound}")
                return original(*args)
            if result.single_row_only and tokens.shape[0] > 1:
                self._warn(f"uniprefill: a batch of {tokens.shape[0]} rows runs unaccelerated: {result.single_row_reason}")
                return original(*args)
            if result.returns_cache and tokens.shape[0] > 1:
                self._warn("uniprefill: a batch of several rows that fills a cache runs unaccelerated here; "
                           "uniprefill.compile(...) prefills and decodes such batches row by row")
                return original(*args)
            return rewritten(*args)

        return run

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)

    @property
    def last_history(self) -> DropHistory | None:
        return self.recorder.last

    def layer_windows(self) -> dict[int, int]:
        """Sliding window of every layer of the latest rewritten graph (0: unbounded)."""
        prefill = next((g for g in reversed(self.graphs) if g.rewritten and g.layers), None)
        return {r.layer: r.window for r in prefill.layers} if prefill else {}


def _tokens_position(gm: fx.GraphModule) -> int:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node.op == "call_function" and "embedding" in str(node.target):
            src = node.args[0]
            if src in placeholders:
                return placeholders.index(src)
    for i, node in enumerate(placeholders):
        if "inputs_embeds" in node.name:
            return i
    raise RuntimeError("rewritten graph has no token input")


def uniprefill_backend(gm: fx.GraphModule, example_inputs, options=None, mode=None):
    """Entry point for `torch.compile(model, backend="uniprefill", options={...})`."""
    return UniPrefillBackend(UniPrefillConfig.from_options(options))(gm, example_inputs)


def compile(model: torch.nn.Module, config: UniPrefillConfig | None = None, **options):
    """Compile `model` with the uniprefill backend (dynamic shapes: one graph for every length).

    Pass either a `UniPrefillConfig` or its fields as keywords. Returns a
    `uniprefill.runtime.generation.UniPrefillModel`: calling it runs prefills through the
    compiled graph; its `generate()` decodes against the compacted caches.
    """
    if config is not None and options:
        raise ValueError("pass either a UniPrefillConfig or option keywords, not both")
    config = config or UniPrefillConfig.from_options(options)
    from .compat import make_linear_attention_opaque
    from .runtime.generation import UniPrefillModel

    make_linear_attention_opaque(model)
    backend = UniPrefillBackend(config)
    return UniPrefillModel(model, backend)


def _backend_of(compiled) -> UniPrefillBackend:
    backend = getattr(compiled, "backend", None)
    if backend is None:
        raise ValueError("this model was not compiled with uniprefill.compile(...)")
    return backend


def last_drop_report(compiled) -> DropHistory | None:
    """The drop history of the latest forward call (None if it dropped nothing)."""
    return _backend_of(compiled).last_history


def graph_reports(compiled) -> list[GraphReport]:
    """What the backend did with each graph it was given (layer kinds, drop points, reasons)."""
    return list(_backend_of(compiled).graphs)
