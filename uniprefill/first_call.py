"""Plain `torch.compile(model, backend="uniprefill")`: dynamic shapes from the first call.

Without `dynamic=True`, dynamo traces the first call with static shapes: the prompt length
is a constant of the graph, so the kept-token count (data-dependent) cannot replace it.
Rewriting literal lengths back into symbols would be guesswork (a hidden size can equal
the prompt length). Instead the backend asks dynamo for the graph it would have traced with
`dynamic=True`: it marks the token axis of the call's own input tensors as dynamic, and the
row axis where the first call is a batch of several rows (`torch._dynamo.maybe_mark_dynamic`,
the public marking), and restarts the analysis of the
frame. Dynamo then traces once more, now with a symbolic length, and the rewrite applies
from this first call on; later lengths reuse that graph (no recompile per length).

The same restart covers a trace whose length is symbolic already but whose rows, or another input's length, are
numbers: a caller who marked only the ids' length dynamic (`mark_dynamic(ids, 1)`), or dynamo's automatic dynamic
shapes, which are per forward code and so shaped by other compiles of the model class (fuzz rounds 19c and 20).

The restart is signalled with `TensorifyScalarRestartAnalysis`, the one restart exception
dynamo lets through from a backend (torch >= 2.6; checked on 2.11 and 2.13). Where it is
missing, or the user asked for static shapes (`dynamic=False`, which makes dynamo ignore the
marking), the call runs unaccelerated with the reason, as before. The marking stays on the
caller's tensors (`_dynamo_weak_dynamic_indices`); it only means "this axis varies" to any
later compile of the same tensors.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .passes.fx_utils import example_value, target_name, through_same_shape_views

_PARAMETER_SOURCES = ("._modules", "._parameters", "._buffers", ".__dict__")


def user_inputs(gm: fx.GraphModule, example_inputs) -> list[tuple[fx.Node, torch.Tensor]]:
    """(placeholder, real tensor) of the call's own tensor arguments (not weights or buffers)."""
    out = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        grapharg = node.meta.get("grapharg")
        source = grapharg.source.name if grapharg is not None and grapharg.source is not None else ""
        source = source() if callable(source) else str(source)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                and not any(part in source for part in _PARAMETER_SOURCES):
            out.append((node, value))
    return out


def token_input(gm: fx.GraphModule) -> tuple[fx.Node, torch.Tensor] | None:
    """The token input (ids into an embedding, or `inputs_embeds`) and its example value."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and target_name(node).endswith("embedding"):
            src = through_same_shape_views(node.args[0])
            if isinstance(src, fx.Node) and src.op == "placeholder":
                val = example_value(src)
                return (src, val) if isinstance(val, torch.Tensor) and val.dim() >= 2 else None
    for node in gm.graph.nodes:
        val = example_value(node)
        if node.op == "placeholder" and "inputs_embeds" in node.name and isinstance(val, torch.Tensor) \
                and val.dim() == 3:
            return node, val
    return None


def restart_with_dynamic_length(gm: fx.GraphModule, example_inputs) -> None:
    """Mark the token axis of every input of the call's length dynamic where the trace holds it as a number (all
    of them in a static first trace, the rest beside symbolic ids), and the row axis of a batch of several rows
    traced as a number, and restart dynamo's analysis (raises the restart exception). Returns when there is
    nothing to mark, or it was marked before."""
    try:
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    except ImportError:
        return
    found = token_input(gm)
    if found is None:
        return
    traced_rows, traced_length = found[1].shape[0], found[1].shape[1]
    # a batch of several rows: its row count too, else the graph holds it as a constant (a reshape to (3, length,
    # heads, dim), MoE index arithmetic on 6 * length) that packing the rows into one sequence cannot follow. That
    # also holds for a trace whose length is already symbolic: the caller marked only the length dynamic, or
    # dynamo's automatic dynamic shapes saw the length of some inputs change and not the rows. Likewise the length
    # axis of inputs the trace holds at a constant length beside symbolic ids (a 4-D mask the caller did not mark, a
    # mask that earlier calls did not pass): the rewrite cannot follow them either
    rows_constant = isinstance(traced_rows, int) and traced_rows > 1
    inputs = user_inputs(gm, example_inputs)
    real = dict(inputs).get(found[0])
    length = int(real.shape[1]) if real is not None else None if isinstance(traced_length, torch.SymInt) \
        else int(traced_length)
    marked = False
    for node, tensor in inputs:
        traced = example_value(node)

        def constant(dim: int) -> bool:  # an axis the trace holds as a number (a symbolic one is dynamic already)
            return not (isinstance(traced, torch.Tensor) and isinstance(traced.shape[dim], torch.SymInt))

        # ids, a 2-D mask, position ids, embeddings: the axis after the rows; a 4-D mask of the caller's own
        # ([rows, 1, queries, keys]): both token axes, else the trace keeps its keys at the first call's length
        axes = (0,) if tensor.dim() == 1 else (2, 3) if tensor.dim() == 4 else range(1, min(tensor.dim(), 3))
        dims = [d for d in axes if length is not None and tensor.shape[d] == length and constant(d)]
        if rows_constant and tensor.dim() >= 2 and tensor.shape[0] == traced_rows and constant(0):
            dims.append(0)
        for dim in dims:
            if dim not in getattr(tensor, "_dynamo_weak_dynamic_indices", ()):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
                marked = True
    if marked:  # never twice for the same tensors: if dynamo still traced statically, give up
        raise TensorifyScalarRestartAnalysis()
