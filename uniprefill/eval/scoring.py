"""Scoring as RULER does it, and a paired bootstrap for method-vs-baseline differences.

Per-sample scores are fractions in [0, 1]: `string_match_all` is the share of reference
answers found (case-insensitively) in the output, `string_match_part` is 1 if any is.
Tables and confidence intervals report points (x 100), as RULER does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from .tasks import TASK_NAMES, UNAVAILABLE_TASKS

_NON_PRINTABLE = re.compile(r"[\x00-\x1f]")


def clean_prediction(text: str) -> str:
    """Control characters to spaces, surrounding whitespace off (RULER's post-processing)."""
    return _NON_PRINTABLE.sub(" ", text).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Share of `references` contained in `prediction`, ignoring case."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    pred = prediction.lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any of `references` is contained in `prediction` (ignoring case), else 0.0."""
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    pred = prediction.lower()
    return float(any(ref.lower() in pred for ref in references))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}
# RULER: every synthetic task scores all references; the QA tasks score any one of them.
TASK_METRICS: dict[str, str] = {
    **{name: "string_match_all" for name in TASK_NAMES},
    **{name: "string_match_part" for name in UNAVAILABLE_TASKS},
}


def score(task: str, prediction: str, references: Sequence[str]) -> float:
    """The per-sample score of `prediction` under the metric of `task`, in [0, 1]."""
    if task not in TASK_METRICS:
        raise ValueError(f"no metric for task {task!r}; known: {sorted(TASK_METRICS)}")
    return METRICS[TASK_METRICS[task]](clean_prediction(prediction), references)


def paired_bootstrap_ci(
    baseline_scores: Sequence[float],
    method_scores: Sequence[float],
    n_boot: int = 10000,
    seed: int = 0,
    alpha: float = 0.05,
) -> tuple[float, float, float]:
    """Mean of (method - baseline) over the same prompts and its percentile CI, in points.

    Args:
        baseline_scores, method_scores: per-sample scores in [0, 1], paired by position
            (the same prompt at the same index).
        n_boot: bootstrap resamples of the prompts.
        alpha: 1 - confidence level of the two-sided interval.

    Returns:
        (mean difference, low, high), each x 100.
    """
    base = np.asarray(baseline_scores, dtype=np.float64)
    meth = np.asarray(method_scores, dtype=np.float64)
    if base.ndim != 1 or base.shape != meth.shape:
        raise ValueError(
            f"need two 1-D score lists of equal length; got {base.shape} and {meth.shape}"
        )
    if base.size == 0:
        raise ValueError("need at least one paired score")
    if not (0.0 < alpha < 1.0) or n_boot < 1:
        raise ValueError(f"alpha={alpha} must be in (0, 1) and n_boot={n_boot} >= 1")
    for name, arr in (("baseline_scores", base), ("method_scores", meth)):
        if np.isnan(arr).any() or arr.min() < 0.0 or arr.max() > 1.0:
            raise ValueError(f"{name} must be per-sample scores in [0, 1] (not points)")
    diff = meth - base
    rng = np.random.default_rng(seed)
    # Resample in chunks to bound memory at large n_boot x n.
    means = np.empty(n_boot)
    chunk = max(1, 4_000_000 // diff.size)
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, diff.size, size=(stop - start, diff.size))
        means[start:stop] = diff[idx].mean(axis=1)
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(diff.mean() * 100), float(low * 100), float(high * 100)
