"""Shape arguments of nodes on kept tokens, rewritten symbolically (N -> T, B -> 1).

A node copied into a packed layout keeps its traced shape arguments as sympy expressions of
the prompt-length symbol N (and the batch symbol B). `SymbolicShapes` substitutes the kept
token count T of the layout for N, 1 for B, and emits the result as FX arithmetic on the
graph's own size nodes. An unbacked size (a count read from a tensor, e.g. `.tolist()` of
MoE routing counts) is the value its node computes in the rewritten graph, which is only
used where that node's data are the same tokens (the newest layout among its inputs): counts
taken from the full prompt do not size a value on kept tokens. Mixed into `token_drop.TokenDropPass`, whose state (`plan`,
`layouts`, `env`, `new`, `counts`) it reads.
"""

from __future__ import annotations

import operator

import sympy
import torch

from .fx_utils import ancestors
from .plan import RewriteSkipped

# sympy's integer division and modulo (torch's symbolic shapes use FloorDiv and PythonMod)
_BINARY = {"Mod": operator.mod, "PythonMod": operator.mod, "FloorDiv": operator.floordiv}


class SymbolicShapes:
    def _emit_expr(self, expr, j: int):
        t_sym = sympy.Symbol("uniprefill_kept_tokens", integer=True, positive=True)
        subs = {self.plan.axes.seq: t_sym}
        if not isinstance(self.plan.axes.batch, int):
            subs[self.plan.axes.batch] = 1
        new_expr = self.plan.axes.unalias(sympy.sympify(expr)).subs(subs)
        if new_expr != expr:
            self.counts["shape_rewrites"] += 1
        return self._emit(new_expr, {t_sym: self.layouts[j].size}, j)

    def _emit(self, expr, extra, j: int):
        if expr.is_Integer:
            return int(expr)
        if expr.is_Symbol:
            if expr in extra:
                return extra[expr]
            node = self.plan.sym_nodes.get(expr)
            if node is not None and node.op != "placeholder" and self._read_from(node) != j:
                raise RewriteSkipped(f"the size {expr} read from tensor data by {node.name} (computed from "
                                     f"{_tokens(self._read_from(node))}) sizes a value on {_tokens(j)}")
            if node is not None:
                return self.env[node]
            raise RewriteSkipped(f"shape symbol {expr} has no graph input")
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            fold = operator.add if isinstance(expr, sympy.Add) else operator.mul
            terms = [self._emit(a, extra, j) for a in expr.args]
            out = terms[0]
            for t in terms[1:]:
                out = self.new.call_function(fold, (out, t))
            return out
        if type(expr).__name__ in ("Min", "Max"):  # min(index_topk, N) of a DSA indexer (sympy's or torch's)
            fold = torch.sym_min if type(expr).__name__ == "Min" else torch.sym_max
            terms = [self._emit(a, extra, j) for a in expr.args]
            out = terms[0]
            for t in terms[1:]:
                out = self.new.call_function(fold, (out, t))
            return out
        if type(expr).__name__ in _BINARY:
            a, b = (self._emit(x, extra, j) for x in expr.args)
            return self.new.call_function(_BINARY[type(expr).__name__], (a, b))
        raise RewriteSkipped(f"cannot rewrite the shape expression {expr}")

    def _read_from(self, node) -> int:
        """The newest layout among the values `node` is computed from (its data's tokens)."""
        return max((self.layout_of.get(n, 0) for n in ancestors(node) | {node}), default=0)


def _tokens(layout: int) -> str:
    return "all tokens" if layout == 0 else f"the tokens kept at drop point {layout}"
