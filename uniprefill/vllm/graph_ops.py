"""The ops the vLLM rewrite inserts into vLLM's graph (`uniprefill.vllm.rewrite`).

Only `torch.library` ops with fakes enter a graph, so that the graph stays traceable and a later
compiler (Inductor, vLLM's own passes) can read every node:

* `vllm_begin_step(positions)`: a forward starts (the runtime forgets the previous step);
* `vllm_drop(q, k, layer)`: the drop point after layer `layer`'s attention; the kept rows, whose
  number is data-dependent (an unbacked size in the fake);
* `vllm_kept_rows(keep)`: that number, as an int (a SymInt in the graph). Under vLLM's mode 3 the
  graph is split at these ops, and `torch.fx.passes.split_module` makes the node whose value is
  the unbacked symbol an input of every piece that uses it: an op right after `vllm_drop`, split
  with it, binds the symbol in the drop's own piece (`aten.sym_size` there would bind it in the
  next piece, which then depends on itself);
* `vllm_window_attention(query, key, value, output, layer_name, layer, kv_cache_dummy_dep)`: a
  sliding-window layer after a drop point, over ORIGINAL positions; writes `output` as vLLM's
  `unified_attention_with_output` does;
* `gather_rows(value, keep)`: `value`'s rows `keep` (`index_select`), a value live across a drop point.
  An op of its own so that Inductor never fuses the gather into the kernel that reads it: fused into
  the next add + RMSNorm it turns vLLM's one-pass (persistent) reduction into a looped one that sums
  in another order, so p = 1 would part from standard vLLM in the last bits (H200, 2026-12-04);
* `scatter_rows(value, rows, num_rows)`: a graph output computed on the kept rows, back to every
  row (dropped rows zero);
* `check_rows(value, num_rows, name)`: a graph output the rewrite believes was computed before any
  drop, checked to have one row per token (an error naming it otherwise, never a short output).

The first three act on a `VllmDropRuntime`, which holds Python state (the step's layouts, the drop
histories) and so cannot be an op argument. It is found the way `record_ops` find the drop
recorder: `rewrite_vllm_graph` wraps the rewritten graph's `forward` in `running(runtime)`, which
makes that runtime current (a context variable) for the call; an op that runs outside such a call
raises. `check_rows` returns nothing and is registered as having a side effect, so dead-code
elimination keeps it (as `vllm_begin_step` and `vllm_drop`, whose effects are on the runtime and on
vLLM's forward context). The rewritten graph runs eagerly, in node order (vLLM's mode 2).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.fx

LIB = "uniprefill"

_CURRENT = ContextVar("uniprefill_vllm_runtime", default=None)


@contextmanager
def running(runtime) -> Iterator[None]:
    """Make `runtime` (a `VllmDropRuntime`) the one the graph ops of this call act on."""
    token = _CURRENT.set(runtime)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_runtime():
    runtime = _CURRENT.get()
    if runtime is None:
        raise RuntimeError("uniprefill: a rewritten vLLM graph ran outside its forward (no drop runtime is current; "
                           "call the GraphModule, or wrap the call in uniprefill.vllm.graph_ops.running)")
    return runtime


@torch.library.custom_op(f"{LIB}::vllm_begin_step", mutates_args=())
def vllm_begin_step(positions: torch.Tensor) -> None:
    current_runtime().begin_step()


@vllm_begin_step.register_fake
def _(positions):
    return None


@torch.library.custom_op(f"{LIB}::vllm_drop", mutates_args=())
def vllm_drop(q: torch.Tensor, k: torch.Tensor, layer: int) -> torch.Tensor:
    """Kept rows (int64, on q's device) of the rows entering drop layer `layer` (`VllmDropRuntime.drop`)."""
    return current_runtime().drop(q, k, layer)


@vllm_drop.register_fake
def _(q, k, layer):
    # at least one row: the last token is always kept (and a reshape with -1 after the drop needs it known)
    return q.new_empty(torch.library.get_ctx().new_dynamic_size(min=1), dtype=torch.int64)


@torch.library.custom_op(f"{LIB}::vllm_kept_rows", mutates_args=())
def vllm_kept_rows(keep: torch.Tensor) -> int:
    """The number of kept rows `vllm_drop` returned."""
    return keep.shape[0]


@vllm_kept_rows.register_fake
def _(keep):
    return keep.shape[0]


@torch.library.custom_op(f"{LIB}::vllm_window_attention", mutates_args=("output",))
def vllm_window_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                          layer_name: str, layer: int, kv_cache_dummy_dep: torch.Tensor | None = None) -> None:
    """`VllmDropRuntime.window_attention`: the window over original positions into `output`."""
    kwargs = {} if kv_cache_dummy_dep is None else {"kv_cache_dummy_dep": kv_cache_dummy_dep}
    current_runtime().window_attention((query, key, value, output, layer_name), kwargs, layer)


@vllm_window_attention.register_fake
def _(query, key, value, output, layer_name, layer, kv_cache_dummy_dep=None):
    return None


@torch.library.custom_op(f"{LIB}::gather_rows", mutates_args=())
def gather_rows(value: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`value`'s rows `keep`, a new tensor."""
    return torch.index_select(value, 0, keep)


@gather_rows.register_fake
def _(value, keep):
    return value.new_empty((keep.shape[0], *value.shape[1:]))


@torch.library.custom_op(f"{LIB}::scatter_rows", mutates_args=())
def scatter_rows(value: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`value` (one row per kept token) at `rows` of a zero tensor of `num_rows` rows."""
    out = value.new_zeros((num_rows, *value.shape[1:]))
    return out.index_copy_(0, rows, value)


@scatter_rows.register_fake
def _(value, rows, num_rows):
    return value.new_empty((num_rows, *value.shape[1:]))


@torch.library.custom_op(f"{LIB}::check_rows", mutates_args=())
def check_rows(value: torch.Tensor, num_rows: int, name: str) -> None:
    if value.shape[0] != num_rows:
        raise RuntimeError(f"uniprefill: the rewritten vLLM graph's output {name} has {value.shape[0]} rows for a "
                           f"step of {num_rows} tokens (a bug in the rewrite: please report it with the graph, "
                           "UNIPREFILL_VLLM_REWRITE_DUMP)")


@check_rows.register_fake
def _(value, num_rows, name):
    return None


# The ops that must run in Python on every step (they act on the runtime, read the forward context, or
# read host state): vLLM's mode 3 splits the graph at them (`uniprefill.vllm.piecewise`).
SPLITTING_OPS = (f"{LIB}::vllm_begin_step", f"{LIB}::vllm_drop", f"{LIB}::vllm_kept_rows",
                 f"{LIB}::vllm_window_attention")

# Kept by dead-code elimination, and never treated as pure: `check_rows` and `vllm_begin_step` return
# nothing; `vllm_drop` installs the later layers' attention metadata in vLLM's forward context.
for _op in (torch.ops.uniprefill.check_rows.default, torch.ops.uniprefill.vllm_begin_step.default,
            torch.ops.uniprefill.vllm_drop.default):
    torch.fx.node.has_side_effect(_op)
