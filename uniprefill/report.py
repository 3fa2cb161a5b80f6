"""`GraphReport`: what a uniprefill backend did with one graph, the same type for the Hugging Face
backend (`uniprefill.backend`, `uniprefill.graph_reports(compiled)`) and the vLLM backend
(`uniprefill.vllm.plugin.VllmTokenDropBackend.graphs`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GraphReport:
    """What a backend did with one graph.

    rewritten: whether the graph runs rewritten (else it runs as it came, for `reason`).
    reason: an `Unaccelerated` (message and kind) when not rewritten.
    layers: the layers read in the graph (Hugging Face: a `LayerReport` each; vLLM: attention layer indices).
    drop_layers: the drop points (vLLM: None where the graph's layers could not be read).
    counts: the rewrite's counts by name (nodes rewritten per kind; vLLM: gathers, sizes, scatters, windows).
    graph_ops: ops counted in the graph as it came (vLLM: attention, kv_cache_update, gdn, placeholders).
    plan_error: why the layers or drop points could not be read, if so.
    single_row_only / single_row_reason: Hugging Face graphs whose batches of several rows run unaccelerated.
    """

    rewritten: bool
    reason: str = ""
    layers: list | tuple = field(default_factory=list)
    drop_layers: tuple[int, ...] | None = ()
    counts: dict = field(default_factory=dict)
    single_row_only: bool = False
    single_row_reason: str = ""
    graph_ops: dict = field(default_factory=dict)
    plan_error: str = ""

    def __str__(self) -> str:
        head = "rewritten" if self.rewritten else f"left unchanged: {self.reason}"
        lines = [f"graph {head}"]
        if self.graph_ops:
            lines.append(f"  ops in the graph: {self.graph_ops}")
        if self.plan_error:
            lines.append(f"  layers not read: {self.plan_error}")
        if self.rewritten:
            lines.append(f"  drop layers {list(self.drop_layers or ())}; rewrites {self.counts}")
            if self.single_row_only:
                lines.append(f"  batches of several rows run unaccelerated: {self.single_row_reason}")
        if self.layers and all(isinstance(layer, int) for layer in self.layers):
            lines.append(f"  layers {list(self.layers)}")
        else:
            lines += [f"  {layer}" for layer in self.layers]
        return "\n".join(lines)
