"""`bench_serve.sh` repeated on one machine, read against its own noise: standard vLLM and uniprefill served in
turns (standard, uniprefill, standard, uniprefill, ...: one server start each), one folder per round.

    python3 scripts/gpu/vllm/serve_rounds.py ROUND1 ROUND2 [...] [--plot rounds.png] [--out SUMMARY.json]

Each ROUND is a `bench_serve.sh` output folder holding both systems' `vllm bench serve` result files
(`SYSTEM-L-cC.json`, serve_table.py's names). Per (prompt length, concurrency) point held by every round:

* each round's ratio of input tokens/s (uniprefill over standard; both systems' tokens/s in `--out` and the plot);
* the verdict of `pooled_grid.py` over the rounds as separate starts: standard's own band (the widest ratio between
  two of its rounds, never narrower than the median of that over the points), the pooled ratio, the lowest and
  highest cross ratio, and "faster" / "slower" / "within noise";
* the decode: the median of the inter-token gaps after each request's first one (`--save-detailed` files, ms),
  per round and system, and their ratio: a slower decode shows here, one slow step after a drop does not.

A point that some round lacks, for either system, or where a system completed no request, is left out and named
(requests that failed beside completed ones are named too: the input rate counts completed prompts only); a round
missing a system altogether is an error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

SYSTEMS = ("standard", "uniprefill")


def _beside(name: str):
    """A script beside this one (`python3 -P` keeps the script's folder off sys.path)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


serve_table, pooled_grid = _beside("serve_table"), _beside("pooled_grid")


def tokens_per_s(run: dict) -> float:
    return run["total_input_tokens"] / run["duration"]


def later_gap_p50_ms(run: dict) -> float | None:
    """Median of every gap after a request's first one (None without `itls`), as serve_table.py's second table."""
    later = [x * 1e3 for gaps in run.get("itls") or [] for x in gaps[1:]]
    return serve_table._quantile(later, 0.5) if later else None


def _usable(runs: dict, n: int, c: int) -> bool:
    return all(runs.get((system, n, c), {}).get("completed") for system in SYSTEMS)


def summarize(rounds: list[dict[tuple[str, int, int], dict]]) -> tuple[list[dict], list[tuple[int, int]], list[str]]:
    """Per point in every round: the rounds' numbers and the pooled verdict; the points left out (some round lacks
    them, or a system there completed no request); and a note per point and round where requests failed."""
    for i, runs in enumerate(rounds, 1):
        for system in SYSTEMS:
            if not any(key[0] == system for key in runs):
                raise ValueError(f"round {i} has no {system} result file")
    every = {(n, c) for runs in rounds for _, n, c in runs}
    shared = sorted(point for point in every if all(_usable(runs, *point) for runs in rounds))
    failed = [f"round {i}, {system} {n} x {c}: {runs[(system, n, c)]['failed']} request(s) failed"
              for i, runs in enumerate(rounds, 1) for n, c in shared for system in SYSTEMS
              if runs[(system, n, c)].get("failed")]
    seconds = {system: [{point: 1 / tokens_per_s(runs[(system, *point)]) for point in shared} for runs in rounds]
               for system in SYSTEMS}
    verdicts = {(v["length"], v["batch"]): v for v in pooled_grid.pooled(seconds["standard"], seconds["uniprefill"])}
    points = []
    for point in shared:
        rows = [{system: runs[(system, *point)] for system in SYSTEMS} for runs in rounds]
        verdict = verdicts[point]
        points.append({
            "length": point[0], "concurrency": point[1],
            "tokens_per_s": {s: [round(tokens_per_s(r[s])) for r in rows] for s in SYSTEMS},
            "ratio": [round(tokens_per_s(r["uniprefill"]) / tokens_per_s(r["standard"]), 4) for r in rows],
            "later_gap_p50_ms": {s: [later_gap_p50_ms(r[s]) for r in rows] for s in SYSTEMS},
            **{key: verdict[key] for key in ("pooled_ratio", "cross", "band", "verdict")}})
    return points, sorted(every - set(shared)), failed


def table(points: list[dict]) -> str:
    lines = ["| prompt tokens | concurrency | input tok/s ratio per round | pooled ratio | cross (min, max) | "
             "standard's band | verdict | decode later-gap p50 ms, standard -> uniprefill per round |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        band = "-" if p["band"] is None else f"{p['band'][0]:.3f}-{p['band'][1]:.3f}"
        gaps = p["later_gap_p50_ms"]
        decode = ", ".join("-" if a is None or b is None else f"{a:.2f} -> {b:.2f} ({b / a - 1:+.1%})"
                           for a, b in zip(gaps["standard"], gaps["uniprefill"]))
        lines.append(f"| {p['length']} | {p['concurrency']} | {', '.join(f'{r:.3f}' for r in p['ratio'])} | "
                     f"{p['pooled_ratio']:.3f} | {p['cross'][0]:.3f}-{p['cross'][1]:.3f} | {band} | "
                     f"{p['verdict']} | {decode} |")
    return "\n".join(lines)


def plot(points: list[dict], path: Path) -> None:
    """Per point: each round's input tokens/s (top) and later-gap p50 (bottom) of both systems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(points), figsize=(3.4 * len(points), 5.4), squeeze=False)
    for j, p in enumerate(points):
        for system, color in zip(SYSTEMS, ("#555555", "#1f77b4")):
            values = p["tokens_per_s"][system]
            axes[0][j].plot(range(1, len(values) + 1), [v / 1e3 for v in values], "o-", color=color, label=system)
            gaps = p["later_gap_p50_ms"][system]
            if all(g is not None for g in gaps):
                axes[1][j].plot(range(1, len(gaps) + 1), gaps, "o-", color=color, label=system)
        axes[0][j].set_title(f"{p['length']:,} tokens x {p['concurrency']}\n{p['verdict']} "
                             f"(pooled {p['pooled_ratio']:.3f}x)", fontsize=9)
        axes[1][j].set_xlabel("round")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xticks(range(1, len(p["ratio"]) + 1))
    axes[0][0].set_ylabel("input tokens/s (thousands)")
    axes[1][0].set_ylabel("decode gap p50 after the first (ms)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rounds", type=Path, nargs="+", help="bench_serve.sh folders, in the order they ran")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write the summary as JSON")
    args = parser.parse_args(argv)
    try:
        points, left_out, failed = summarize([serve_table.load(folder) for folder in args.rounds])
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    if left_out:
        print(f"left out (not in every round for both systems, or no request completed): {left_out}")
    for note in failed:
        print(note)
    if not points:
        print("no point is in every round", file=sys.stderr)
        return 1
    print(table(points))
    if args.out:
        args.out.write_text(json.dumps({"rounds": [str(r) for r in args.rounds], "points": points}, indent=1))
    if args.plot:
        plot(points, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
