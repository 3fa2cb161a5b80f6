"""A prefill-throughput grid read against its own noise: several starts of standard vLLM and of the other engine.

    python3 scripts/gpu/vllm/pooled_grid.py --standard S1.json S2.json [...] --other O1.json O2.json [...] [--out SUMMARY.json]

S*.json, O*.json: `defaults_engine.py` runs with a throughput grid (gzipped ones are read as they are), each a
separate engine start, best interleaved on one machine, each compiling afresh (`FRESH_CACHE=1 defaults_grid.sh
/tmp/g gemma-standard gemma-p095 gemma-standard.2 gemma-p095.2`: without FRESH_CACHE a later start loads the first
one's compiled graphs, and the band misses the autotuner's variation). One start's median of five calls is not the
engine's speed: two standard engines started one after the other on an H100 lay 0.76-1.09x apart on Gemma-3-270M
(docs/results/vllm-h100-2026-12-06), as far as the effects sought. So, per (length, batch) point every run has:

* `band`: the noise, from standard's starts alone: the largest ratio between two of their medians (either way
  round), as [1 / largest, largest], but never narrower than the median of that largest ratio over the grid's
  points (two or three starts give one point's band from one or three ratios: a point where two standard starts
  happened to agree must not make 1.01x "faster"); needs two standard starts;
* `pooled_ratio`: the other engine's prompt tokens/s over standard's, median of its starts' medians over the median
  of standard's;
* `cross`: the lowest and highest ratio of one other start's median to one standard start's;
* `verdict`: "faster" when every cross ratio lies above the band, "slower" when every one lies below it, else
  "within noise" ("no band" with one standard start). A target like ">= 1.0x at every point" is met at a point
  when it is not "slower" there, and shown when it is "faster".
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from itertools import combinations
from pathlib import Path


def load_medians(path: Path) -> dict[tuple[int, int], float]:
    """(length, batch) -> the run's median seconds of that point's timed calls."""
    raw = path.read_bytes()
    run = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    points = run.get("throughput", {}).get("points", [])
    return {(p["length"], p["batch"]): statistics.median(p["seconds_each"]) if p.get("seconds_each") else p["seconds"]
            for p in points}


def widest_ratio(standard: list[float]) -> float | None:
    """The largest ratio between two standard starts' medians at one point, either way round (None: one start)."""
    if len(standard) < 2:
        return None
    return max(max(a / b, b / a) for a, b in combinations(standard, 2))


def point_summary(standard: list[float], other: list[float], floor: float = 1.0) -> dict:
    """One point: `standard` and `other` are each start's median seconds (throughput is their inverse); `floor`:
    the narrowest band's upper edge allowed (the grid's typical noise, `pooled`)."""
    if not standard or not other:
        raise ValueError("a point needs at least one start of each engine")
    summary = {"standard_starts": len(standard), "other_starts": len(other),
               "pooled_ratio": round(statistics.median(standard) / statistics.median(other), 3)}
    cross = [s / o for s in standard for o in other]
    summary["cross"] = [round(min(cross), 3), round(max(cross), 3)]
    own = widest_ratio(standard)
    if own is None:
        summary.update(band=None, verdict="no band")
        return summary
    widest = max(own, floor)
    summary["band"] = [round(1 / widest, 3), round(widest, 3)]
    if min(cross) > widest:
        summary["verdict"] = "faster"
    elif max(cross) < 1 / widest:
        summary["verdict"] = "slower"
    else:
        summary["verdict"] = "within noise"
    return summary


def pooled(standard_runs: list[dict], other_runs: list[dict]) -> list[dict]:
    """Per point every run of both engines holds, in (length, batch) order."""
    if not standard_runs or not other_runs:
        raise ValueError("pooled needs at least one run of each engine")
    shared = sorted(set.intersection(*(set(run) for run in standard_runs + other_runs)))
    own = [widest_ratio([run[key] for run in standard_runs]) for key in shared]
    floor = statistics.median(own) if len(standard_runs) > 1 and shared else 1.0
    return [{"length": length, "batch": batch,
             **point_summary([run[(length, batch)] for run in standard_runs],
                             [run[(length, batch)] for run in other_runs], floor)}
            for length, batch in shared]


def table(rows: list[dict]) -> str:
    lines = ["| point | pooled ratio | cross (min, max) | standard's band | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        band = "-" if r["band"] is None else f"{r['band'][0]:.2f}-{r['band'][1]:.2f}"
        lines.append(f"| {round(r['length'] / 1000)}K x {r['batch']} | {r['pooled_ratio']:.2f} | "
                     f"{r['cross'][0]:.2f}-{r['cross'][1]:.2f} | {band} | {r['verdict']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--standard", type=Path, nargs="+", required=True)
    parser.add_argument("--other", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    standard, other = [load_medians(p) for p in args.standard], [load_medians(p) for p in args.other]
    rows = pooled(standard, other)
    every = set().union(*standard, *other)
    if len(every) > len(rows):  # a point some run lacks is left out: say which
        left_out = sorted(every - {(r["length"], r["batch"]) for r in rows})
        print(f"left out (not in every run): {left_out}")
    if not rows:
        print("no point is in every run (runs without a throughput grid?)")
        return 1
    if args.out:
        args.out.write_text(json.dumps({"standard": [str(p) for p in args.standard],
                                        "other": [str(p) for p in args.other], "points": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
