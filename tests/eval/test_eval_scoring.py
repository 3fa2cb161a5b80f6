"""Scoring by hand-made cases, and the paired bootstrap's sanity."""

import random

import pytest

from uniprefill.eval.scoring import (
    TASK_METRICS,
    clean_prediction,
    paired_bootstrap_ci,
    score,
    string_match_all,
    string_match_part,
)
from uniprefill.eval.tasks import TASK_NAMES


def test_string_match_all_is_the_mean_over_references():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("the numbers are 123", ["123", "456"]) == 0.5
    assert string_match_all("nothing here", ["123", "456", "789", "000"]) == 0.0
    assert string_match_all("ABC-def", ["abc-DEF"]) == 1.0  # case-insensitive


def test_string_match_part_is_the_max():
    assert string_match_part("Paris, France", ["paris", "lyon"]) == 1.0
    assert string_match_part("Berlin", ["paris", "lyon"]) == 0.0


def test_empty_references_raise():
    with pytest.raises(ValueError):
        string_match_all("x", [])
    with pytest.raises(ValueError):
        string_match_part("x", [])


def test_task_metrics_follow_ruler():
    assert all(TASK_METRICS[t] == "string_match_all" for t in TASK_NAMES)
    assert TASK_METRICS["qa_1"] == TASK_METRICS["qa_2"] == "string_match_part"
    assert score("niah_multivalue", " 11, 22\x00 and 33", ["11", "22", "33", "44"]) == 0.75
    with pytest.raises(ValueError, match="no metric"):
        score("nope", "x", ["x"])


def test_clean_prediction():
    assert clean_prediction("  a\tb\x01c \n") == "a b c"


def test_bootstrap_identical_scores_is_zero():
    scores = [1.0, 0.0, 0.5, 1.0, 0.25]
    assert paired_bootstrap_ci(scores, scores) == (0.0, 0.0, 0.0)


def test_bootstrap_clear_improvement_is_above_zero():
    rng = random.Random(0)
    base = [float(rng.random() < 0.4) for _ in range(300)]
    method = [1.0 if rng.random() < 0.7 else b for b in base]
    mean, low, high = paired_bootstrap_ci(base, method, n_boot=2000)
    assert 0 < low < mean < high
    assert mean == pytest.approx(100 * (sum(method) - sum(base)) / len(base))
    # Same seed, same interval; a clear drop is below zero.
    assert paired_bootstrap_ci(base, method, n_boot=2000) == (mean, low, high)
    assert paired_bootstrap_ci(method, base, n_boot=2000)[2] < 0


def test_bootstrap_no_change_on_average_covers_zero():
    rng = random.Random(1)
    base = [float(rng.random() < 0.5) for _ in range(200)]
    method = base[:]
    rng.shuffle(method)  # different per prompt, same mean
    mean, low, high = paired_bootstrap_ci(base, method, n_boot=2000)
    assert mean == 0.0 and low < 0 < high


def test_bootstrap_validates_input():
    with pytest.raises(ValueError, match="equal length"):
        paired_bootstrap_ci([1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="at least one"):
        paired_bootstrap_ci([], [])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        paired_bootstrap_ci([100.0, 0.0], [100.0, 100.0])  # points, not fractions
