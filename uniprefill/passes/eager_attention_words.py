"""Eager attention that no pattern matched, named for what it is.

`passes.sink_attention` turns the eager attention forms it knows into one attention node; any
other softmax over `[.., N, N]` logits (N the symbolic token length) stays plain tensor ops, and
the plan then finds no attention site it can follow. `unmatched_eager_attention` says why, by
reading the logits' subgraph back from the softmax to the `q @ k^T` product:

    logits = matmul(q, k^T) * scale (+ term)*              # the running logits: the product's descendants
    softmax(logits)                                        # or softmax(cat([logits, column], -1)): sinks

Each term added to the running logits is named: an additive mask `where(visible, 0, min)` (the
form transformers' masks take: causality enforced there), a per-key bias (ALiBi in a form not
matched), a bias of one value per query and key computed in the graph (Inkling2's relative-position
bias: the hidden states give each query a row of logits over distances, gathered at `q - k`; after
a drop it would have to be rebuilt from the kept tokens' ORIGINAL positions, which the rewrite does
not do) and a mask sliced from a precomputed matrix the model holds (GPT-Neo). A sink column
computed in the graph (one logit per query, `sink_proj(hidden)`) is named apart from the learned
per-head sinks the ops apply. The words only describe; no rewrite depends on them.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .eager_attention_forms import _same
from .eager_attention_pieces import is_call, sinks_of, visible_of_additive
from .fx_utils import ancestors, example_value

__all__ = ["unmatched_eager_attention"]

_PRODUCTS = ("matmul", "bmm", "baddbmm")
_CASTS = ("float", "to", "type_as")
_MASK = "masked by an additive mask where(visible, 0, min), a form the rewrite reads"


def unmatched_eager_attention(graph: fx.Graph) -> str:
    """Why the first softmax over `[.., N, N]` logits (with or without a sink column) left in a graph
    (an eager attention no pattern matched) was not read as attention, naming the form; "" when there is none."""
    for node in graph.nodes:
        val = example_value(node)
        if not (is_call(node, "softmax") and isinstance(val, torch.Tensor) and val.dim() >= 3
                and isinstance(val.shape[-2], torch.SymInt)):
            continue
        logits, column = _split_sink_column(node.args[0])
        lv = example_value(logits)
        if not (isinstance(lv, torch.Tensor) and lv.dim() >= 3 and _same(lv.shape[-1], lv.shape[-2])):
            continue
        forms = _added_terms(logits)
        if column is not None:
            forms.append("sinks computed per query from the activations (the matched form is one learned logit "
                         "per head)" if sinks_of(column, []) is None else "learned per-head sinks")
        forms = sorted(set(forms), key=lambda form: (form == _MASK, form))  # what the rewrite does not model first
        what = "; ".join(forms) or "the logits are built with ops no pattern reads"
        shape = "the N x N logits and a sink column" if column is not None else "the N x N logits"
        return f"eager attention (softmax over {shape}, {node.name}) not matched: {what}"
    return ""


def _split_sink_column(node):
    """The softmax's input -> (logits, column) of `cat([logits, column], dim=-1)` through casts, where
    `column` is `[.., N, 1]`; else (node, None)."""
    inner = node
    while is_call(inner, *_CASTS) and isinstance(inner.args[0], fx.Node):
        inner = inner.args[0]
    if not is_call(inner, "cat"):
        return node, None
    parts = inner.args[0] if inner.args else inner.kwargs.get("tensors")
    dim = inner.args[1] if len(inner.args) > 1 else inner.kwargs.get("dim", 0)
    out = example_value(inner)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and isinstance(out, torch.Tensor)
            and dim in (-1, out.dim() - 1)):
        return node, None
    cv = example_value(parts[1])
    if not (isinstance(cv, torch.Tensor) and cv.dim() == out.dim() and cv.shape[-1] == 1):
        return node, None
    return parts[0], parts[1]


def _added_terms(logits: fx.Node) -> list[str]:
    """The forms of the terms added to the running logits (the q @ k^T product's path to the softmax)."""
    region = ancestors(logits, stop=lambda n: is_call(n, *_PRODUCTS)) | {logits}
    products = {a for n in region for a in n.all_input_nodes if is_call(a, *_PRODUCTS) and _square(a)}
    products |= {logits} if is_call(logits, *_PRODUCTS) and _square(logits) else set()
    running = {n for n in region if n in products or products & ancestors(n)}
    forms = []
    for n in region:
        v = example_value(n)
        if n.op in ("placeholder", "get_attr") and isinstance(v, torch.Tensor) and v.dim() >= 2 \
                and not isinstance(v.shape[-1], torch.SymInt) and v.shape[-1] == v.shape[-2]:
            forms.append(f"a mask sliced from a precomputed {list(v.shape)} matrix the model holds (a registered "
                         "buffer) and applied in a form not matched (matched: `where(slice, logits, min)` and "
                         "`logits * slice - c * (1 - slice)`, passes/causal_table.py)")
        if not is_call(n, "add"):
            continue
        terms = [a for a in n.args if isinstance(a, fx.Node)]
        if any(_is_key_bias(a) for a in terms):
            forms.append(_KEY_BIAS)
        if n in running:
            forms += [form for a in terms if a not in running for form in _term_form(a)]
    return forms


_KEY_BIAS = ("a per-key position bias (ALiBi) added to the logits in a form not matched (the matched form is a "
             "baddbmm on a bias built before the layers, as Bloom's)")


def _is_key_bias(node) -> bool:
    v = example_value(node)
    return (isinstance(node, fx.Node) and isinstance(v, torch.Tensor) and v.dim() >= 3 and _same(v.shape[-2], 1)
            and isinstance(v.shape[-1], torch.SymInt))


def _term_form(term: fx.Node) -> list[str]:
    v = example_value(term)
    if not isinstance(v, torch.Tensor) or v.dim() < 3:
        return []
    if visible_of_additive(term) is not None:
        return [_MASK]
    if _square(term) and v.dtype.is_floating_point:
        gathered = any(is_call(a, "gather") for a in ancestors(term) | {term})
        what = "a relative-position bias gathered at query-key distances" if gathered else "a bias per query and key"
        return [f"{what}, computed from the activations (the rewrite does not rebuild it at the kept tokens' "
                "original positions)"]
    return []


def _square(node) -> bool:
    """`[.., N, N]` with N symbolic."""
    v = example_value(node)
    return (isinstance(v, torch.Tensor) and v.dim() >= 3 and isinstance(v.shape[-1], torch.SymInt)
            and _same(v.shape[-1], v.shape[-2]))
