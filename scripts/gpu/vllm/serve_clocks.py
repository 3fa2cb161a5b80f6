"""The GPU's clocks and power in each request's prefill and decode gaps, from a `bench_serve.sh` run with CLOCKS=1.

    python3 scripts/gpu/vllm/serve_clocks.py OUT_DIR [--dip-below MHZ] [--plot PNG]

For each point file `SYSTEM-L-cC.json` (`vllm bench serve --save-detailed`: each request's start on the client's
monotonic clock, its time to the first token and its inter-token gaps) beside `SYSTEM-L-cC.clocks.csv[.gz]`
(nvidia-smi polled every 10 ms: wall-clock timestamp, SM clock MHz, memory clock MHz, power W, ..., with a header
naming the columns) and `SYSTEM-L-cC.clock0.json` (the host's wall clock and monotonic clock read together, and the
host's offset from UTC, which nvidia-smi's local timestamps need; `.clock1.json`, read after the point, checks the
two clocks did not drift apart).

**Readings, not polls.** The driver refreshes these values about every 100 ms (measured on the H200 of run ad:
the polls repeat a reading nine times in ten), so only a poll whose values differ from the one before counts: a
fresh reading, stamped when it first appears (within 10 ms of the refresh). `--every-poll` counts every poll, as
the first tables of run ad did. A reading stands for about 100 ms: it cannot place a change inside one decode
gap (about 6 ms), only inside a stretch of them.

Per point and system: the median SM clock and power over the readings in the prefill (start to first token) and
in each group of `--group` gaps (gap k: token k to token k + 1), with their count, and where the CSV holds
nvidia-smi's clock event reasons (`clocks_event_reasons.active`, a bit mask), the share of readings whose clock the
software power cap was holding down.
`--dip-below MHZ` adds where in each request the SM clock read below MHZ (from half the request's time to its first
token to 150 ms after it, at most its end): the median first and last such reading from the request's start,
beside its time to the first token, which tells a dip tied to the prefill's start from one tied to its end; and the
median gap after the first whose latest reading (before the gap's middle, at most 150 ms old) is under MHZ, against
the others', pooled and position by position (the early gaps differ anyway): whether the gaps under a low clock are
longer.
`--plot PNG` draws the readings against time from each request's first token (median per 20 ms over the requests,
each request's readings up to its end): SM clock and power per system and point.

Prints Markdown and writes OUT_DIR/clocks-table.md; a point without samples is left out and named on stderr.
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
DRIFT_WARN_S = 0.005


def _columns(header: list[str]) -> dict[str, int]:
    """Column index of the SM clock, the averaged power (which refreshes with the clock), the power shown (the
    instant power where sampled) and the clock event reasons in nvidia-smi's CSV header (names with units)."""
    names = [h.split("[")[0].strip() for h in header]
    where = {"sm": names.index("clocks.current.sm") if "clocks.current.sm" in names else 1,
             "average": names.index("power.draw") if "power.draw" in names else 3}
    where["power"] = names.index("power.draw.instant") if "power.draw.instant" in names else where["average"]
    reasons = [i for i, name in enumerate(names) if name.endswith("reasons.active")]
    if reasons:
        where["reasons"] = reasons[0]
    return where


def read_samples(csv_path: Path, clock0: dict, every_poll: bool = False) -> list[tuple[float, float, float, float]]:
    """(monotonic seconds, SM clock MHz, power W, SW power cap 1.0 / 0.0 or nan where not sampled) per fresh
    reading (every poll with `every_poll`), in time order; the columns found by the CSV's header where it has one
    (else timestamp, SM clock, memory clock, power); lines nvidia-smi wrote otherwise (an error, a '[N/A]') are
    skipped."""
    opener = gzip.open if csv_path.suffix == ".gz" else open
    shift = clock0["monotonic"] - clock0["wall"] - clock0["utc_offset_s"]  # local-as-UTC epoch -> monotonic
    samples, where, previous = [], {"sm": 1, "average": 3, "power": 3}, None
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
            reading = (fields[where["sm"]], fields[where["average"]])
            if not every_poll and reading == previous:
                continue  # the driver's last reading again (a column that changes on its own, such as the
            previous = reading  # instant power or the temperature, does not make it new)
            try:
                capped = float(bool(int(fields[where["reasons"]], 16) & SW_POWER_CAP))
            except (KeyError, ValueError):  # not sampled, or '[N/A]'
                capped = math.nan
            samples.append((*sample, capped))
    return sorted(samples)


DETAILED = ("start_times", "ttfts", "itls")  # what `vllm bench serve --save-detailed` adds per request


def requests(run: dict) -> list[tuple[float, float, list[float]]]:
    """(start, time to the first token, gaps) of every request that produced a token, seconds (lists of unequal
    length, a malformed result file, raise)."""
    return [(start, ttft, list(gaps or [])) for start, ttft, gaps in
            zip(*(run.get(key) or [] for key in DETAILED), strict=True) if ttft]


def intervals(run: dict, positions: int) -> list[tuple[float, float, int]]:
    """(start, end, position) of every request's prefill (position 0) and first `positions` gaps, monotonic s."""
    spans = []
    for start, ttft, gaps in requests(run):
        spans.append((start, start + ttft, 0))
        edge = start + ttft
        for k, gap in enumerate(gaps[:positions], 1):
            spans.append((edge, edge + gap, k))
            edge += gap
    return spans


def by_position(run: dict, samples: list[tuple], positions: int = 15) -> list[list[tuple]]:
    """Per position 0..`positions`: the (SM clock, power, SW power cap) of the samples inside that position's
    intervals."""
    found: list[list[tuple]] = [[] for _ in range(positions + 1)]
    times = [sample[0] for sample in samples]
    for start, end, k in sorted(intervals(run, positions)):
        for i in range(bisect.bisect_left(times, start), bisect.bisect_left(times, end)):
            found[k].append(samples[i][1:])
    return found


def around_first_token(run: dict, samples: list[tuple], before_ms: float = 1200.0,
                       after_ms: float = 150.0, bin_ms: float = 10.0) -> list[tuple[float, float, float, int]]:
    """(bin start ms from the first token, median SM clock, median power, samples) per `bin_ms` bin from
    -`before_ms` to `after_ms` (at most each request's end: later readings belong to the next request), over every
    request's first token; bins without samples are left out."""
    bins: dict[int, list[tuple]] = {}
    times = [sample[0] for sample in samples]
    for start, ttft, gaps in requests(run):
        first = start + ttft
        end = min(first + after_ms / 1e3, first + sum(gaps))
        for i in range(bisect.bisect_left(times, first - before_ms / 1e3), bisect.bisect_left(times, end)):
            bins.setdefault(int((samples[i][0] - first) * 1e3 // bin_ms), []).append(samples[i][1:])
    return [(k * bin_ms, statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), len(v))
            for k, v in sorted(bins.items())]


def points(folder: Path, every_poll: bool = False) -> tuple[list[tuple[tuple[str, int, int], dict, list]], list[str]]:
    """((system, length, concurrency), the point's result, its samples) per point with samples, and the points
    without."""
    found, missing = [], []
    for path in sorted(folder.glob("*.json")):
        match = POINT.fullmatch(path.name)
        if not match:
            continue
        stem = path.name[:-len(".json")]
        csv = next((p for p in (folder / f"{stem}.clocks.csv.gz", folder / f"{stem}.clocks.csv") if p.exists()), None)
        clock0, clock1 = folder / f"{stem}.clock0.json", folder / f"{stem}.clock1.json"
        if csv is None or not clock0.exists():
            missing.append(f"{stem} (no clock files)")
            continue
        run = json.loads(path.read_text())
        absent = [key for key in DETAILED if not run.get(key)]
        if absent:
            missing.append(f"{stem} (no {', '.join(absent)}: run without --save-detailed?)")
            continue
        before = json.loads(clock0.read_text())
        samples = read_samples(csv, before, every_poll)
        if not samples:
            missing.append(f"{stem} (no readings in {csv.name})")
            continue
        if clock1.exists():
            after = json.loads(clock1.read_text())
            moved = (after["wall"] - before["wall"]) - (after["monotonic"] - before["monotonic"])
            if abs(moved) > DRIFT_WARN_S:
                print(f"{stem}: the wall clock moved {moved * 1e3:+.1f} ms against the monotonic one over the point "
                      "(readings placed by the clocks read before it)", file=sys.stderr)
        key = (match.group(1), int(match.group(2)), int(match.group(3)))
        found.append((key, run, samples))
    return found, missing


def table(found: list, positions: int = 15, group: int = 5) -> list[str]:
    groups = [(0, 0)] + [(k, min(k + group - 1, positions)) for k in range(1, positions + 1, group)]
    heads = ["prefill"] + [f"gap {a}" if a == b else f"gaps {a}-{b}" for a, b in groups[1:]]
    rows = []
    for (system, n, c), run, samples in found:
        at = by_position(run, samples, positions)
        merged = [[x for k in range(a, b + 1) for x in at[k]] for a, b in groups]
        for name, index in (("SM clock MHz", 0), ("power W", 1)):
            cells = [f"{statistics.median(x[index] for x in m):.0f}" if m else "-" for m in merged]
            rows.append(((n, c, system, index), f"| {n} | {c} | {system} | {name} | " + " | ".join(cells) + " |"))
        if any(not math.isnan(sample[3]) for sample in samples):  # the clock event reasons were sampled
            read = [[x[2] for x in m if not math.isnan(x[2])] for m in merged]
            cells = [f"{statistics.mean(shares):.2f}" if shares else "-" for shares in read]
            rows.append(((n, c, system, 2), f"| {n} | {c} | {system} | share under SW power cap | "
                         + " | ".join(cells) + " |"))
        rows.append(((n, c, system, 3), f"| {n} | {c} | {system} | readings | "
                     + " | ".join(str(len(m)) for m in merged) + " |"))
    if not rows:
        return []
    return ["| prompt tokens | concurrency | system | median of | " + " | ".join(heads) + " |",
            "|---|---|---|---|" + "---|" * len(heads), *(line for _, line in sorted(rows))]


def gaps_by_reading(run: dict, samples: list[tuple], below_mhz: float,
                    max_age_s: float = 0.15) -> dict[int, tuple[list[float], list[float]]]:
    """Per position k >= 2 (the first gap also holds the first token's own output work): the gaps (ms) whose latest
    reading before their middle, at most `max_age_s` old, shows an SM clock under `below_mhz`, and those whose
    reading shows one at or above it. Per position, because the early gaps differ from the later ones anyway and
    the low readings fall on early gaps."""
    times, split = [sample[0] for sample in samples], {}
    for start, ttft, gaps in requests(run):
        edge = start + ttft + (gaps[0] if gaps else 0.0)
        for k, gap in enumerate(gaps[1:], 2):
            middle = edge + gap / 2
            i = bisect.bisect_right(times, middle) - 1
            if i >= 0 and middle - times[i] <= max_age_s:
                split.setdefault(k, ([], []))[0 if samples[i][1] < below_mhz else 1].append(gap * 1e3)
            edge += gap
    return split


def low_over_high(split: dict[int, tuple[list[float], list[float]]]) -> tuple[float, int, int] | None:
    """The median over positions holding both kinds of each position's median gap under a low reading over its
    median gap under the others; with the number of such positions and of the gaps in them under a low reading."""
    both = {k: pair for k, pair in split.items() if pair[0] and pair[1]}
    if not both:
        return None
    ratios = [statistics.median(low) / statistics.median(high) for low, high in both.values()]
    return statistics.median(ratios), len(both), sum(len(low) for low, _ in both.values())


def dip_table(found: list, below_mhz: float) -> list[str]:
    """Per point: TTFT p50, the median first / last reading under `below_mhz` from each request's start, and the
    median gap after the first under such a reading and under the others."""
    lines = []

    def median_of(gaps: list[float]) -> str:
        return f"{statistics.median(gaps):.2f} ({len(gaps)})" if gaps else "- (0)"

    for (system, n, c), run, samples in found:
        first, last, done = [], [], requests(run)
        for start, ttft, gaps in done:
            end = start + ttft + min(0.15, sum(gaps))
            low = [t - start for t, clock, *_ in samples if start + ttft / 2 <= t <= end and clock < below_mhz]
            if low:
                first.append(low[0] * 1e3)
                last.append(low[-1] * 1e3)
        if not done:
            lines.append(f"| {n} | {c} | {system} | - | no request produced a token | - | - | - | - |")
            continue
        stretch = f"{statistics.median(first):.0f} - {statistics.median(last):.0f}" if first else "-"
        split = gaps_by_reading(run, samples, below_mhz)
        low = [g for pair in split.values() for g in pair[0]]
        high = [g for pair in split.values() for g in pair[1]]
        within = low_over_high(split)
        within_text = f"{within[0]:.3f} ({within[1]} positions, {within[2]} gaps)" if within else "-"
        lines.append(f"| {n} | {c} | {system} | {statistics.median(t * 1e3 for _, t, _ in done):.0f} | {stretch} | "
                     f"{len(first)} of {len(done)} | {median_of(low)} | {median_of(high)} | {within_text} |")
    return ["", f"| prompt tokens | concurrency | system | TTFT p50 ms | SM clock under {below_mhz:.0f} MHz, ms from the "
            "request's start (medians of first - last reading) | requests with such readings | gaps 2+ under such a "
            "reading: median ms (count) | gaps 2+ under the others | under such a reading over the others at the same "
            "position: median ratio |",
            "|---|---|---|---|---|---|---|---|---|", *lines]


def plot(found: list, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for (system, n, c), run, samples in found:
        series = around_first_token(run, samples, bin_ms=20.0)
        label = f"{system} {n} x {c}"
        top.plot([b for b, *_ in series], [x for _, x, _, _ in series], label=label, lw=1.2)
        bottom.plot([b for b, *_ in series], [w for _, _, w, _ in series], label=label, lw=1.2)
    for ax in (top, bottom):
        ax.axvline(0, color="black", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    top.set_ylabel("SM clock, MHz (median)")
    bottom.set_ylabel("power, W (median)")
    bottom.set_xlabel("ms from each request's first token (the prefill ends just before it; its decode after, to its end)")
    top.set_title(f"{title}: nvidia-smi's readings (refreshed about every 100 ms) around the end of each prefill")
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--positions", type=int, default=15, help="gaps after the first token shown (default 15)")
    parser.add_argument("--group", type=int, default=5, help="gaps per column (default 5: a reading spans ~16 gaps)")
    parser.add_argument("--every-poll", action="store_true", help="count every poll, not only fresh readings")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the clock and power around the first token")
    parser.add_argument("--dip-below", type=float, default=None, metavar="MHZ",
                        help="also where in each request the SM clock read below MHZ")
    args = parser.parse_args(argv)
    found, missing = points(args.folder, args.every_poll)
    if missing:
        print(f"no clock samples for: {', '.join(missing)}", file=sys.stderr)
    lines = table(found, args.positions, args.group)
    if not lines:
        raise SystemExit(f"no point in {args.folder} has clock samples (bench_serve.sh with CLOCKS=1)")
    if args.dip_below is not None:
        lines += dip_table(found, args.dip_below)
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    (args.folder / "clocks-table.md").write_text(text)
    if args.plot:
        plot(found, args.folder.name, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
