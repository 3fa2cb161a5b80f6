"""Paired comparison of two systems of one eval results file (accuracy only).

For every (length, task) and for the average over tasks, the mean score difference
B - A in points over the prompts both systems ran, with its paired bootstrap 95% CI
(`uniprefill.eval.scoring.paired_bootstrap_ci`), e.g. an ablation against the default:

    python benchmarks/compare_systems.py results.jsonl \
        "uniprefill p=0.9 cumulative drop=auto" "uniprefill p=0.9 cumulative drop=auto window=compacted"
"""

from __future__ import annotations

import argparse
import collections

from uniprefill.eval.runner import read_records
from uniprefill.eval.scoring import paired_bootstrap_ci


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("system_a", help="system label (as in the summary table)")
    parser.add_argument("system_b")
    args = parser.parse_args()
    scores = collections.defaultdict(dict)  # (length, task) -> {(label, index): score}
    for r in read_records(args.results):
        if r.get("score") is not None and r["system_label"] in (args.system_a, args.system_b):
            scores[(r["length"], r["task"])][(r["system_label"], r["index"])] = float(r["score"])
    if not scores:
        raise SystemExit(f"no scored records of {args.system_a!r} or {args.system_b!r} in {args.results}")
    by_length = collections.defaultdict(lambda: ([], []))
    print(f"B - A, points; A = {args.system_a!r}, B = {args.system_b!r}")
    for (length, task), cell in sorted(scores.items()):
        indices = sorted(i for (label, i) in cell if label == args.system_a and (args.system_b, i) in cell)
        a = [cell[(args.system_a, i)] for i in indices]
        b = [cell[(args.system_b, i)] for i in indices]
        if not indices:
            continue
        by_length[length][0].extend(a)
        by_length[length][1].extend(b)
        mean, low, high = paired_bootstrap_ci(a, b)
        print(f"{length:>6} {task:16s} n={len(indices):3d}  A {100 * sum(a) / len(a):5.1f}  "
              f"B {100 * sum(b) / len(b):5.1f}  B-A {mean:+6.1f} [{low:+.1f}, {high:+.1f}]")
    for length, (a, b) in sorted(by_length.items()):
        mean, low, high = paired_bootstrap_ci(a, b)
        print(f"{length:>6} {'all tasks':16s} n={len(a):3d}  A {100 * sum(a) / len(a):5.1f}  "
              f"B {100 * sum(b) / len(b):5.1f}  B-A {mean:+6.1f} [{low:+.1f}, {high:+.1f}]")


if __name__ == "__main__":
    main()
