"""The side-by-side table of `bench_serve.sh`: each uniprefill system against standard vLLM per prompt length and
client concurrency, from the `--save-result` files of `vllm bench serve` (`SYSTEM-L-cC.json` in one folder;
SYSTEM one of SYSTEMS below: serve_lib.sh).

    python3 scripts/gpu/vllm/serve_table.py OUT_DIR [--plot serve.png]

Per point and system: input tokens/s (prompt tokens over the run's duration, decode included: with 16 output
tokens mostly prefill) of standard and of the system and their ratio, TTFT p50 / p99, TPOT p50 / p99 and the inter-token gap's p99
(ms; TPOT is a per-request mean, the gap's p99 shows a decode stalled behind a long prefill step) of each, and
failed requests, and for a uniprefill system the retention: prompt rows kept after the last drop point over the
rows entering the first, of the requests that dropped during the point (from `SYSTEM-L-cC.totals`, the server's
drop totals before and after it, which bench_serve.sh writes; "-" without them). A point where either completed
no request shows its failure counts and no ratio (vLLM rejected the prompts, say). Prints Markdown and writes OUT_DIR/serve-table.md; a point that standard ran
and a system did not (or the reverse) is an error, not a shorter table.

Where the files hold each request's inter-token gaps (`itls`, from `--save-detailed`), a second table splits them:
the median of each request's first gap after its first token, and the median and p99 of the later gaps. A drop
that costs one step before the first decode shows in the first column only; a slower decode, in the others. A
third table reads the gaps by position: per point, standard's median gap at each position after the first token,
and each system's median there over standard's (a decode that slows down for some steps after a drop and then
recovers shows as ratios that fall back to 1; one slower throughout, as ratios above 1 everywhere);
`--position-baseline SYSTEM` adds the same table over another system's gaps.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

SYSTEMS = ("standard", "standard-onestep", "standard-onestep-split", "uniprefill", "uniprefill-split",
           "uniprefill-chunked")  # each later one against standard (serve_lib.sh)


def load(folder: Path) -> dict[tuple[str, int, int], dict]:
    runs = {}
    for path in folder.glob("*.json"):
        match = re.fullmatch(rf"({'|'.join(SYSTEMS)})-(\d+)-c(\d+)\.json", path.name)
        if match:
            runs[match.group(1), int(match.group(2)), int(match.group(3))] = json.loads(path.read_text())
    return runs


def retention(folder: Path, system: str, length: int, concurrency: int) -> str:
    """Rows kept over rows in, summed over the first worker's runtimes, between the totals read before and after
    the point; "-" where they were not read (standard, an older run, an unreadable endpoint)."""
    path = folder / f"{system}-{length}-c{concurrency}.totals"
    if not path.exists():
        return "-"
    totals = json.loads(path.read_text())
    sums = []
    for side in ("before", "after"):
        workers = totals.get(side)
        if not isinstance(workers, list) or not workers or not isinstance(workers[0], list):
            return "-"  # the endpoint answered with why not
        sums.append([sum(t[key] for t in workers[0]) for key in ("rows_in", "rows_kept")])
    rows_in, kept = (after - before for before, after in zip(*sums))
    return f"{kept / rows_in:.3f}" if rows_in else "none dropped"


def table(runs: dict[tuple[str, int, int], dict], folder: Path | None = None) -> list[str]:
    points = sorted({(n, c) for _, n, c in runs})
    systems = [s for s in SYSTEMS[1:] if any(key[0] == s for key in runs)]
    if not points or not systems:
        raise SystemExit(f"no standard-L-cC.json beside a file of {' / '.join(SYSTEMS[1:])}")
    missing = [(s, n, c) for n, c in points for s in ("standard", *systems) if (s, n, c) not in runs]
    if missing:
        raise SystemExit(f"points missing (a failed server or client?): {missing}")
    lines = ["| prompt tokens | concurrency | system | input tok/s standard -> system | ratio | TTFT p50 ms "
             "| TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | inter-token gap p99 ms | failed | retention |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, c in points:
        for system in systems:
            a, b = runs["standard", n, c], runs[system, n, c]
            failed = f"{a.get('failed', 0)} / {b.get('failed', 0)}"
            if not (a.get("completed") and b.get("completed")):
                lines.append(f"| {n} | {c} | {system} | no completed request | - | - | - | - | - | - | {failed} | - |")
                continue
            rate = [r["total_input_tokens"] / r["duration"] for r in (a, b)]
            pair = lambda key: f"{a.get(key, float('nan')):.1f} -> {b.get(key, float('nan')):.1f}"  # noqa: E731
            lines.append(f"| {n} | {c} | {system} | {rate[0]:,.0f} -> {rate[1]:,.0f} | **{rate[1] / rate[0]:.2f}x** | "
                         f"{pair('median_ttft_ms')} | {pair('p99_ttft_ms')} | {pair('median_tpot_ms')} | "
                         f"{pair('p99_tpot_ms')} | {pair('p99_itl_ms')} | {failed} | "
                         f"{retention(folder, system, n, c) if folder else '-'} |")
    return lines


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def gap_table(runs: dict[tuple[str, int, int], dict]) -> list[str]:
    """First gap after the first token against the later gaps, ms, per point and system; [] where no file holds
    the per-request gaps."""
    lines = []
    for (system, n, c), run in sorted(runs.items(), key=lambda item: (item[0][1], item[0][2], item[0][0])):
        gaps = [g for g in run.get("itls") or [] if g]
        if not gaps:
            continue
        first = [g[0] * 1e3 for g in gaps]
        later = [x * 1e3 for g in gaps for x in g[1:]]
        later_text = f"{_quantile(later, 0.5):.2f} | {_quantile(later, 0.99):.2f}" if later else "- | -"
        lines.append(f"| {n} | {c} | {system} | {_quantile(first, 0.5):.2f} | {max(first):.2f} | {later_text} |")
    if not lines:
        return []
    return ["", "| prompt tokens | concurrency | system | first gap p50 ms | first gap max ms | later gaps p50 ms "
            "| later gaps p99 ms |", "|---|---|---|---|---|---|---|", *lines]


def position_table(runs: dict[tuple[str, int, int], dict], positions: int = 15, baseline: str = "standard") -> list[str]:
    """Per point with the baseline system's per-request gaps: its median gap (ms) at each position 1..`positions`
    after the first token (position 1 is the first gap), then each other system's median there over the baseline's;
    each position's medians over the requests that reached it (true medians: `statistics.median`). [] where no point
    has gaps for the baseline and another system."""
    def medians(run: dict) -> list[float]:
        gaps = [g for g in run.get("itls") or [] if g]
        longest = min(positions, max((len(g) for g in gaps), default=0))
        return [statistics.median(g[i] * 1e3 for g in gaps if len(g) > i) for i in range(longest)]

    lines, width = [], 0
    for n, c in sorted({(n, c) for system, n, c in runs if system == baseline}):
        theirs = medians(runs[(baseline, n, c)])
        others = [(system, medians(runs[(system, n, c)])) for system in SYSTEMS
                  if system != baseline and (system, n, c) in runs]
        others = [(system, ours[:len(theirs)]) for system, ours in others if ours and theirs]
        if not others:
            continue
        shown = max(len(ours) for _, ours in others)
        width = max(width, shown)
        lines.append(f"| {n} | {c} | {baseline}, ms | " + " | ".join(f"{x:.2f}" for x in theirs[:shown]) + " |")
        for system, ours in others:
            lines.append(f"| {n} | {c} | {system} / {baseline} | "
                         + " | ".join(f"{a / b:.3f}" for a, b in zip(ours, theirs)) + " |")
    if not lines:
        return []
    return ["", "| prompt tokens | concurrency | median gap at position | " + " | ".join(str(i + 1) for i in range(width))
            + " |", "|---|---|---|" + "---|" * width, *lines]


def plot(runs: dict[tuple[str, int, int], dict], path: Path) -> None:
    """Two panels per concurrency: input tokens/s and the inter-token gap's p99 of every system, against prompt
    length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted({c for _, _, c in runs})
    lengths_run = sorted({n for _, n, _ in runs})
    fig, axes = plt.subplots(2, len(concurrencies), figsize=(3.6 * len(concurrencies), 5.6), squeeze=False)
    for j, c in enumerate(concurrencies):
        for system in SYSTEMS:
            points = sorted((n, r) for (s, n, cc), r in runs.items() if s == system and cc == c and r.get("completed"))
            if not points:
                continue
            lengths = [n for n, _ in points]
            axes[0][j].plot(lengths, [r["total_input_tokens"] / r["duration"] / 1e3 for _, r in points], marker="o",
                            label=system)
            axes[1][j].plot(lengths, [r.get("p99_itl_ms", float("nan")) for _, r in points], marker="o", label=system)
        axes[0][j].set_title(f"concurrency {c}")
        axes[1][j].set_xlabel("prompt tokens")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths_run, [f"{n:,}" for n in lengths_run])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("input tokens/s (thousands)")
    axes[1][0].set_ylabel("inter-token gap p99 (ms)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--plot", type=Path, default=None, help="also draw input tokens/s and the inter-token gap's p99 (PNG)")
    parser.add_argument("--position-baseline", default=None, choices=SYSTEMS[1:],
                        help="also the gaps by position over this system's (e.g. standard-onestep: the drop apart "
                             "from the step budget)")
    args = parser.parse_args(argv)
    runs = load(args.folder)
    lines = table(runs, args.folder) + gap_table(runs) + position_table(runs)
    if args.position_baseline:
        lines += position_table(runs, baseline=args.position_baseline)
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    (args.folder / "serve-table.md").write_text(text)
    if args.plot:
        plot(runs, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
