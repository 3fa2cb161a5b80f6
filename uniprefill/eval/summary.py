"""Summaries of evaluation records: per task, length and system, against the baseline.

Scores are averaged in points; a method's difference to the baseline comes with a paired
bootstrap CI over the prompts both ran. TTFT and speedup come from the timed prompts only
(all of them unless the run timed a subset), beside the FLOP-model ideal speedup of those
same prompts and, where the run measured it (`--measured-ideal`), the measured ideal (the
plain model timed on the kept token counts, `uniprefill.eval.ideal`). Where a results file holds two baselines (eager
and compiled), the faster one at that task and length is the reference, so TTFT speedups
are never flattered by a slow baseline. The "average" rows pool every task of a length,
as RULER's average does when each task has the same number of samples.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from .scoring import paired_bootstrap_ci

AVERAGE = "average"


def _prompt_key(r: dict[str, Any]) -> tuple:
    return (r["task"], r["index"], r["seed"], r["haystack"])


def summarize(records: Iterable[dict[str, Any]], *, n_boot: int = 10000, seed: int = 0
              ) -> list[dict[str, Any]]:
    """One row per (model, length, task, system) and per (model, length, system) average."""
    cells: dict[tuple, dict[str, dict[tuple, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        cells[(r["model"], r["length"], r["task"])][r["system"]][_prompt_key(r)] = r
    rows = []
    pooled: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for (model, length, task), systems in sorted(cells.items()):
        base_name = _fastest_baseline(systems)
        base = systems.get(base_name, {}) if base_name else {}
        for name, by_prompt in sorted(systems.items(), key=lambda kv: _order(kv[1])):
            pairs = [(base[k], r) for k, r in by_prompt.items() if k in base]
            pool = pooled[(model, length, name)]
            pool["records"].extend(by_prompt.values())
            pool["pairs"].extend(pairs)
            rows.append(_row(model, length, task, name, list(by_prompt.values()), pairs,
                             n_boot, seed, is_reference=name == base_name))
    for (model, length, name), pool in sorted(pooled.items()):
        tasks = {r["task"] for r in pool["records"]}
        if len(tasks) > 1:
            rows.append(_row(model, length, AVERAGE, name, pool["records"], pool["pairs"],
                             n_boot, seed, is_reference=None))
    return rows


def _order(by_prompt: dict) -> tuple:
    first = next(iter(by_prompt.values()))
    return (first["role"] != "baseline", first["system_label"])


def _ttft(r: dict[str, Any]) -> float | None:
    return r.get("ttft_s")


def _fastest_baseline(systems: dict[str, dict]) -> str | None:
    """The baseline with the lowest median TTFT (over its timed prompts)."""
    baselines = []
    for name, recs in systems.items():
        if next(iter(recs.values()))["role"] != "baseline":
            continue
        times = [_ttft(r) for r in recs.values() if _ttft(r) is not None]
        baselines.append((statistics.median(times) if times else float("inf"), name))
    return min(baselines)[1] if baselines else None


def _early_sparse_label(config: dict) -> str | None:
    """"keep=0.05" / "p=0.9" for a config with sparse attention before the first drop, else None."""
    if config.get("early_sparse_keep") is not None:
        return f"keep={config['early_sparse_keep']:g}"
    if config.get("early_sparse_p") is not None:
        return f"p={config['early_sparse_p']:g}"
    return None


def _mean_of(per_layer: dict | None) -> float | None:
    return sum(per_layer.values()) / len(per_layer) if per_layer else None


def _row(model, length, task, name, recs, pairs, n_boot, seed, is_reference) -> dict[str, Any]:
    first = recs[0]
    scored = [r["score"] for r in recs if r["score"] is not None]
    timed = [_ttft(r) for r in recs if _ttft(r) is not None]
    spec = first.get("system_spec") or {}
    config = spec.get("config") or {}
    row: dict[str, Any] = {
        "model": model, "length": length, "task": task, "system": name,
        "label": first["system_label"], "role": first["role"],
        "p": config.get("p"), "policy": config.get("policy"),
        "drop_layers": _drop_label(config.get("drop_layers")),
        "selection": config.get("selection", "paper") if config else None,  # records from before the field: paper
        "early_sparse": _early_sparse_label(config),
        "sparse_density": _mean([_mean_of((r.get("drop_report") or {}).get("sparse_density")) for r in recs]),
        "n": len(recs), "n_scored": len(scored),
        "score": 100 * statistics.fmean(scored) if scored else None,
        "generation_pending": sum(r["generation"] == "pending" for r in recs),
        "n_timed": len(timed),
        "ttft_ms": 1000 * statistics.median(timed) if timed else None,
        "retention": _mean([r.get("overall_retention") for r in recs]),
        "peer": (spec.get("peer") or {}).get("method"),
        "density": _mean([(r.get("drop_report") or {}).get("density") for r in recs]) if spec.get("peer") else None,
        "delta": None, "ci_low": None, "ci_high": None, "speedup": None, "n_paired": 0,
        "ideal_speedup": None, "speedup_vs_ideal": None,
        "ideal_measured_speedup": None, "speedup_vs_measured_ideal": None,
    }
    if first["role"] == "baseline" or not pairs:
        if is_reference:
            row["speedup"] = 1.0
        return row
    row["n_paired"] = len(pairs)
    timed_pairs = [(b, m) for b, m in pairs if _ttft(b) is not None and _ttft(m) is not None]
    if timed_pairs:
        row["speedup"] = (statistics.median(_ttft(b) for b, _ in timed_pairs)
                          / statistics.median(_ttft(m) for _, m in timed_pairs))
        ideals = [m.get("ideal_speedup") for _, m in timed_pairs]
        if all(x is not None for x in ideals):
            # the ideal of the same prompts the speedup was timed on
            row["ideal_speedup"] = statistics.median(ideals)
            row["speedup_vs_ideal"] = row["speedup"] / row["ideal_speedup"]
        measured = [(m.get("ideal_measured") or {}).get("speedup") for _, m in timed_pairs]
        if all(x is not None for x in measured):
            # the plain model timed on the kept token counts (uniprefill.eval.ideal), same prompts
            row["ideal_measured_speedup"] = statistics.median(measured)
            row["speedup_vs_measured_ideal"] = row["speedup"] / row["ideal_measured_speedup"]
    scored_pairs = [(b["score"], m["score"]) for b, m in pairs
                    if b["score"] is not None and m["score"] is not None]
    if scored_pairs:
        base, meth = zip(*scored_pairs)
        row["delta"], row["ci_low"], row["ci_high"] = paired_bootstrap_ci(
            base, meth, n_boot=n_boot, seed=seed)
    return row


def _drop_label(drop) -> str | None:
    if drop is None or isinstance(drop, str):
        return drop
    return ",".join(str(x) for x in drop)


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table of `summarize` rows."""
    header = ("length", "task", "system", "n", "score", "delta [95% CI]", "TTFT ms",
              "speedup", "ideal", "ideal meas.", "retention")
    lines = []
    for r in rows:
        if r["score"] is not None:
            score = f"{r['score']:.1f}"
        else:
            score = "pending" if r["generation_pending"] else "-"
        delta = (f"{r['delta']:+.1f} [{r['ci_low']:+.1f}, {r['ci_high']:+.1f}]"
                 if r["delta"] is not None else "")
        lines.append((
            str(r["length"]), r["task"], r["label"], str(r["n"]), score, delta,
            f"{r['ttft_ms']:.1f}" if r.get("ttft_ms") is not None else "-",
            f"{r['speedup']:.2f}x" if r["speedup"] is not None else "",
            f"{r['ideal_speedup']:.2f}x" if r.get("ideal_speedup") is not None else "",
            f"{r['ideal_measured_speedup']:.2f}x" if r.get("ideal_measured_speedup") is not None else "",
            f"{r['retention']:.3f}" if r["retention"] is not None else
            (f"density {r['density']:.3f}" if r.get("density") is not None else ""),
        ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line) for line in lines]
    return "\n".join(out)


def plot_pareto(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Accuracy vs TTFT speedup: one panel per length, one curve per (selection rule, policy, drop set,
    sparse attention before the first drop).

    Accuracy is the paired difference to the baseline (points, average over tasks) with its
    bootstrap 95% CI, so a curve whose prompts are a subset of the baseline's (a matrix still
    being filled) is compared on its own prompts; such partial curves are dashed and say n.
    The baseline sits at (1x, 0). A length with no timed method row (an untimed run) is drawn
    against 1 / retention instead (the share of token-layers the method skipped, as a factor),
    and its panel says so; a peer is one diamond per setting, at its speedup (untimed: at
    1 / its attention density).
    """
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_average = any(r["task"] == AVERAGE for r in rows)
    chosen = [r for r in rows if (r["task"] == AVERAGE) == has_average]
    lengths = sorted({r["length"] for r in chosen}) or [None]
    cols = min(2, len(lengths))
    fig, axes = plt.subplots(math.ceil(len(lengths) / cols), cols, figsize=(6 * cols, 4.2 * math.ceil(len(lengths) / cols)),
                             squeeze=False)
    plotted = 0
    for ax, length in zip(axes.flat, lengths):
        at_length = [r for r in chosen if r["length"] == length]
        full_n = max((r["n"] for r in at_length if r["role"] == "baseline"), default=0)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.plot([1.0], [0.0], marker="s", color="black", linestyle="none", label="baseline")
        def curve(r):
            return r.get("selection") or "paper", r["policy"], r.get("drop_layers"), r.get("early_sparse") or ""

        curves = sorted({curve(r) for r in at_length if r["policy"]}, key=str)
        rules = {rule for rule, *_ in curves}
        untimed = not any(r["speedup"] is not None for r in at_length if r["policy"] or r.get("peer"))

        def x_of(r):
            if not untimed:
                return r["speedup"]
            return 1.0 / r["retention"] if r.get("retention") else None

        for rule, policy, drop, sparse in curves:
            points = sorted((x_of(r), r["delta"], r["ci_low"], r["ci_high"], r["p"], r["n"]) for r in at_length
                            if curve(r) == (rule, policy, drop, sparse)
                            and r["delta"] is not None and x_of(r) is not None)
            if not points:
                continue
            ns = sorted({n for *_, n in points})
            partial = ns[0] < full_n
            n_text = f"n={ns[0]}" if len(ns) == 1 else f"n={ns[0]}-{ns[-1]}"
            label = (f"{rule}, " if len(rules) > 1 else "") + f"{policy}" + (f", drop {drop}" if drop else "") \
                + (f", early sparse {sparse}" if sparse else "") + (f" (partial, {n_text})" if partial else "")
            xs, ys = zip(*sorted([(1.0, 0.0)] + [(x, y) for x, y, *_ in points]))  # the baseline in x order
            line, = ax.plot(xs, ys, marker="o", linestyle="--" if partial else "-", label=label)
            ax.errorbar([x for x, *_ in points], [y for _, y, *_ in points],
                        yerr=[[y - lo for _, y, lo, *_ in points], [hi - y for _, y, _, hi, *_ in points]],
                        fmt="none", ecolor=line.get_color(), alpha=0.35, capsize=2)
            for x, y, _, _, p, _ in points:
                ax.annotate(f"p={p:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            plotted += 1
        for r in (r for r in at_length if r.get("peer") and r["delta"] is not None):
            x = r["speedup"] if not untimed else (1.0 / r["density"] if r.get("density") else None)
            if x is not None:  # a peer is one point: its settings are not a p sweep
                ax.errorbar([x], [r["delta"]], yerr=[[r["delta"] - r["ci_low"]], [r["ci_high"] - r["delta"]]],
                            marker="D", linestyle="none", capsize=2, label=f"peer: {r['label']}")
                plotted += 1
        ax.set_title((f"{length} tokens" if length is not None else "no results") + (" (untimed)" if untimed else ""))
        ax.set_xlabel("1 / retention (untimed run: no TTFT)" if untimed else "TTFT speedup over baseline (x)")
        ax.set_ylabel("score - baseline (points, 95% CI)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(lengths):]:
        ax.set_visible(False)
    if not plotted:
        axes.flat[0].text(0.5, 0.5, "no scored method results (generation pending?)",
                          ha="center", va="center", transform=axes.flat[0].transAxes)
    fig.suptitle("Accuracy vs prefill speedup (paired with the baseline)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
