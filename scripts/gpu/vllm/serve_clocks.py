"""The GPU's clocks and power in each request's prefill and decode gaps, from a `bench_serve.sh` run with CLOCKS=1.

    python3 scripts/gpu/vllm/serve_clocks.py OUT_DIR

For each point file `SYSTEM-L-cC.json` (`vllm bench serve --save-detailed`: each request's start on the client's
monotonic clock, its time to the first token and its inter-token gaps) beside `SYSTEM-L-cC.clocks.csv[.gz]`
(nvidia-smi's samples every 10 ms: wall-clock timestamp, SM clock MHz, memory clock MHz, power W, utilisation %,
temperature C) and `SYSTEM-L-cC.clock0.json` (the host's wall clock and monotonic clock read together, and the
host's offset from UTC, which nvidia-smi's local timestamps need): every sample is placed on the monotonic clock
and counted in the interval of the request it falls in, the prefill (start to first token) or gap k (token k to
token k + 1). Per point and system, the median SM clock and power over the samples in each interval, with their
count. A slowdown of the first decode steps after a long prefill that comes from the card (a lower clock after a
step at full power) shows as a lower clock at those positions; one that comes from the host or the work does not.

Prints Markdown and writes OUT_DIR/clocks-table.md; a point without samples is left out and named on stderr.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

POINT = re.compile(r"(.+)-(\d+)-c(\d+)\.json")


def read_samples(csv_path: Path, clock0: dict) -> list[tuple[float, float, float]]:
    """(monotonic seconds, SM clock MHz, power W) per sample; lines nvidia-smi wrote otherwise (an error, a
    '[N/A]') are skipped."""
    opener = gzip.open if csv_path.suffix == ".gz" else open
    shift = clock0["monotonic"] - clock0["wall"] - clock0["utc_offset_s"]  # local-as-UTC epoch -> monotonic
    samples = []
    with opener(csv_path, "rt") as lines:
        for line in lines:
            fields = [f.strip() for f in line.split(",")]
            if len(fields) < 4:
                continue
            try:
                stamp = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
                samples.append((stamp + shift, float(fields[1]), float(fields[3])))
            except ValueError:
                continue
    return samples


def intervals(run: dict, positions: int) -> list[tuple[float, float, int]]:
    """(start, end, position) of every request's prefill (position 0) and first `positions` gaps, monotonic s."""
    spans = []
    for start, ttft, gaps in zip(run.get("start_times") or [], run.get("ttfts") or [], run.get("itls") or []):
        if not ttft:
            continue  # a failed request
        spans.append((start, start + ttft, 0))
        edge = start + ttft
        for k, gap in enumerate((gaps or [])[:positions], 1):
            spans.append((edge, edge + gap, k))
            edge += gap
    return spans


def by_position(run: dict, samples: list[tuple[float, float, float]], positions: int = 15) -> list[list[tuple]]:
    """Per position 0..`positions`: the (SM clock, power) of the samples inside that position's intervals."""
    found: list[list[tuple]] = [[] for _ in range(positions + 1)]
    spans = sorted(intervals(run, positions))
    times = [t for t, _, _ in samples]
    for start, end, k in spans:
        for i in range(bisect.bisect_left(times, start), bisect.bisect_left(times, end)):
            found[k].append(samples[i][1:])
    return found


def table(folder: Path, positions: int = 15) -> list[str]:
    rows, missing = [], []
    for path in sorted(folder.glob("*.json")):
        match = POINT.fullmatch(path.name)
        if not match:
            continue
        stem = path.name[:-len(".json")]
        csv = next((p for p in (folder / f"{stem}.clocks.csv.gz", folder / f"{stem}.clocks.csv") if p.exists()), None)
        clock0 = folder / f"{stem}.clock0.json"
        if csv is None or not clock0.exists():
            missing.append(stem)
            continue
        found = by_position(json.loads(path.read_text()), read_samples(csv, json.loads(clock0.read_text())), positions)
        system, n, c = match.group(1), int(match.group(2)), int(match.group(3))
        for name, index, fmt in (("SM clock MHz", 0, "{:.0f}"), ("power W", 1, "{:.0f}")):
            cells = [fmt.format(statistics.median(s[index] for s in found[k])) if found[k] else "-"
                     for k in range(positions + 1)]
            rows.append(((n, c, system, index), f"| {n} | {c} | {system} | {name} | " + " | ".join(cells) + " |"))
        rows.append(((n, c, system, 2), f"| {n} | {c} | {system} | samples | "
                     + " | ".join(str(len(found[k])) for k in range(positions + 1)) + " |"))
    if missing:
        print(f"no clock samples for: {', '.join(missing)}", file=sys.stderr)
    if not rows:
        return []
    head = "| prompt tokens | concurrency | system | median of | prefill | " + " | ".join(
        f"gap {k}" for k in range(1, positions + 1)) + " |"
    return [head, "|---|---|---|---|" + "---|" * (positions + 1), *(line for _, line in sorted(rows))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--positions", type=int, default=15, help="gaps after the first token shown (default 15)")
    args = parser.parse_args(argv)
    lines = table(args.folder, args.positions)
    if not lines:
        raise SystemExit(f"no point in {args.folder} has clock samples (bench_serve.sh with CLOCKS=1)")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    (args.folder / "clocks-table.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
