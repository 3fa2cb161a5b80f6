"""scripts/gpu/vllm/serve_clocks.py: nvidia-smi's samples placed in each request's prefill and decode gaps."""
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


def write_point(folder: Path, stem: str, utc_offset_s: int, low_clock_gaps: set[int], gzipped: bool) -> None:
    """Two requests on the monotonic clock (start 100.0 and 101.0 s; 0.5 s to the first token; three 40 ms gaps),
    sampled every 10 ms from 99.9 s to 101.8 s, stamped in local time at UTC + `utc_offset_s`; samples inside gaps
    `low_clock_gaps` read 1500 MHz and 500 W, the others 1980 MHz and 300 W."""
    wall0, mono0 = 1_765_000_000.0, 90.0  # read together
    (folder / f"{stem}.json").write_text(json.dumps(
        {"start_times": [100.0, 101.0], "ttfts": [0.5, 0.5], "itls": [[0.04, 0.04, 0.04], [0.04, 0.04, 0.04]]}))
    (folder / f"{stem}.clock0.json").write_text(json.dumps({"wall": wall0, "monotonic": mono0,
                                                             "utc_offset_s": utc_offset_s}))
    lines = []
    for i in range(190):
        mono = 99.905 + 0.01 * i  # never on an edge
        since_start = (mono - 100.0) % 1.0
        gap = 1 + int((since_start - 0.5) / 0.04) if 0.5 <= since_start < 0.62 else 0
        clock, power = (1500, 500) if gap in low_clock_gaps else (1980, 300)
        local = datetime(1970, 1, 1) + timedelta(seconds=mono - mono0 + wall0 + utc_offset_s)
        lines.append(f"{local.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {clock}, 2619, {power}.25, 100, 40")
    lines.insert(50, "[GPU lost], , , , , ")  # a line nvidia-smi wrote otherwise
    text = "\n".join(lines) + "\n"
    if gzipped:
        with gzip.open(folder / f"{stem}.clocks.csv.gz", "wt") as out:
            out.write(text)
    else:
        (folder / f"{stem}.clocks.csv").write_text(text)


def test_samples_land_in_their_request_intervals_at_any_utc_offset(tmp_path):
    write_point(tmp_path, "standard-28672-c1", 0, set(), gzipped=False)
    write_point(tmp_path, "uniprefill-28672-c1", 3600, {1, 2}, gzipped=True)
    (tmp_path / "uniprefill-8192-c1.json").write_text(json.dumps({"start_times": [1.0], "ttfts": [0.1], "itls": [[]]}))
    done = subprocess.run([sys.executable, "-P", str(SCRIPT), str(tmp_path), "--positions", "4"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "no clock samples for: uniprefill-8192-c1" in done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 28672")]
    assert rows == [
        "| 28672 | 1 | standard | SM clock MHz | 1980 | 1980 | 1980 | 1980 | - |",
        "| 28672 | 1 | standard | power W | 300 | 300 | 300 | 300 | - |",
        "| 28672 | 1 | standard | samples | 100 | 8 | 8 | 8 | 0 |",
        "| 28672 | 1 | uniprefill | SM clock MHz | 1980 | 1500 | 1500 | 1980 | - |",
        "| 28672 | 1 | uniprefill | power W | 300 | 500 | 500 | 300 | - |",
        "| 28672 | 1 | uniprefill | samples | 100 | 8 | 8 | 8 | 0 |"]
    assert (tmp_path / "clocks-table.md").read_text() == done.stdout
    done = subprocess.run([sys.executable, "-P", str(SCRIPT), str(tmp_path), "--positions", "1", "--dip-below", "1600"],
                          capture_output=True, text=True)
    dips = [line for line in done.stdout.splitlines() if line.startswith("| 28672") and " MHz " not in line
            and "samples" not in line and "power" not in line]
    # uniprefill's low clock: gaps 1-2, 505-575 ms after each start (samples at xx.905 s); standard has none
    assert dips == ["| 28672 | 1 | standard | 500 | - | 0 of 2 |", "| 28672 | 1 | uniprefill | 500 | 505 - 575 | 2 of 2 |"]
    module = load_script()
    found = dict((key, (run, samples)) for key, run, samples in module.points(tmp_path)[0])
    series = module.around_first_token(*found["uniprefill", 28672, 1], before_ms=20, after_ms=90, bin_ms=40)
    assert [(b, clock, n) for b, clock, _, n in series] == [(-40.0, 1980, 4), (0.0, 1500, 8), (40.0, 1500, 8), (80.0, 1980, 2)]
    pytest.importorskip("matplotlib")
    done = subprocess.run([sys.executable, "-P", str(SCRIPT), str(tmp_path), "--plot", str(tmp_path / "c.png")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_request_and_a_folder_without_samples(tmp_path):
    module = load_script()
    spans = module.intervals({"start_times": [5.0, 6.0], "ttfts": [0.0, 0.5], "itls": [[], [0.1]]}, positions=3)
    assert spans == [(6.0, 6.5, 0), (6.5, 6.6, 1)]  # the failed request (no first token) has none
    (tmp_path / "standard-8192-c1.json").write_text("{}")
    done = subprocess.run([sys.executable, "-P", str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0 and "CLOCKS=1" in done.stderr


def test_a_header_names_the_columns_and_the_power_cap_share_is_read(tmp_path):
    """nvidia-smi's CSV with a header (bench_serve.sh's CLOCKS=1): the columns found by name, whatever their order,
    and the clock event reasons' SW power cap bit (0x4) counted per position; '[N/A]' reasons keep the sample."""
    write_point(tmp_path, "uniprefill-8192-c1", 0, {1}, gzipped=False)
    path = tmp_path / "uniprefill-8192-c1.clocks.csv"
    rows = []
    for line in path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if fields[1]:  # a sample: power first, the reasons 0x4 where the clock is low, one '[N/A]'
            reasons = "0x0000000000000004" if fields[1] == "1500" else "0x0000000000000000"
            reasons = "[N/A]" if len(rows) == 10 else reasons
            rows.append(f"{fields[0]}, {fields[3]}, {fields[1]}, {reasons}")
    path.write_text("timestamp, power.draw [W], clocks.current.sm [MHz], clocks_event_reasons.active\n"
                    + "\n".join(rows) + "\n")
    done = subprocess.run([sys.executable, "-P", str(SCRIPT), str(tmp_path), "--positions", "3"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("| 8192")]
    assert lines == ["| 8192 | 1 | uniprefill | SM clock MHz | 1980 | 1500 | 1980 | 1980 |",
                     "| 8192 | 1 | uniprefill | power W | 300 | 500 | 300 | 300 |",
                     "| 8192 | 1 | uniprefill | share under SW power cap | 0.00 | 1.00 | 0.00 | 0.00 |",
                     "| 8192 | 1 | uniprefill | samples | 100 | 8 | 8 | 8 |"]
