"""Why an attention mask is not understood, in words a user can act on.

`classify.analyse_mask` accepts a mask only when the subgraph that builds it compares token
indices and reads the padding mask. When it reads anything else, this module says what the
mask is, from the same subgraph (never from the model's name):

* keys chosen by `topk` / `sort` per query, inside the attention module: sparse attention (DeepSeek sparse attention's
  indexer, a dynamic top-k mask). Which keys win depends on every key present, so after a drop
  the kept tokens would attend a different set than in the plain model;
* a mask computed from the layer's activations through learned weights (a per-key bias or a
  gate read from the hidden states): a data-dependent mask, not causal + padding;
* a `[1, 1, M, M]` table the model holds (a registered buffer) that the mask slices, when its values
  are not a causal band (`causal_table`), or when it is held as a graph attribute no check sees;
* a tensor input of the graph that the mask reads whole (e.g. a `[B, 1, N, N]` mask built in an
  earlier graph, before a graph break): its meaning cannot be read from this graph.

Anything else keeps the list of ops the mask is built with.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .causal_table import is_table_shaped
from .fx_utils import example_value, is_sdpa, module_paths, target_name

_SELECTION_OPS = ("topk", "sort", "argsort", "kthvalue")
_PROJECTIONS = ("linear", "matmul", "bmm", "einsum", "conv")


def is_selection(node: fx.Node) -> bool:
    """A top-k or sort: the mask keeps the keys that win a comparison of data-dependent scores."""
    return node.op in ("call_function", "call_method") and target_name(node).rsplit(".", 1)[-1] in _SELECTION_OPS


def is_weight(node: fx.Node) -> bool:
    """A parameter or buffer of the model, lifted to a graph input by dynamo."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None) if source is not None else node.name
    name = name() if callable(name) else str(name)  # a method in older torch, a property in newer
    return "_parameters" in name or "_buffers" in name or ".weight" in name


def unknown_mask_reason(sdpa: fx.Node, nodes: set[fx.Node], unknown_ops: set[str], unknown_inputs: list[fx.Node]) -> str:
    """The reason the mask of `sdpa`, built by `nodes` (its ancestors), is not understood."""
    ops = {target_name(n).rsplit(".", 1)[-1] for n in nodes if n.op in ("call_function", "call_method")}
    weights = [n for n in unknown_inputs if is_weight(n)]
    activations = weights and any(any(p in op for p in _PROJECTIONS) for op in ops | unknown_ops)
    if any(is_selection(n) and _inside(n, sdpa) for n in nodes):
        how = " by a learned scorer (an indexer)" if activations else ""
        return ("sparse attention: the keys each query attends are chosen by top-k over data-dependent scores"
                f"{how}; after a drop the kept tokens would compete for other keys than in the plain model")
    tables = [n for n in unknown_inputs if is_table_shaped(example_value(n))]
    if tables:
        return (f"a causal mask sliced from a {_shape(tables[0])} table the model holds ({tables[0].name}, a "
                "registered buffer) whose values are not a lower-triangular band of ones (causal, or causal with "
                "a window), or which no per-call check sees (a graph attribute): what it masks is not modelled")
    if activations:
        return ("a data-dependent mask: it is computed from the layer's activations through learned weights "
                "(e.g. a per-key bias or gate), not only from token positions and padding")
    others = [n for n in unknown_inputs if not is_weight(n)]
    if others:
        shapes = ", ".join(f"{n.name} {_shape(n)}" for n in others[:3])
        return (f"the mask is the graph input {shapes}, built outside this graph (e.g. before a graph break): "
                "what it masks cannot be read here")
    listed = sorted(unknown_ops)
    more = f" and {len(listed) - 8} more" if len(listed) > 8 else ""
    return f"mask built with {', '.join(listed[:8])}{more}"


def _inside(node: fx.Node, sdpa: fx.Node) -> bool:
    """`node` was traced inside a module that calls attention (an indexer, this layer's or one
    whose choice later layers share): a top-k of a router, which the mask reads through the
    hidden states, is not."""
    modules = {paths[-1][0] for paths in (module_paths(n) for n in sdpa.graph.nodes if is_sdpa(n)) if paths}
    return any(path == m or path.startswith(m + ".") for path, _ in module_paths(node) for m in modules)


def _shape(node: fx.Node) -> str:
    val = example_value(node)
    return str(list(val.shape)) if isinstance(val, torch.Tensor) else ""
