"""Every timed prefill of `ab_own_process.sh` runs, one column per machine call: a median of a host-bound small
model hides how far its prefills spread, and on one box the order of the engines in a call matters too.

    python3 scripts/gpu/vllm/ab_plot.py "call 1: head.json old78.json" "call 2: ..." --out ab.png

Each argument is one call: a title, a colon, then the run JSONs (`profile_prefill.py --own-process` output, the
engine's name taken from the file name up to its first `-` or `.`) in the order the call ran them. Each dot is one
prefill's wall time; the tick marks the median.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLORS = {"standard": "#555555", "head": "#1f77b4"}
OTHER = "#d62728"


def calls_of(specs: list[str]) -> list[tuple[str, list[tuple[str, list[float]]]]]:
    """[(title, [(engine, walls ms), ...] in run order)] from the command-line call specs."""
    out = []
    for spec in specs:
        title, _, files = spec.partition(":")
        runs = []
        for name in files.split():
            walls = json.loads(Path(name).read_text())["prefill_wall_ms"]
            runs.append((Path(name).name.split(".")[0].split("-")[0], [float(w) for w in walls]))
        out.append((title.strip(), runs))
    return out


def plot(calls, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(calls), figsize=(3.2 * len(calls), 3.6), sharey=True, squeeze=False)
    for ax, (call_title, runs) in zip(axes[0], calls):
        for x, (engine, walls) in enumerate(runs):
            color = COLORS.get(engine, OTHER)
            jitter = [x + 0.18 * ((i % 5) - 2) / 2 for i in range(len(walls))]
            ax.scatter(jitter, walls, s=12, color=color, alpha=0.7)
            median = sorted(walls)[(len(walls) - 1) // 2]
            ax.hlines(median, x - 0.3, x + 0.3, color=color, linewidth=2)
        ax.set_xticks(range(len(runs)), [f"{i + 1}. {e}" for i, (e, _) in enumerate(runs)], fontsize=8)
        ax.set_title(call_title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("prefill wall, ms (one dot a prefill)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calls", nargs="+", help='"TITLE: RUN.json RUN.json ..." per machine call')
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    calls = calls_of(args.calls)
    plot(calls, args.out, args.title)
    for call_title, runs in calls:
        print(call_title + ": " + ", ".join(f"{e} {sorted(w)[(len(w) - 1) // 2]:.1f} ms" for e, w in runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
