"""The GPU's clocks and power in each request's prefill and decode gaps, from a `bench_serve.sh` run with CLOCKS=1.

    python3 scripts/gpu/vllm/serve_clocks.py OUT_DIR

For each point file `SYSTEM-L-cC.json` (`vllm bench serve --save-detailed`: each request's start on the client's
monotonic clock, its time to the first token and its inter-token gaps) beside `SYSTEM-L-cC.clocks.csv[.gz]`
(nvidia-smi's samples every 10 ms: wall-clock timestamp, SM clock MHz, memory clock MHz, power W, ..., with a
header naming the columns) and `SYSTEM-L-cC.clock0.json` (the host's wall clock and monotonic clock read together,
and the host's offset from UTC, which nvidia-smi's local timestamps need): every sample is placed on the monotonic
clock and counted in the interval of the request it falls in, the prefill (start to first token) or gap k (token k
to token k + 1). Per point and system, the median SM clock and power over the samples in each interval, with their
count, and where the CSV holds nvidia-smi's clock event reasons (`clocks_event_reasons.active`, a bit mask), the
share of samples whose clock the software power cap was holding down. A slowdown of the first decode steps after
a long prefill that comes from the card shows as a lower clock at those positions; one that comes from the host or
the work does not.

Prints Markdown and writes OUT_DIR/clocks-table.md; a point without samples is left out and named on stderr.
`--dip-below MHZ` adds where in each request the SM clock fell below MHZ (from half a second after its start to
150 ms after its first token): the median first and last such sample from the request's start, beside its time to
the first token, which tells a dip tied to the prefill's start from one tied to its end.
`--plot PNG` draws the samples against time from each request's first token (median per 10 ms over the requests):
SM clock and power per system and point, where the clock's fall and rise around the end of the prefill show.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import re
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

POINT = re.compile(r"(.+)-(\d+)-c(\d+)\.json")


SW_POWER_CAP = 0x4  # NVML's clock event reason "SW power scaling algorithm is reducing the clocks"


def _columns(header: list[str]) -> dict[str, int]:
    """Column index of the SM clock, power and clock event reasons in nvidia-smi's CSV header (names with units)."""
    names = [h.split("[")[0].strip() for h in header]
    where = {"sm": names.index("clocks.current.sm") if "clocks.current.sm" in names else 1,
             "power": names.index("power.draw") if "power.draw" in names else 3}
    reasons = [i for i, name in enumerate(names) if name.endswith("reasons.active")]
    if reasons:
        where["reasons"] = reasons[0]
    return where


def read_samples(csv_path: Path, clock0: dict) -> list[tuple[float, float, float, float]]:
    """(monotonic seconds, SM clock MHz, power W, SW power cap 1.0 / 0.0 or nan where not sampled) per sample,
    the columns found by the CSV's header where it has one (else timestamp, SM clock, memory clock, power);
    lines nvidia-smi wrote otherwise (an error, a '[N/A]') are skipped."""
    opener = gzip.open if csv_path.suffix == ".gz" else open
    shift = clock0["monotonic"] - clock0["wall"] - clock0["utc_offset_s"]  # local-as-UTC epoch -> monotonic
    samples, where = [], {"sm": 1, "power": 3}
    with opener(csv_path, "rt") as lines:
        for line in lines:
            fields = [f.strip() for f in line.split(",")]
            if fields[0] == "timestamp":
                where = _columns(fields)
                continue
            if len(fields) <= max(where.values()):
                continue
            try:
                stamp = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
                sample = (stamp + shift, float(fields[where["sm"]]), float(fields[where["power"]]))
            except ValueError:
                continue
            try:
                capped = float(bool(int(fields[where["reasons"]], 16) & SW_POWER_CAP))
            except (KeyError, ValueError):  # not sampled, or '[N/A]'
                capped = math.nan
            samples.append((*sample, capped))
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


def by_position(run: dict, samples: list[tuple], positions: int = 15) -> list[list[tuple]]:
    """Per position 0..`positions`: the (SM clock, power, SW power cap) of the samples inside that position's
    intervals."""
    found: list[list[tuple]] = [[] for _ in range(positions + 1)]
    spans = sorted(intervals(run, positions))
    times = [sample[0] for sample in samples]
    for start, end, k in spans:
        for i in range(bisect.bisect_left(times, start), bisect.bisect_left(times, end)):
            found[k].append(samples[i][1:])
    return found


def around_first_token(run: dict, samples: list[tuple], before_ms: float = 1200.0,
                       after_ms: float = 150.0, bin_ms: float = 10.0) -> list[tuple[float, float, float, int]]:
    """(bin start ms from the first token, median SM clock, median power, samples) per `bin_ms` bin from
    -`before_ms` to `after_ms`, over every request's first token; bins without samples are left out."""
    bins: dict[int, list[tuple[float, float]]] = {}
    times = [sample[0] for sample in samples]
    for start, ttft in zip(run.get("start_times") or [], run.get("ttfts") or []):
        if not ttft:
            continue
        first = start + ttft
        for i in range(bisect.bisect_left(times, first - before_ms / 1e3), bisect.bisect_left(times, first + after_ms / 1e3)):
            bins.setdefault(int((samples[i][0] - first) * 1e3 // bin_ms), []).append(samples[i][1:])
    return [(k * bin_ms, statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), len(v))
            for k, v in sorted(bins.items())]


def points(folder: Path) -> tuple[list[tuple[tuple[str, int, int], dict, list]], list[str]]:
    """((system, length, concurrency), the point's result, its samples) per point with samples, and the points
    without."""
    found, missing = [], []
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
        key = (match.group(1), int(match.group(2)), int(match.group(3)))
        found.append((key, json.loads(path.read_text()), read_samples(csv, json.loads(clock0.read_text()))))
    return found, missing


def dip_table(folder: Path, below_mhz: float) -> list[str]:
    """Per point: TTFT p50, and the median first / last sample under `below_mhz` from each request's start."""
    lines = []
    for (system, n, c), run, samples in points(folder)[0]:
        first, last = [], []
        for start, ttft in zip(run.get("start_times") or [], run.get("ttfts") or []):
            low = [t - start for t, clock, *_ in samples if start + 0.5 <= t <= start + ttft + 0.15 and clock < below_mhz]
            if ttft and low:
                first.append(low[0] * 1e3)
                last.append(low[-1] * 1e3)
        ttfts = [t * 1e3 for t in run.get("ttfts") or [] if t]
        stretch = f"{statistics.median(first):.0f} - {statistics.median(last):.0f}" if first else "-"
        lines.append(f"| {n} | {c} | {system} | {statistics.median(ttfts):.0f} | {stretch} | {len(first)} of {len(ttfts)} |")
    return ["", f"| prompt tokens | concurrency | system | TTFT p50 ms | SM clock under {below_mhz:.0f} MHz, ms from the "
            "request's start (medians of first - last sample) | requests with such samples |",
            "|---|---|---|---|---|---|", *lines]


def plot(folder: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found, _ = points(folder)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for (system, n, c), run, samples in found:
        series = around_first_token(run, samples)
        label = f"{system} {n} x {c}"
        top.plot([b for b, *_ in series], [x for _, x, _, _ in series], label=label, lw=1.2)
        bottom.plot([b for b, *_ in series], [w for _, _, w, _ in series], label=label, lw=1.2)
    for ax in (top, bottom):
        ax.axvline(0, color="black", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    top.set_ylabel("SM clock, MHz (median)")
    bottom.set_ylabel("power, W (median)")
    bottom.set_xlabel("ms from each request's first token (the prefill ends just before it; the decode after)")
    top.set_title(f"{folder.name}: nvidia-smi every 10 ms around the end of each prefill")
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(folder: Path, positions: int = 15) -> list[str]:
    rows = []
    found, missing = points(folder)
    for (system, n, c), run, samples in found:
        found_at = by_position(run, samples, positions)
        for name, index, fmt in (("SM clock MHz", 0, "{:.0f}"), ("power W", 1, "{:.0f}")):
            cells = [fmt.format(statistics.median(s[index] for s in found_at[k])) if found_at[k] else "-"
                     for k in range(positions + 1)]
            rows.append(((n, c, system, index), f"| {n} | {c} | {system} | {name} | " + " | ".join(cells) + " |"))
        if any(not math.isnan(sample[3]) for sample in samples):  # the clock event reasons were sampled
            read = [[x[2] for x in found_at[k] if not math.isnan(x[2])] for k in range(positions + 1)]
            cells = [f"{statistics.mean(shares):.2f}" if shares else "-" for shares in read]
            rows.append(((n, c, system, 2), f"| {n} | {c} | {system} | share under SW power cap | "
                         + " | ".join(cells) + " |"))
        rows.append(((n, c, system, 3), f"| {n} | {c} | {system} | samples | "
                     + " | ".join(str(len(found_at[k])) for k in range(positions + 1)) + " |"))
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
    parser.add_argument("--plot", type=Path, default=None, help="also draw the clock and power around the first token")
    parser.add_argument("--dip-below", type=float, default=None, metavar="MHZ",
                        help="also where in each request the SM clock fell below MHZ")
    args = parser.parse_args(argv)
    lines = table(args.folder, args.positions)
    if not lines:
        raise SystemExit(f"no point in {args.folder} has clock samples (bench_serve.sh with CLOCKS=1)")
    if args.dip_below is not None:
        lines += dip_table(args.folder, args.dip_below)
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    (args.folder / "clocks-table.md").write_text(text)
    if args.plot:
        plot(args.folder, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
