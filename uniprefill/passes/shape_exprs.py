"""Shape arguments of nodes on kept tokens, rewritten symbolically (N -> T, B -> 1).

A node copied into a packed layout keeps its traced shape arguments as sympy expressions of
the prompt-length symbol N (and the batch symbol B). `SymbolicShapes` substitutes the kept
token count T of the layout for N, 1 for B, and emits the result as FX arithmetic on the
graph's own size nodes. Mixed into `token_drop.TokenDropPass`, whose state (`plan`,
`layouts`, `env`, `new`, `counts`) it reads.
"""

from __future__ import annotations

import operator

import sympy
import torch

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
        return self._emit(new_expr, {t_sym: self.layouts[j].size})

    def _emit(self, expr, extra):
        if expr.is_Integer:
            return int(expr)
        if expr.is_Symbol:
            if expr in extra:
                return extra[expr]
            if expr in self.plan.sym_nodes:
                return self.env[self.plan.sym_nodes[expr]]
            raise RewriteSkipped(f"shape symbol {expr} has no graph input")
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            fold = operator.add if isinstance(expr, sympy.Add) else operator.mul
            terms = [self._emit(a, extra) for a in expr.args]
            out = terms[0]
            for t in terms[1:]:
                out = self.new.call_function(fold, (out, t))
            return out
        if type(expr).__name__ in ("Min", "Max"):  # min(index_topk, N) of a DSA indexer (sympy's or torch's)
            fold = torch.sym_min if type(expr).__name__ == "Min" else torch.sym_max
            terms = [self._emit(a, extra) for a in expr.args]
            out = terms[0]
            for t in terms[1:]:
                out = self.new.call_function(fold, (out, t))
            return out
        if type(expr).__name__ in _BINARY:
            a, b = (self._emit(x, extra) for x in expr.args)
            return self.new.call_function(_BINARY[type(expr).__name__], (a, b))
        raise RewriteSkipped(f"cannot rewrite the shape expression {expr}")
