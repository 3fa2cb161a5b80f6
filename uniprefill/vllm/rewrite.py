"""The token-drop rewrite of a vLLM backbone graph (stage 2: prefill-only dropping).

Input: the graph vLLM's mode 2 hands to `compilation_config.backend` (flat `[s, ...]`
token-major values, `positions`, attention as `unified_kv_cache_update` +
`unified_attention_with_output` per layer; `uniprefill.vllm.graph` reads it). For each
drop layer L, right after L's attention op the rewrite inserts

    keep_L = uniprefill::vllm_drop(q_L, k_L, P)   # runtime.drop (uniprefill.vllm.drop): select, compact, install metadata

(P: L's position among the attention layers, the runtime's index; L itself when every layer attends)

and then gathers (`uniprefill::gather_rows`), with `keep_L`, every token-aligned value that is used after that point (the
residual stream, the attention output, `positions`: a value is token-aligned when its traced
leading dimension is the graph's token symbol `s`); uses of `s` itself after the point
(e.g. `torch.empty((s, heads * dim))` for the next attention output) become the kept count.
Everything after L therefore runs on the kept rows, with the later layers' metadata pointing at
the compacted batch. At the output, token-aligned results are scattered back to `s` rows (rows
of dropped tokens are zero): vLLM reads logits at each request's last token, which is always
kept. Other token-aligned outputs (computed before the drop, as far as FX shows) go through
`check_rows`, so that one the analysis missed fails with a clear error instead of reaching vLLM
with the kept rows only. The rewritten graph runs eagerly (no Inductor), as vLLM's mode 2 with this backend does.

Everything inserted is a `torch.library` op with a fake (`uniprefill.vllm.graph_ops`); the ops
that act on the runtime find it through `graph_ops.running`, which the rewritten GraphModule's
`forward` enters on every call.

A Gated DeltaNet layer (Qwen3-Next) after a drop point needs nothing here: its inputs are gathered like any
token-aligned value, and its op reads metadata the runtime rebuilt for the kept rows (`uniprefill.vllm.gdn_metadata`).

A sliding-window layer after a drop point keeps its KV-cache update (the runtime gave it
right-aligned slots) and its attention becomes `uniprefill::vllm_window_attention` (`runtime.window_attention`):
a window over ORIGINAL positions (`uniprefill.vllm.window`), not FlashAttention's
window over cache entries.

Refused with a ValueError naming the reason (the backend then runs the graph unaccelerated):
a drop layer that is not an attention site, a sliding-window layer after a drop point that
the runtime has no window for, a value used after a drop point
whose token axis is not its first, a symbolic size derived from `s` (other than `s`), or a
graph output computed after a drop point that is not one row per token (e.g. a sum over
tokens: it would change with the drop and cannot be scattered back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from uniprefill.models.layer_kinds import LayerKind
from uniprefill.passes.fx_utils import TokenAxes

from . import graph_ops
from .graph import VllmGraphInfo


@dataclass(frozen=True)
class VllmRewriteResult:
    drop_layers: tuple[int, ...]
    gathered: int  # gather nodes inserted
    sizes_replaced: int  # uses of the token count replaced by a kept count
    scattered: int  # outputs scattered back to all rows
    windowed: int = 0  # sliding-window attentions after a drop replaced by `uniprefill::vllm_window_attention`


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of `gm`'s graph (nodes and their meta) sharing its parameters,
    so that a rewrite that fails half-way leaves `gm` as it was."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph)


def _example(node) -> object:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _token_axes(gm: fx.GraphModule, info: VllmGraphInfo) -> TokenAxes:
    """The token axis of vLLM's flat token-major values: dynamo gives `input_ids` and `positions`
    a symbol each (s72 and s80 in the H200 dump), both the step's number of tokens; the second
    becomes an alias of the first (the same `TokenAxes` the Hugging Face pass uses, no batch axis)."""
    value = _example(info.positions)
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise ValueError("the positions placeholder has no 1-D example value: the token count is unknown")
    size = value.shape[0]
    if not isinstance(size, torch.SymInt):
        raise ValueError(f"the positions placeholder has a static length {size}: the token count is not symbolic")
    seq = size.node.expr
    aliases = []
    for node in gm.graph.nodes:
        ids = _example(node)
        if node.op == "placeholder" and "input_ids" in node.name and isinstance(ids, torch.Tensor) and ids.dim() == 1:
            other = ids.shape[0]
            if isinstance(other, torch.SymInt) and other.node.expr != seq:
                aliases.append((other.node.expr, seq))
    return TokenAxes(batch=1, seq=seq, static=False, aliases=tuple(aliases))


def rewrite_vllm_graph(gm: fx.GraphModule, info: VllmGraphInfo, drop_layers: Sequence[int],
                       layer_kinds: Sequence[str], runtime) -> VllmRewriteResult:
    """Rewrite `gm` in place (see the module docstring); `runtime` is a `VllmDropRuntime`.

    A ValueError can come after part of the graph was changed: rewrite a `copy_graph_module`
    and keep the original for the unaccelerated path."""
    drop_layers = tuple(sorted(drop_layers))
    if not drop_layers:
        raise ValueError("no drop layers")
    for layer in drop_layers:
        info.site(layer)  # KeyError -> not an attention site
    first = drop_layers[0]
    sliding_after = [site for site in info.sites if site.layer > first
                     and site.layer < len(layer_kinds) and layer_kinds[site.layer] == LayerKind.SLIDING]
    unknown = [site.layer for site in sliding_after if site.layer_name not in runtime.windows]
    if unknown:
        raise ValueError(f"sliding-window layers {unknown} run after drop layer {first} and the runtime has no "
                         "window for them (their window over original positions needs one)")
    axes = _token_axes(gm, info)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        begin = graph.call_function(torch.ops.uniprefill.vllm_begin_step.default, (info.positions,))
    with graph.inserting_after(begin):
        num_tokens = graph.call_function(torch.ops.aten.sym_size.int, (info.positions, 0))
    aligned: set[fx.Node] = set()  # nodes this rewrite made that are token-aligned (no example value)
    counts: set[fx.Node] = set()  # nodes this rewrite made that hold the current token count
    gathered = sizes = 0
    keeps: list[fx.Node] = []
    for layer in drop_layers:
        site = info.site(layer)
        with graph.inserting_after(site.attention):
            keep = graph.call_function(torch.ops.uniprefill.vllm_drop.default,
                                       (site.query, site.key, info.position(layer)))
        keeps.append(keep)
        order = {node: i for i, node in enumerate(graph.nodes)}
        point = order[keep]
        with graph.inserting_after(keep):
            kept_count = graph.call_function(torch.ops.uniprefill.vllm_kept_rows.default, (keep,))
        counts.add(kept_count)
        cursor = kept_count
        for node in list(graph.nodes):
            if order.get(node, point + 1) > point or node in (begin, num_tokens):
                continue
            later_users = [u for u in node.users if order.get(u, -1) > point]  # nodes made here have no order
            if not later_users:
                continue
            value = _example(node)
            if node in aligned or axes.token_major(value):
                with graph.inserting_after(cursor):
                    replacement = graph.call_function(torch.ops.uniprefill.gather_rows.default, (node, keep))
                cursor = replacement
                aligned.add(replacement)
                gathered += 1
            elif node in counts or axes.is_token_count(value):
                replacement = kept_count
                sizes += 1
            elif axes.depends_on_tokens(value):
                raise ValueError(f"{node.name} ({value!r}) depends on the token count in a way the rewrite "
                                 f"cannot follow, and is used after drop layer {layer}")
            else:
                continue
            for user in later_users:
                user.replace_input_with(node, replacement)
    # sliding layers after a drop: a window over original positions instead of vLLM's attention
    for site in sliding_after:
        node = site.attention
        query, key, value, output, _ = _attention_args(node)
        position = info.position(site.layer)  # the runtime's layer index
        runtime.vllm_attention[position] = node.target  # vLLM's op, for its dummy runs
        with graph.inserting_before(node):  # the name as a string: vLLM's may be a hoisted opaque LayerName
            replacement = graph.call_function(
                torch.ops.uniprefill.vllm_window_attention.default,
                (query, key, value, output, site.layer_name, position, node.kwargs.get("kv_cache_dummy_dep")))
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
    # the output: scatter token-aligned results back to all rows
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        rows = keeps[0]
        for keep in keeps[1:]:
            rows = graph.call_function(torch.ops.uniprefill.gather_rows.default, (rows, keep))
    scattered = 0

    def back(arg):
        nonlocal scattered
        # computed after a drop: from a gathered value, or from a kept count (vLLM fills buffers made with
        # `torch.empty((kept, ...))` in place, e.g. silu_and_mul's output: no FX edge to a gathered value)
        if not isinstance(arg, fx.Node):
            return arg
        if not (arg in aligned or _descends_from(arg, aligned | counts)):
            if not axes.token_major(_example(arg)):
                return arg
            with graph.inserting_before(output):  # computed before the drop, as far as FX shows: checked
                graph.call_function(torch.ops.uniprefill.check_rows.default, (arg, num_tokens, arg.name))
                return arg
        if arg not in aligned and not axes.token_major(_example(arg)):
            raise ValueError(f"the graph output {arg.name} ({_example(arg)!r}) is computed after a drop point "
                             "but is not one row per token: it cannot be scattered back, and would differ")
        with graph.inserting_before(output):
            scattered += 1
            return graph.call_function(torch.ops.uniprefill.scatter_rows.default, (arg, rows, num_tokens))

    output.args = map_aggregate(output.args, back)
    graph.lint()
    gm.recompile()
    _ = gm.code  # dynamo's lazy GraphModule generates its forward on first use: now, before it is wrapped
    graph_forward = gm.forward

    def forward(*args, **kwargs):  # the graph's ops act on `runtime` (`graph_ops.running`)
        with graph_ops.running(runtime):
            return graph_forward(*args, **kwargs)

    gm.forward = forward
    return VllmRewriteResult(drop_layers, gathered, sizes, scattered, len(sliding_after))


def _attention_args(node: fx.Node) -> tuple:
    """(query, key, value, output, layer name) of a `unified_attention_with_output` call, which the
    window op replaces; an extra argument that changes what the op computes (an output scale of a
    quantised output) is refused: the window op would drop it."""
    args = list(node.args[:5])
    names = ("query", "key", "value", "output", "layer_name")
    for name in names[len(args):]:
        if name not in node.kwargs:
            raise ValueError(f"{node.name}: the attention call has no {name} argument")
        args.append(node.kwargs[name])
    extra = [f"argument {i}" for i, a in enumerate(node.args[5:], 5) if a is not None]
    extra += [k for k, v in node.kwargs.items() if k not in names and k != "kv_cache_dummy_dep" and v is not None]
    if extra:
        raise ValueError(f"{node.name}: a sliding-window attention after a drop point with {extra}: the window "
                         "attention over original positions does not implement them")
    return tuple(args)


def _descends_from(node: fx.Node, sources: set[fx.Node]) -> bool:
    """Whether `node` is computed (transitively) from one of `sources` (graph order walk)."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in sources:
            return True
        if current in seen or not isinstance(current, fx.Node):
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return False
