"""scripts/gpu/vllm/serve_clocks.py: nvidia-smi's readings placed in each request's prefill and decode gaps."""
from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "serve_clocks.py"


def load_script():
    spec = importlib.util.spec_from_file_location("serve_clocks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def write_point(folder: Path, stem: str, utc_offset_s: int, low_clock_gaps: set[int], gzipped: bool = False,
                repeat: int = 1) -> None:
    """Two requests on the monotonic clock (start 100.0 and 101.0 s; 0.5 s to the first token; three 40 ms gaps),
    polled every 10 ms from 99.905 s to 101.795 s, stamped in local time at UTC + `utc_offset_s`; the driver's
    reading is refreshed every `repeat` polls (the polls between repeat it) and takes the values at its refresh:
    inside gaps `low_clock_gaps` 1500 MHz and 500 W, elsewhere 1980 MHz and 300 W, the power's quarter watts
    alternating from one reading to the next."""
    wall0, mono0 = 1_765_000_000.0, 90.0  # read together
    (folder / f"{stem}.json").write_text(json.dumps(
        {"start_times": [100.0, 101.0], "ttfts": [0.5, 0.5], "itls": [[0.04, 0.04, 0.04], [0.04, 0.04, 0.04]]}))
    (folder / f"{stem}.clock0.json").write_text(json.dumps({"wall": wall0, "monotonic": mono0,
                                                             "utc_offset_s": utc_offset_s}))
    lines = []
    for i in range(190):
        mono = 99.905 + 0.01 * i  # never on an edge
        refreshed = 99.905 + 0.01 * (i - i % repeat)
        since_start = (refreshed - 100.0) % 1.0
        gap = 1 + int((since_start - 0.5) / 0.04) if 0.5 <= since_start < 0.62 else 0
        clock, power = (1500, 500) if gap in low_clock_gaps else (1980, 300)
        quarter = 0.25 * (1 + (i // repeat) % 2)
        local = datetime(1970, 1, 1) + timedelta(seconds=mono - mono0 + wall0 + utc_offset_s)
        lines.append(f"{local.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {clock}, 2619, {power + quarter}, 100, 40")
    lines.insert(50, "[GPU lost], , , , , ")  # a line nvidia-smi wrote otherwise
    text = "\n".join(lines) + "\n"
    if gzipped:
        with gzip.open(folder / f"{stem}.clocks.csv.gz", "wt") as out:
            out.write(text)
    else:
        (folder / f"{stem}.clocks.csv").write_text(text)


def test_readings_land_in_their_request_intervals_at_any_utc_offset(tmp_path):
    write_point(tmp_path, "standard-28672-c1", 0, set())
    write_point(tmp_path, "uniprefill-28672-c1", 3600, {1, 2}, gzipped=True)
    (tmp_path / "uniprefill-8192-c1.json").write_text(json.dumps({"start_times": [1.0], "ttfts": [0.1], "itls": [[]]}))
    done = run_script(tmp_path, "--positions", "4", "--group", "1")
    assert done.returncode == 0, done.stderr
    assert "no clock samples for: uniprefill-8192-c1" in done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 28672")]
    assert rows == [
        "| 28672 | 1 | standard | SM clock MHz | 1980 | 1980 | 1980 | 1980 | - |",
        "| 28672 | 1 | standard | power W | 300 | 300 | 300 | 300 | - |",
        "| 28672 | 1 | standard | readings | 100 | 8 | 8 | 8 | 0 |",
        "| 28672 | 1 | uniprefill | SM clock MHz | 1980 | 1500 | 1500 | 1980 | - |",
        "| 28672 | 1 | uniprefill | power W | 300 | 500 | 500 | 300 | - |",
        "| 28672 | 1 | uniprefill | readings | 100 | 8 | 8 | 8 | 0 |"]
    assert (tmp_path / "clocks-table.md").read_text() == done.stdout
    done = run_script(tmp_path, "--positions", "4", "--group", "2")  # gaps grouped: 1-2, 3-4
    assert "| 28672 | 1 | uniprefill | SM clock MHz | 1980 | 1500 | 1980 |" in done.stdout
    assert "| 28672 | 1 | uniprefill | readings | 100 | 16 | 8 |" in done.stdout
    done = run_script(tmp_path, "--positions", "1", "--dip-below", "1600")
    dips = [line for line in done.stdout.splitlines() if line.startswith("| 28672") and " of 2 |" in line]
    # uniprefill's low clock: gaps 1-2, read 505-575 ms after each start (its gap 2 under it, gap 3 not); standard's
    # none
    assert dips == ["| 28672 | 1 | standard | 500 | - | 0 of 2 | - (0) | 40.00 (4) | - |",
                    "| 28672 | 1 | uniprefill | 500 | 505 - 575 | 2 of 2 | 40.00 (2) | 40.00 (2) | - |"]
    module = load_script()
    found = {key: (run, samples) for key, run, samples in module.points(tmp_path)[0]}
    series = module.around_first_token(*found["uniprefill", 28672, 1], before_ms=20, after_ms=200, bin_ms=40)
    # up to each request's end (first token + 120 ms), not the 200 asked for
    assert [(b, clock, n) for b, clock, _, n in series] == [(-40.0, 1980, 4), (0.0, 1500, 8), (40.0, 1500, 8),
                                                            (80.0, 1980, 8)]
    pytest.importorskip("matplotlib")
    done = run_script(tmp_path, "--plot", tmp_path / "c.png")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_poll_repeating_the_last_reading_is_not_counted_again(tmp_path):
    """The driver refreshes its readings about every 100 ms and nvidia-smi's 10 ms polls repeat them: a reading
    counts once, when it first appears; `--every-poll` counts the polls."""
    write_point(tmp_path, "uniprefill-28672-c1", 0, {1, 2}, repeat=4)
    module = load_script()
    csv, clock0 = tmp_path / "uniprefill-28672-c1.clocks.csv", json.loads((tmp_path / "uniprefill-28672-c1.clock0.json").read_text())
    fresh, polls = module.read_samples(csv, clock0), module.read_samples(csv, clock0, every_poll=True)
    assert len(polls) == 190 and len(fresh) == 48  # 190 polls, one reading per 4 (the last one of 2)
    assert [round(t - 99.905, 3) for t, *_ in fresh[:3]] == [0.0, 0.04, 0.08]  # stamped when each first appears
    done = run_script(tmp_path, "--positions", "3", "--group", "3")
    # readings every 40 ms: 12 in each 500 ms prefill, 3 in each request's 120 ms of gaps
    assert "| 28672 | 1 | uniprefill | readings | 24 | 6 |" in done.stdout
    done = run_script(tmp_path, "--positions", "3", "--group", "3", "--every-poll")
    assert "| 28672 | 1 | uniprefill | readings | 100 | 24 |" in done.stdout
    lines = csv.read_text().splitlines()  # a column that changes at every poll (the temperature here) makes no
    csv.write_text("\n".join(f"{line[:-2]}{i % 7}" if line[0] != "[" else line for i, line in enumerate(lines)) + "\n")
    assert module.read_samples(csv, clock0) == fresh  # reading new: only the SM clock and the averaged power count


def test_a_header_names_the_columns_and_the_power_cap_share_is_read(tmp_path):
    """nvidia-smi's CSV with a header (bench_serve.sh's CLOCKS=1): the columns found by name, whatever their order,
    and the clock event reasons' SW power cap bit (0x4) counted per position; '[N/A]' reasons keep the reading."""
    write_point(tmp_path, "uniprefill-8192-c1", 0, {1})
    path = tmp_path / "uniprefill-8192-c1.clocks.csv"
    rows = []
    for line in path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if fields[1]:  # a poll: power first, the reasons 0x4 where the clock is low, one '[N/A]'
            reasons = "0x0000000000000004" if fields[1] == "1500" else "0x0000000000000000"
            reasons = "[N/A]" if len(rows) == 10 else reasons
            rows.append(f"{fields[0]}, {fields[3]}, {fields[1]}, {reasons}")
    path.write_text("timestamp, power.draw [W], clocks.current.sm [MHz], clocks_event_reasons.active\n"
                    + "\n".join(rows) + "\n")
    (tmp_path / "uniprefill-8192-c1.clock1.json").write_text(json.dumps(  # 20 ms of drift over the point
        {"wall": 1_765_000_000.0 + 60, "monotonic": 90.0 + 60.02, "utc_offset_s": 0}))
    done = run_script(tmp_path, "--positions", "3", "--group", "1")
    assert done.returncode == 0, done.stderr
    assert "the wall clock moved -20.0 ms" in done.stderr  # it fell 20 ms behind
    lines = [line for line in done.stdout.splitlines() if line.startswith("| 8192")]
    assert lines == ["| 8192 | 1 | uniprefill | SM clock MHz | 1980 | 1500 | 1980 | 1980 |",
                     "| 8192 | 1 | uniprefill | power W | 300 | 500 | 300 | 300 |",
                     "| 8192 | 1 | uniprefill | share under SW power cap | 0.00 | 1.00 | 0.00 | 0.00 |",
                     "| 8192 | 1 | uniprefill | readings | 100 | 8 | 8 | 8 |"]


def test_failed_requests_and_a_folder_without_samples(tmp_path):
    module = load_script()
    run = {"start_times": [5.0, 6.0, 7.0], "ttfts": [0.0, 0.5, None], "itls": [[], [0.1], []]}
    assert module.intervals(run, positions=3) == [(6.0, 6.5, 0), (6.5, 6.6, 1)]  # no token: no interval
    assert module.dip_table([(("standard", 8192, 1), {"start_times": [1.0], "ttfts": [0.0], "itls": [[]]}, [])],
                            1450)[-1] == "| 8192 | 1 | standard | - | no request produced a token | - | - | - | - |"
    nan = float("nan")
    samples = [(1.4, 1400.0, 600.0, nan), (1.518, 1900.0, 600.0, nan)]  # low, then high from 1.518 s
    run = {"start_times": [1.0, 2.0], "ttfts": [0.5, 0.5], "itls": [[0.01, 0.006, 0.008, 0.012], [0.01, 0.005]]}
    # request 1: gap 2 (1.510-1.516 s) under the low reading, gaps 3-4 under the high one; request 2's gap 2 lies
    # 1 s after the last reading: too old, left out
    split = module.gaps_by_reading(run, samples, 1450)
    assert split == {2: ([6.0], []), 3: ([], [8.0]), 4: ([], [12.0])}
    assert module.low_over_high(split) is None  # no position holds both
    split[3][0].append(10.0)
    assert module.low_over_high(split) == (1.25, 1, 1)  # position 3: 10 over 8
    (tmp_path / "standard-8192-c1.json").write_text(json.dumps({"ttfts": [0.5], "itls": [[0.1]]}))
    (tmp_path / "standard-8192-c1.clock0.json").write_text(json.dumps({"wall": 0.0, "monotonic": 0.0, "utc_offset_s": 0}))
    (tmp_path / "standard-8192-c1.clocks.csv").write_text("2026/12/07 17:00:00.000, 1500, 3201, 600, 100, 40\n")
    found, missing = module.points(tmp_path)
    assert not found and missing == ["standard-8192-c1 (no start_times: run without --save-detailed?)"]
    (tmp_path / "standard-8192-c1.json").write_text("{}")
    done = run_script(tmp_path)
    assert done.returncode != 0 and "CLOCKS=1" in done.stderr
