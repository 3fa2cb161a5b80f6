"""The nodes dead-code elimination must keep in a rewritten graph.

Everything the token-drop rewrite inserts is a `torch.library` op: the tensor work in `ops.py`,
the host bookkeeping of the prompt's real tokens and the drop recorder's hooks in `record_ops.py`
(`record_ops.RECORDER_OPS`: they return nothing, so `keep_node` keeps them),
sizes as `aten.sym_size.int`. `keep_node` also keeps in-place writes that dynamo records without
users.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import record_ops
from .fx_utils import target_name

_RECORDER_TARGETS = frozenset(getattr(torch.ops.uniprefill, name).default for name in record_ops.RECORDER_OPS)


def keep_node(node: fx.Node) -> bool:
    """Nodes dead-code elimination must keep: our recorders, functorch's vmap-level bookkeeping,
    and in-place writes (dynamo records `state.copy_(new)` of a cache's recurrent or conv state
    as a `call_method` without users, which `Node.is_impure` does not count as impure)."""
    if node.op == "call_function" and (node.target in _RECORDER_TARGETS or "nesting" in target_name(node)):
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
