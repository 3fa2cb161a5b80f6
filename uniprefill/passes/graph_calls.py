"""The plain Python functions the rewritten graph calls, and the nodes dead-code elimination keeps.

The token-drop rewrite inserts `torch.library` ops (`uniprefill::score_select`,
`gather_tokens`, ...) for all tensor work. What remains as plain calls is host bookkeeping
of the prompt's shape and of the drop recorder (`runtime.drop_history`): a tensor's size,
the flat indices of the real tokens, and the recorder's begin/record hooks. These run once per
prefill, outside any kernel; `keep_node` tells dead-code elimination to keep the recorder's
calls (they return nothing) and in-place writes that dynamo records without users.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .fx_utils import target_name


def size_of(x: torch.Tensor, dim: int) -> int:
    return x.shape[dim]


def live_tokens(padding, rows: int, seq: int, device_like: torch.Tensor):
    """Flat indices and per-row counts of the real (non-pad) tokens of the dense grid."""
    if padding is None:
        flat = torch.arange(rows * seq, device=device_like.device)
        return flat, torch.full((rows,), seq, dtype=torch.int64)
    valid = padding.bool().reshape(-1)
    counts = padding.bool().sum(1).cpu()  # one host copy
    order = torch.argsort((~valid).to(torch.int8), stable=True)
    return order[: int(counts.sum())], counts


def arange_like(size: int, ref: torch.Tensor) -> torch.Tensor:
    return torch.arange(size, device=ref.device)


def record_drop(recorder, layer: int, counts_in: torch.Tensor, counts_out: torch.Tensor, kept_flat: torch.Tensor) -> None:
    if recorder is not None:
        recorder.record(layer, counts_in, counts_out, kept_flat)


def record_sparse(recorder, layer: int, density: torch.Tensor) -> None:
    if recorder is not None:
        recorder.record_sparse(layer, density)


def begin_prefill(recorder, rows: int, seq: int) -> None:
    if recorder is not None:
        recorder.begin(rows, seq)


def keep_node(node: fx.Node) -> bool:
    """Nodes dead-code elimination must keep: our recorders, functorch's vmap-level bookkeeping,
    and in-place writes (dynamo records `state.copy_(new)` of a cache's recurrent or conv state
    as a `call_method` without users, which `Node.is_impure` does not count as impure)."""
    if node.op == "call_function" and (node.target in (begin_prefill, record_drop, record_sparse) or "nesting" in target_name(node)):
        return True
    if writes_in_place(node):
        return True
    return node.is_impure()


def writes_in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        if node.target is operator.setitem:
            return True
        name = getattr(node.target, "__name__", "")
        if getattr(node.target, "__module__", None) == "_operator":
            # operator.and_ / or_ / not_ are pure; operator.iadd, iand, ... write in place
            return name in _OPERATOR_IN_PLACE
    else:
        return False
    return isinstance(name, str) and name.endswith("_") and not name.startswith("_")


_OPERATOR_IN_PLACE = frozenset({"iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul", "imod", "imul",
                                "ior", "ipow", "irshift", "isub", "itruediv", "ixor", "setitem", "delitem"})
