"""Backed row counts for the pieces after a drop point: the kernels vLLM's own pieces get.

A drop point's kept row count is data-dependent, so its fake value is an unbacked symbol `u…`
(`graph_ops.score_select`'s fake). Compiled as such, Inductor treats the pieces after the drop
unlike vLLM's: it gives a dependency over an unbacked size no memory score (torch 2.11's
`GraphLowering.get_dep_size_hint` returns 0 for it), so it never fuses an RMSNorm's epilogue into
its reduction, recomputes the residual add in a kernel of its own, hints every size with its
generic fallback (8192) and indexes in int64. Measured on the H200 (vLLM 0.26, SmolLM2, p = 1):
those pieces compile to a reduction kernel plus a separate normalisation kernel where vLLM
compiles one fused kernel, and 28 of 120 greedy outputs part from standard vLLM's, from the
prefill's own logprob on (docs/results/vllm-defaults-h200-2026-12-04/).

`back_kept_row_counts(gm)` therefore rewrites the fake values that vLLM's split and piecewise
compilation read (`meta["example_value"]` and `meta["val"]`): each unbacked symbol a uniprefill op
introduced becomes a fresh backed symbol of the same shape environment, with the value range of
the graph's token count and a hint one below the previous row count's (the token count's for the
first drop point, so every size hint rounds to the same power of two as vLLM's, while no two
symbols share a hint: Inductor may compare symbols by their hints, and kept <= entering rows holds
for the real values too). The graph itself is left as it is: the drop op still returns a
data-dependent count at run time, and each compiled piece reads its sizes from its inputs.

Inductor may decide from a backed symbol's hint where it would not for an unbacked one. Once vLLM
compiled the pieces, `BackedRows.forget_guards` checks those decisions (`unsound_reason`: an engine
whose pieces assume what a drop can break refuses to start) and drops their guards, which vLLM never
checks and dynamo cannot build. Where vLLM does check guards
(`compilation_config.dynamic_shapes_config.evaluate_guards`), or its own token count is unbacked
(`dynamic_shapes_config.type`), the counts stay unbacked (`skip_reason`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

UNIPREFILL_NAMESPACE = "uniprefill."


def skip_reason(vllm_config: Any) -> str | None:
    """Why the kept row counts stay unbacked for this engine, or None."""
    from .checks import _get

    dynamic = _get(_get(vllm_config, "compilation_config"), "dynamic_shapes_config")
    if dynamic is None:
        return None
    if _get(dynamic, "evaluate_guards", False):
        return "dynamic_shapes_config.evaluate_guards: vLLM checks the shape guards a backed count would add"
    kind = _get(dynamic, "type", None)
    if kind is not None and "UNBACKED" in str(kind).upper():
        return "dynamic_shapes_config.type is unbacked: vLLM's own token count is unbacked too"
    return None


def _fake_values(node: fx.Node) -> list[tuple[str, Any]]:
    return [(key, node.meta[key]) for key in ("val", "example_value") if node.meta.get(key) is not None]


def _shape_env(gm: fx.GraphModule):
    from torch._subclasses.fake_tensor import FakeTensor

    for node in gm.graph.nodes:
        for _, value in _fake_values(node):
            if isinstance(value, FakeTensor) and value.fake_mode.shape_env is not None:
                return value.fake_mode
    return None


def _hints(shape_env) -> dict:
    """The shape environment's hints of its backed symbols (`backed_var_to_val`, `var_to_val` in older torch)."""
    return shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val


def _token_symbol(gm: fx.GraphModule, shape_env) -> Any:
    """(symbol, hint) of the graph's token count: the size of the positions the rewrite's per-step reset
    reads (`vllm_begin_step(positions)`), else the largest hint among the inputs' backed sizes."""
    candidates = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith(UNIPREFILL_NAMESPACE + "vllm_begin_step"):
            candidates = [node.args[0]]
            break
        if node.op == "placeholder":
            candidates.append(node)
    best = None
    for node in candidates:
        for _, value in _fake_values(node)[:1]:
            sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
            for size in sizes:
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    symbol = size.node.expr
                    hint = _hints(shape_env).get(symbol)
                    if hint is not None and (best is None or int(hint) > best[1]):
                        best = (symbol, int(hint))
    return best


def token_count_hint(gm: fx.GraphModule) -> int | None:
    """The size hint of `gm`'s token count (the size dynamo traced), or None without fake inputs."""
    fake_mode = _shape_env(gm)
    token = None if fake_mode is None else _token_symbol(gm, fake_mode.shape_env)
    return None if token is None else token[1]


def _dropped_symbols(gm: fx.GraphModule) -> list[Any]:
    """Unbacked symbols first introduced by a uniprefill op, in graph order."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    seen: dict[Any, None] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith(UNIPREFILL_NAMESPACE):
            for _, value in _fake_values(node)[:1]:
                for symbol in sorted(free_unbacked_symbols(value), key=str):
                    seen.setdefault(symbol, None)
    return list(seen)


@dataclasses.dataclass
class BackedRows:
    """What `back_kept_row_counts` did: {unbacked name: backed name} and where the symbols live."""

    renamed: dict[str, str]
    shape_env: Any = None
    symbols: frozenset = frozenset()
    token_symbol: Any = None
    value_range: Any = None
    order: tuple = ()  # the row counts in drop order

    def unsound_reason(self) -> str | None:
        """Why the pieces compiled for these backed counts may be wrong for some run-time count, or None.

        Inductor decides from a backed symbol's hint where it would not decide for an unbacked one, and
        vLLM checks none of the guards that record such decisions. vLLM trusts Inductor's code to be
        valid across its own token count's range whatever threshold a heuristic compared the count with
        (a guard such as `s >= 4096`, or `Ne(Mod(s, 16), 0)` for taking the unaligned path); the row
        counts get the same trust for such guards on one count. Refused, because a drop can break them:
        - a replacement of a row count (specialised to a value or to another symbol);
        - an equality, or a divisibility asserted, on a row count that some count from 1 to 3 breaks
          (`Eq(rows, 8191)`, `Eq(Mod(rows, 16), 0)`; `Mod(96*rows, 96)` holds for every count);
        - a relation between a row count and another count (the token count, another drop's rows) false
          at a corner of 2 <= rows_n <= ... <= rows_1 <= tokens <= T (`rows <= tokens` holds, `rows <
          tokens` breaks at p = 1), or one with a modulo, floor division, min or max;
        - a guard these rules cannot evaluate."""
        if self.shape_env is None or not self.symbols:
            return None
        import sympy

        env = self.shape_env
        hints = _hints(env)
        for key, value in env.replacements.items():
            if key in self.symbols or getattr(value, "free_symbols", set()) & self.symbols:
                return f"Inductor replaced {key} by {value}"

        def broken_for_small_counts(expr) -> bool:  # expr must be true for every count
            values = [expr.xreplace({symbol: sympy.Integer(rows) for symbol in self.symbols}).xreplace(hints)
                      for rows in (1, 2, 3)]
            return any(value not in (sympy.true, True) for value in values)

        for divisible in getattr(env, "divisible", ()):
            if divisible.free_symbols & self.symbols and broken_for_small_counts(sympy.Eq(divisible, 0)):
                return f"Inductor assumed {divisible} divisible"
        order = [self.token_symbol, *self.order] if self.token_symbol is not None else list(self.order)
        most = hints.get(self.token_symbol, 2)
        corners = [{symbol: sympy.Integer(most if i < j else 2) for i, symbol in enumerate(order)}
                   for j in range(len(order) + 1)]
        for guard in env.guards:
            expr = guard.expr
            rows = expr.free_symbols & self.symbols
            if not rows:
                continue
            where = f"{expr} ({guard.sloc})" if getattr(guard, "sloc", None) else str(expr)
            others = expr.free_symbols - rows
            if len(rows) == 1 and not (others & set(order)):
                if isinstance(expr, sympy.Eq) and broken_for_small_counts(expr):
                    return f"Inductor guarded {where}, false for some count"
                continue  # a threshold on one count: trusted as vLLM trusts its own count's
            nonlinear = ("Mod", "FloorDiv", "floor", "Max", "Min")
            if any(name in type(a).__name__ for a in sympy.preorder_traversal(expr) for name in nonlinear):
                return f"Inductor guarded {where}, a relation between counts this check cannot bound"
            for corner in corners:
                if expr.xreplace(corner).xreplace(hints) not in (sympy.true, True):
                    counts = {str(symbol): int(value) for symbol, value in corner.items()}
                    return f"Inductor guarded {where}, false for counts {counts}"
        return None

    def forget_guards(self) -> int:
        """Drop the shape guards Inductor added on the backed row counts while compiling the pieces; the
        number dropped. Raises RuntimeError where one of them is unsound (`unsound_reason`): never a
        silent wrong answer. Dynamo turns its shape environment's guards into checks on the compiled
        frame's inputs, and these symbols are no input's size (building such a check fails); vLLM checks
        no guard of its compiled model (module docstring), so they were never checked."""
        if self.shape_env is None or not self.symbols:
            return 0
        reason = self.unsound_reason()
        if reason is not None:
            raise RuntimeError(f"uniprefill: the pieces after a drop point were compiled for an assumption on the "
                               f"kept row count that a drop can break ({reason}); run this model without "
                               f'"vllm_drop", and report it')
        kept = [g for g in self.shape_env.guards if not (g.expr.free_symbols & self.symbols)]
        dropped = len(self.shape_env.guards) - len(kept)
        self.shape_env.guards[:] = kept
        return dropped


def back_kept_row_counts(gm: fx.GraphModule) -> BackedRows:
    """Replace the drop points' unbacked row counts in `gm`'s fake values by backed symbols (module
    docstring); empty `renamed` where the graph has none or no token count."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    fake_mode = _shape_env(gm)
    if fake_mode is None:
        return BackedRows({})
    shape_env = fake_mode.shape_env
    token = _token_symbol(gm, shape_env)
    dropped = _dropped_symbols(gm)
    if token is None or not dropped:
        return BackedRows({})
    token_symbol, hint = token
    if hint - len(dropped) < 2:  # a hint of 0 or 1 would make the "symbol" a constant
        return BackedRows({})
    value_range = shape_env.var_to_range.get(token_symbol)
    mapping = {}
    for index, symbol in enumerate(dropped):
        hint -= 1
        backed = shape_env.create_symbol(hint, ConstantSource(f"uniprefill_kept_rows_{index}_{symbol}"),
                                         dynamic_dim=DimDynamic.DYNAMIC)
        if not backed.is_Symbol:
            raise AssertionError(f"a backed row count became {backed}")
        if value_range is not None:
            # the token count's upper bound; the lower one of a fresh count (not one the trace narrowed)
            shape_env.var_to_range[backed] = type(value_range)(min(2, value_range.lower), value_range.upper)
        mapping[symbol] = backed
    hints = _hints(shape_env)

    def symint(value):
        expr = value.node.expr.xreplace(mapping)
        if expr.is_number:
            return int(expr)
        return shape_env.create_symintnode(expr, hint=int(expr.xreplace(hints)))

    def rebind(value):
        if isinstance(value, torch.SymInt):
            return symint(value) if value.node.expr.free_symbols & mapping.keys() else value
        if isinstance(value, torch.Tensor):
            exprs = [*value.shape, *value.stride(), value.storage_offset()]
            if not any(isinstance(e, torch.SymInt) and e.node.expr.free_symbols & mapping.keys() for e in exprs):
                return value
            sizes = [rebind(s) for s in value.shape]
            strides = [rebind(s) for s in value.stride()]
            with fake_mode:
                out = torch.empty_strided(sizes, strides, dtype=value.dtype, device=value.device)
            offset = rebind(value.storage_offset())
            if not (isinstance(offset, int) and offset == 0):
                with fake_mode:
                    out = out.as_strided(sizes, strides, offset)
            return out
        if isinstance(value, (list, tuple)):
            return type(value)(rebind(v) for v in value)
        return value

    for node in gm.graph.nodes:
        for key, value in _fake_values(node):
            node.meta[key] = rebind(value)
    return BackedRows({str(k): str(v) for k, v in mapping.items()}, shape_env, frozenset(mapping.values()),
                      token_symbol, value_range, tuple(mapping.values()))
