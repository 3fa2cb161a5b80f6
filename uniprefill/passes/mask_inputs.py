"""The graph inputs that attention masks read, their roles, and the runtime checks on them.

The rewrite rebuilds every attention mask from ORIGINAL token positions: causal, an
optional sliding window, and key padding. That is the plain model's mask only when the
inputs the traced mask reads say nothing more. So every tensor input of the graph that a
mask reads gets a role, found from the graph's structure (never from its name: a mask
passed positionally arrives as `l_args_2_`, and after a recompile its batch axis may have
a symbol of its own):

* `PADDING`: a 2-D `[rows, N]` input read directly (transformers' padding mask). The
  rewrite reads it as key validity; at run time it must have the token input's shape and
  every row must hold a real token.
* `DOCUMENT_POSITIONS`: a 2-D `[rows or 1, N]` input whose consecutive differences the
  mask reads (`diff` / `cumsum`: transformers' packed-document detection from
  `position_ids`). Sound only when every row is ONE document, i.e. its positions are
  consecutive; otherwise the call runs unaccelerated, naming the reason.
* `CACHE_POSITION`: a 1-D `[N]` input; it must be `arange(N)` (a prefill from position 0).
* `CAUSAL_MASK`: a `[rows or 1, 1, N, N]` input, a mask built in an earlier graph and passed in
  across a graph break (CTRL). Read as the causal mask; at run time it must be exactly that
  (boolean, or additive 0 / most negative), so a padded batch or any other mask runs the
  original graph.
* `causal_table.TableRole(window)`: a `[1, 1, M, M]` table the model holds (a buffer, lifted to an
  input) that the mask slices (GPT-Neo, OpenAI-GPT). Given only when the traced table is exactly a
  causal band (window 0: plain causal); at run time it must still be that band (`causal_table`).

A mask that reads any other tensor input is not understood and its layer is not
rewritten (the reason names the input). Checks run before the rewritten graph; a failed
check runs the original graph instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.fx as fx

from .causal_table import TableRole, table_role
from .fx_utils import TokenAxes, ancestors, example_value, target_name

_DOCUMENT_OPS = ("diff", "cumsum")


class InputRole(enum.Enum):
    PADDING = "padding mask"
    DOCUMENT_POSITIONS = "position ids (document boundaries)"
    CACHE_POSITION = "cache positions"
    CAUSAL_MASK = "causal attention mask (built before the graph)"
    SAME_LENGTH = "token axis"  # axis `dim` must have the prompt's length
    SAME_ROWS = "batch axis"  # axis `dim` must have the prompt's row count


@dataclass(frozen=True)
class InputCheck:
    """A runtime check on the graph input at `index` (placeholder order)."""

    index: int
    role: InputRole
    name: str
    dim: int = -1


def size_aliases(graph: fx.Graph, batch, seq) -> tuple[tuple, list[tuple[fx.Node, int, str]]]:
    """Symbols of 2-D inputs `[rows, N]` that differ from the token input's own but had the same
    value when traced (dynamo gives an input recompiled on its own a symbol of its own).

    Returns `((symbol, batch or seq), ...)` and `(input, axis, "batch" or "seq")` to check at run time.
    """
    aliases, checks = {}, []
    for node in graph.nodes:
        val = example_value(node)
        if node.op != "placeholder" or not isinstance(val, torch.Tensor) or val.dim() != 2:
            continue
        for dim, (size, target) in enumerate(zip(val.shape, (batch, seq))):
            if not isinstance(size, torch.SymInt) or isinstance(target, int):
                continue
            expr = size.node.expr
            if expr == target or not expr.is_Symbol or not size.node.has_hint():
                continue
            if size.node.hint == _hint_of(graph, target):
                aliases[expr] = target
                checks.append((node, dim, "seq" if target is seq else "batch"))
    return tuple(aliases.items()), checks


def _hint_of(graph: fx.Graph, symbol):
    for node in graph.nodes:
        val = example_value(node)
        if node.op == "placeholder" and isinstance(val, torch.SymInt) and val.node.expr == symbol:
            return val.node.hint if val.node.has_hint() else None
    return None


def mask_input_roles(graph: fx.Graph, masks: list[fx.Node], axes: TokenAxes) -> tuple[dict, dict]:
    """Roles of the tensor inputs that the given mask nodes read: `({node: role}, {node: why unknown})`."""
    inside: set[fx.Node] = set()
    for mask in masks:
        inside |= ancestors(mask) | {mask}
    roles, unknown = {}, {}
    for node in graph.nodes:
        if node.op != "placeholder" or node not in inside:
            continue
        val = example_value(node)
        if not isinstance(val, torch.Tensor):
            continue  # shape symbols
        sizes = [axes.size_expr(s) for s in val.shape]
        if val.dim() == 2 and sizes[1] == axes.seq and sizes[0] in (axes.batch, 1):
            users = _descendants_within(node, inside)
            reads_steps = any(any(op in target_name(u) for op in _DOCUMENT_OPS) for u in users)
            roles[node] = InputRole.DOCUMENT_POSITIONS if reads_steps else InputRole.PADDING
        elif val.dim() == 1 and sizes[0] == axes.seq and not val.is_floating_point():
            roles[node] = InputRole.CACHE_POSITION
        elif val.dim() == 4 and sizes[1] == 1 and sizes[2:] == [axes.seq, axes.seq] and sizes[0] in (axes.batch, 1):
            roles[node] = InputRole.CAUSAL_MASK
        elif (table := table_role(node)) is not None:
            roles[node] = table
        else:
            unknown[node] = f"the mask reads the input {node.name} of shape {list(val.shape)}, whose role is not understood"
    return roles, unknown


def _descendants_within(node: fx.Node, inside: set[fx.Node]) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user in inside and user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def failed_check(checks: tuple[InputCheck, ...], args, rows: int, seq: int, left_padding_only: bool = False) -> str | None:
    """The reason the rewritten graph must not run on `args`, or None when every check passes."""
    for check in checks:
        value = args[check.index]
        if isinstance(check.role, TableRole):
            why = check.role.failed(value, check.name)
            if why:
                return why
            continue
        if check.role in (InputRole.SAME_LENGTH, InputRole.SAME_ROWS):
            want = seq if check.role is InputRole.SAME_LENGTH else rows
            if not isinstance(value, torch.Tensor) or value.shape[check.dim] != want:
                return (f"the input {check.name} has {check.role.value} {check.dim} of another size than the "
                        f"prompt's ({want})")
            continue
        if not isinstance(value, torch.Tensor):
            return f"{check.role.value} input {check.name} is not a tensor at run time"
        if check.role is InputRole.PADDING:
            if tuple(value.shape) != (rows, seq):
                return (f"the padding mask has shape {tuple(value.shape)} for {rows} row(s) of {seq} tokens "
                        "(a mask must give one value per token)")
            real = value.bool()
            flags = [real.any(dim=1).all(), real[:, -1].all()]
            if left_padding_only and seq > 1:
                flags.append((real[:, 1:] >= real[:, :-1]).all())
            every_row_real, every_row_ends_real, *left_padded = torch.stack(flags).tolist()  # one host sync
            if not every_row_real:
                return "a row of the batch holds no real token (its attention mask is all zeros)"
            if not every_row_ends_real:
                return ("a row ends in padding (right padding): the method's answer is the last position's, here a "
                        "pad, whose state the first drop does not keep (it keeps real tokens only); pad on the left "
                        "(transformers' padding_side='left') to accelerate")
            if left_padded and not left_padded[0]:
                return ("padding inside a row (a pad after a real token) in a model with convolutions or scans, "
                        "which see pad positions as tokens: only left padding is accelerated there")
        elif check.role is InputRole.DOCUMENT_POSITIONS:
            if value.shape[-1] > 1 and not bool((torch.diff(value, dim=-1) == 1).all()):
                return ("position_ids are not consecutive (packed documents or strided positions): "
                        "transformers then masks attention per document, which the rewrite does not model")
        elif check.role is InputRole.CAUSAL_MASK:
            if value.dim() != 4 or tuple(value.shape[1:]) != (1, seq, seq) or value.shape[0] not in (1, rows):
                return f"the attention mask passed into the graph has shape {tuple(value.shape)}, not [rows, 1, N, N]"
            if not is_causal_mask(value):
                return ("the attention mask passed into the graph is not the plain causal mask (padding, packed "
                        "documents or another mask, built before a graph break), which the rewrite does not model")
        elif check.role is InputRole.CACHE_POSITION:
            if not torch.equal(value.cpu(), torch.arange(seq, dtype=value.dtype)):
                return "cache_position does not run 0..N-1 (a prefill that does not start at position 0)"
    return None


HIDDEN = -1e30  # an additive mask value at most this (or the dtype's minimum) hides a key


def causal_view(n: int, like: torch.Tensor) -> torch.Tensor:
    """The causal mask of `n` tokens in the form of `like`: boolean, or additive (0 where visible,
    the dtype's minimum elsewhere)."""
    visible = torch.ones(n, n, dtype=torch.bool, device=like.device).tril()
    if like.dtype == torch.bool:
        return visible
    return torch.zeros(n, n, dtype=like.dtype, device=like.device).masked_fill(~visible, torch.finfo(like.dtype).min)


def is_causal_mask(value: torch.Tensor) -> bool:
    """Every `[N, N]` plane of `value` is the causal mask (boolean, or additive 0 / at most `HIDDEN`)."""
    n = value.shape[-1]
    want = torch.ones(n, n, dtype=torch.bool, device=value.device).tril()
    if value.dtype == torch.bool:
        return bool((value == want).all())
    hidden = value <= max(HIDDEN, torch.finfo(value.dtype).min)
    return bool(((value == 0) == want).all() and (hidden != want).all())
