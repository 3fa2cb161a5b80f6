"""Whether a traced program holds for fewer tokens than it was traced with (dynamo's shape guards).

Layers after a drop run the traced program on the kept-token count, which the trace never saw.
`length_guard_violation` reads two signs that the program does not hold for it; the plan refuses
such a graph (`plan.LengthSpecialized` for the first, `plan.RewriteSkipped` for the second).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch


@dataclass(frozen=True)
class GuardViolation:
    bounded: bool  # the length is bounded on both sides (a loop or recursion on it): every length traces again
    message: str


def length_guard_violation(seq) -> GuardViolation | None:
    """Why the traced program holds for some prompt lengths only, or None (see the module docstring).

    Layers after a drop run the traced program on the kept-token count, which the trace never
    saw. Two signs that the program does not hold for it, read from dynamo's shape guards:

    * the length symbol is bounded on both sides: the model's Python code loops or recurses on
      the length (torch's generic associative scan, which transformers' Mamba fallback uses under
      dynamo, halves the sequence recursively; a trace at 100 tokens holds for 96..127 only;
      `uniprefill.compile` routes that fallback through `scan_ops` first). Every new length is traced
      again: `LengthSpecialized`;
    * an equality guard on the length fails for a smaller count (GraniteMoeHybrid's chunked
      scan traced at 64 tokens assumes a whole number of 64-token chunks). Checked on a sample
      of counts below the prompt length (near it, small ones, and chunk multiples +-1).

    A lower bound alone comes from mask-building branches (Gemma-3's `length > sliding_window`)
    that the rewrite replaces, and inequality guards from branches that are harmless at the
    boundary (padding by zero): both are left alone.
    """
    context = torch._guards.TracingContext.try_get()
    shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    if shape_env is None or not isinstance(seq, sympy.Symbol):
        return None
    bounds = shape_env.var_to_range.get(seq)
    if bounds is not None and bounds.lower.is_Integer and bounds.upper.is_Integer and int(bounds.lower) > 2:
        return GuardViolation(True, f"the traced program holds only for prompt lengths {int(bounds.lower)}.."
                              f"{int(bounds.upper)} (the model's code loops or recurses on the length, e.g. a scan): "
                              "layers after a drop could not run on fewer kept tokens")
    # the hint of every backed symbol (torch 2.13 renamed var_to_val, deprecating the old name)
    hints = shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val
    length = hints.get(seq)
    if length is None:
        return None
    # symbols of the same value stand for the same length (the size of another input that follows
    # the tokens: a mask or position ids, recompiled with a symbol of its own) and follow it
    lengths = {seq} | {s for s, v in hints.items() if v == length}
    others = {s: v for s, v in hints.items() if s not in lengths}
    samples = count_samples(int(length))
    for guard in shape_env.guards:
        expr = guard.expr
        if not (expr.free_symbols & lengths) or not expr.atoms(sympy.Eq):
            continue
        expr = expr.xreplace(others)
        for count in samples:
            if expr.xreplace(dict.fromkeys(lengths, count)) is sympy.false:
                return GuardViolation(False, f"the traced program holds only for some prompt lengths (guard "
                                      f"{guard.expr} fails for {count} tokens, e.g. a chunked scan without padding): "
                                      "layers after a drop could not run on fewer kept tokens")
    return None


def count_samples(length: int) -> list[int]:
    """Kept-token counts to try an equality guard at: near the length, small ones, chunk multiples +-1, halves."""
    near = range(max(2, length - 8), length)
    small = range(2, min(length, 18))
    chunks = {m + d for c in (8, 16, 32, 64, 128, 256) for m in range(c, min(length, 8 * c + 1), c) for d in (-1, 0, 1)}
    halves = {length // 2 - 1, length // 2, length // 2 + 1}
    return sorted(t for t in {*near, *small, *chunks, *halves} if 2 <= t < length)
