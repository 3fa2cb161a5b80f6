"""What an attention mask computes, checked on small concrete inputs against what was read from it.

`classify.analyse_mask` reads a mask's subgraph by its structure: which ops build it and which
inputs it reads (causal when it compares token indices, a window when it subtracts a constant
before comparing). The rewrite then drops the mask and rebuilds "causal, window W, key padding"
from original positions. A structure can look right and compute something else (a comparison
with an offset that makes every key visible, a float mask with soft values), so before a rewrite
the mask's subgraph is run on its own, on small inputs made from the roles of the inputs it
reads (`mask_inputs.InputRole`): two lengths, left padding in every row but the first, positions
`arange(N)`. Its result must be the mask the rewrite builds on every real query row (a boolean
mask, or an additive one that is 0 where visible and at most `_HIDDEN` elsewhere); otherwise the
graph runs unaccelerated with the reason.

A mask whose inputs cannot be made here (a size symbol that is neither the batch nor the
prompt length, an input without a role) keeps the structural reading: `classify` refused inputs
without a role already, so that leaves sizes of other meaning, which the runtime checks of
`mask_inputs` guard.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from .causal_table import TableRole, evaluation_table
from .fx_utils import TokenAxes, ancestors, example_value
from .mask_inputs import InputRole, causal_view

_LENGTHS = (37, 61)  # two prompt lengths, neither a power of two
_HIDDEN = -1e30  # an additive mask value at most this (or the dtype's minimum) hides a key


class _CannotEvaluate(Exception):
    pass


def mask_mismatch(gm: fx.GraphModule, mask: fx.Node, window: int, reads_padding: bool, roles: dict,
                  axes: TokenAxes, tokens: fx.Node) -> str | None:
    """Why `mask` does not compute the causal mask (window `window`, 0: none; key padding when
    `reads_padding`) the rewrite will build, or None (it does, or it cannot be evaluated here)."""
    nodes = ancestors(mask) | {mask}
    graph, env, inputs = fx.Graph(), {}, []
    for node in gm.graph.nodes:
        if node not in nodes:
            continue
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            inputs.append(node)
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[mask])
    module = fx.GraphModule(gm, graph)
    batch = sympy.sympify(axes.batch)
    rows = int(batch) if batch.is_number else 2  # a batch traced as a number stays that (plain torch.compile: 3)
    for n in _LENGTHS:
        bind = {axes.seq: n, axes.batch: rows, **{s: (n if to == axes.seq else rows) for s, to in axes.aliases}}
        try:
            args = [_make_input(p, roles.get(p), bind, n, tokens) for p in inputs]
        except _CannotEvaluate:
            return None
        padding = next((a for p, a in zip(inputs, args) if roles.get(p) is InputRole.PADDING), None)
        try:
            with torch.no_grad():
                out = module(*args)
        except Exception:  # noqa: BLE001  (inputs this module could not make right: keep the structural reading)
            return None
        why = _differs(out, n, rows, window, padding if reads_padding else None)
        if why:
            return f"{why} (checked on {rows} x {n} tokens)"
    return None


def _size(dim, bind) -> int:
    if not isinstance(dim, torch.SymInt):
        return int(dim)
    expr = sympy.sympify(sympy.sympify(dim.node.expr).xreplace(bind))
    if expr.free_symbols:
        raise _CannotEvaluate(f"size {dim} is not a function of the batch and the prompt length")
    return int(expr)


def _make_input(node: fx.Node, role, bind: dict, n: int, tokens: fx.Node):
    value = example_value(node)
    if isinstance(value, torch.SymInt):
        return _size(value, bind)
    if not isinstance(value, torch.Tensor):
        raise _CannotEvaluate(f"input {node.name}")
    shape = [_size(d, bind) for d in value.shape]
    kw = dict(dtype=value.dtype, device=value.device)
    if role is InputRole.PADDING:
        pad = torch.ones(shape, **kw)
        for r in range(1, shape[0]):  # row r starts with 5 r pad tokens
            pad[r, : 5 * r] = 0
        return pad
    if isinstance(role, TableRole):  # what the run-time check lets through
        return evaluation_table(role, torch.empty(0, **kw))
    if role is InputRole.CAUSAL_MASK:  # what the run-time check lets through
        return causal_view(n, torch.empty(0, **kw)).expand(shape).contiguous()
    if role in (InputRole.DOCUMENT_POSITIONS, InputRole.CACHE_POSITION):
        return torch.arange(n, device=value.device).to(value.dtype).expand(shape).contiguous()
    if node is tokens:
        return torch.randint(3, 50, shape, device=value.device).to(value.dtype)
    raise _CannotEvaluate(f"input {node.name} has no role")


def _differs(out, n: int, rows: int, window: int, padding) -> str | None:
    if not isinstance(out, torch.Tensor) or out.dim() != 4 or tuple(out.shape[-2:]) != (n, n):
        return f"the mask evaluates to {type(out).__name__} {tuple(getattr(out, 'shape', ()))}, not [.., {n}, {n}]"
    if out.dtype == torch.bool:
        visible = out
    else:
        hidden = out <= max(_HIDDEN, torch.finfo(out.dtype).min)
        if not bool(((out == 0) | hidden).all()):
            return "the additive mask holds values other than 0 and the most negative float (a soft mask)"
        visible = out == 0
    q = torch.arange(n, device=out.device)[:, None]
    k = torch.arange(n, device=out.device)[None, :]
    want = k <= q
    if window > 0:
        want = want & (q - k < window)
    want = want[None, None].expand(rows, 1, n, n)
    real = torch.ones(rows, n, dtype=torch.bool, device=out.device)
    if padding is not None:
        real = padding.bool().to(out.device)
        want = want & real[:, None, None, :]
    visible = visible.expand(rows, visible.shape[1], n, n)
    rows_checked = real[:, None, :, None].expand_as(visible)  # padded query rows are not compared
    if bool(((visible != want) & rows_checked).any()):
        kind = f"causal with a window of {window}" if window else "causal"
        return f"the mask does not compute the {kind} mask read from its structure"
    return None
