"""Every timed call of a prefill-throughput grid against standard vLLM's median, point by point: a ratio of
medians hides how far one engine's own calls spread, and on a host-bound model that spread is the story.

    python3 scripts/gpu/vllm/grid_plot.py STANDARD.json LABEL=RUN.json [LABEL=RUN.json ...] --out grid.png

STANDARD.json, RUN.json: `defaults_engine.py` runs with a throughput grid (gzipped ones are read as they are).
Each dot is one call's prompt tokens per second over standard's median at that (length, batch) point;
standard's own calls are drawn too, so the band they span is the noise any other engine's dots sit in. The
tick marks each engine's median (the number `compare_engines.py` reports as `ratio`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path


def load_points(path: Path) -> dict[tuple[int, int], list[float]]:
    """(length, batch) -> each timed call's seconds."""
    raw = path.read_bytes()
    run = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    return {(p["length"], p["batch"]): p["seconds_each"] for p in run["throughput"]["points"] if p.get("seconds_each")}


def relative_calls(standard: dict, other: dict) -> dict[tuple[int, int], list[float]]:
    """Per point both runs timed: each of OTHER's calls as throughput over standard's median throughput."""
    return {key: [statistics.median(standard[key]) / s for s in other[key]] for key in standard if key in other}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("standard", type=Path)
    parser.add_argument("runs", nargs="+", help="LABEL=RUN.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="prefill throughput, each call over standard vLLM's median")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    standard = load_points(args.standard)
    runs = [("standard", standard)] + [(label, load_points(Path(path)))
                                       for label, path in (r.split("=", 1) for r in args.runs)]
    keys = sorted(standard)
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(keys)), 4.0))
    for i, (label, points) in enumerate(runs):
        rel = relative_calls(standard, points)
        for x, key in enumerate(keys):
            if key not in rel:
                continue
            xs = x - 0.4 + width * (i + 0.5)
            ax.scatter([xs] * len(rel[key]), rel[key], s=12, color=f"C{i}", alpha=0.7,
                       label=label if x == 0 else None)
            ax.plot([xs - width / 2, xs + width / 2], [statistics.median(rel[key])] * 2, color=f"C{i}", lw=2)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(keys)), [f"{round(length / 1000)}K x {batch}" for length, batch in keys])
    ax.set_xlabel("prompt tokens x batch")
    ax.set_ylabel("tokens/s over standard's median")
    ax.set_title(args.title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
