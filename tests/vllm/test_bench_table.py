"""scripts/gpu/vllm/bench_table.py, run as the bench script runs it: the ratio table of `vllm bench
throughput`'s JSON files, and a length with one system only is an error."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "bench_table.py"


def write(folder: Path, system: str, length: int, tokens_per_s: float) -> None:
    (folder / f"{system}-{length}.json").write_text(json.dumps(
        {"elapsed_time": 1.0, "num_requests": 16, "total_num_tokens": 16 * length,
         "requests_per_second": tokens_per_s / length, "tokens_per_second": tokens_per_s}))


def test_ratios_per_length_in_order(tmp_path):
    for length, std, ours in ((16384, 30000.0, 69000.0), (8192, 40000.0, 80000.0)):
        write(tmp_path, "standard", length, std)
        write(tmp_path, "uniprefill", length, ours)
    done = subprocess.run([sys.executable, "-P", str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 8") or line.startswith("| 1")]
    assert rows == ["| 8192 | 4.88 | 9.77 | 40,000 | 80,000 | **2.00x** |",
                    "| 16384 | 1.83 | 4.21 | 30,000 | 69,000 | **2.30x** |"]
    assert (tmp_path / "table.md").read_text() == done.stdout


def test_a_length_run_by_one_system_only_is_an_error(tmp_path):
    write(tmp_path, "standard", 8192, 1.0)
    done = subprocess.run([sys.executable, "-P", str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0 and "runs missing" in done.stderr and "'uniprefill', 8192" in done.stderr


SERVE_TABLE = SCRIPT.parent / "serve_table.py"


def write_serve(folder: Path, system: str, length: int, concurrency: int, duration: float, ttft: float,
                completed: int = 32) -> None:
    (folder / f"{system}-{length}-c{concurrency}.json").write_text(json.dumps(
        {"duration": duration, "completed": completed, "failed": 32 - completed,
         "total_input_tokens": completed * length,
         "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": 5.5, "p99_tpot_ms": 9.0, "p99_itl_ms": ttft / 2}))


def test_serve_table_pairs_points_and_refuses_a_lonely_one(tmp_path):
    write_serve(tmp_path, "standard", 8192, 4, 10.0, 300.0)
    write_serve(tmp_path, "uniprefill", 8192, 4, 5.0, 140.0)
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 8192"))
    assert "26,214 -> 52,429" in row and "**2.00x**" in row and "300.0 -> 140.0" in row and "600.0 -> 280.0" in row
    assert (tmp_path / "serve-table.md").read_text() == done.stdout
    write_serve(tmp_path, "uniprefill-chunked", 8192, 4, 8.0, 250.0)  # a third system: one row per system
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 8192")]
    assert [row.split(" | ")[2] for row in rows] == ["uniprefill", "uniprefill-chunked"]
    assert "**1.25x**" in rows[1] and "9.0 -> 9.0" in rows[1] and "150.0 -> 125.0" in rows[1]  # the gap's p99
    write_serve(tmp_path, "standard-onestep", 8192, 4, 10.0, 320.0)  # standard with the one-step budget: first
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 8192")]
    assert [row.split(" | ")[2] for row in rows] == ["standard-onestep", "uniprefill", "uniprefill-chunked"]
    assert "**1.00x**" in rows[0] and "300.0 -> 320.0" in rows[0]
    (tmp_path / "standard-onestep-8192-c4.json").unlink()
    pytest.importorskip("matplotlib")
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path), "--plot", str(tmp_path / "s.png")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_serve(tmp_path, "standard", 32000, 1, 10.0, 300.0)
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0 and "('uniprefill', 32000, 1)" in done.stderr


def test_serve_table_shows_a_point_where_every_request_failed(tmp_path):
    """vLLM rejects prompts over its character bound before they run (the 32000-token point of 2026-12-04): such
    a point has 0 tokens in ~0.1 s; the table names the failures instead of dividing by zero."""
    write_serve(tmp_path, "standard", 8192, 1, 10.0, 300.0)
    write_serve(tmp_path, "uniprefill", 8192, 1, 5.0, 140.0)
    write_serve(tmp_path, "standard", 32000, 1, 0.1, 0.0, completed=0)
    write_serve(tmp_path, "uniprefill", 32000, 1, 0.1, 0.0, completed=0)
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 32000"))
    assert "no completed request" in row and "32 / 32" in row and "x**" not in row
    assert "**2.00x**" in next(line for line in done.stdout.splitlines() if line.startswith("| 8192"))


def test_serve_table_reads_the_retention_of_each_point_from_the_drop_totals(tmp_path):
    """bench_serve.sh reads the server's drop totals before and after a uniprefill point; the retention is the rows
    kept over the rows in between them, summed over the worker's runtimes; a point without totals, or whose endpoint
    answered with why not, shows "-"."""
    for length in (8192, 16384, 28672):
        write_serve(tmp_path, "standard", length, 4, 10.0, 300.0)
        write_serve(tmp_path, "uniprefill", length, 4, 5.0, 140.0)

    def totals(rows_in, rows_kept):  # one worker, two runtimes (compiled graphs)
        return [[{"rows_in": rows_in, "rows_kept": rows_kept}, {"rows_in": 0, "rows_kept": 0}]]

    (tmp_path / "uniprefill-8192-c4.totals").write_text(json.dumps(
        {"before": totals(1000, 900), "after": totals(1000 + 32 * 8192, 900 + 26_000 * 8)}))
    (tmp_path / "uniprefill-16384-c4.totals").write_text(json.dumps(
        {"before": "unavailable: ConnectionRefusedError", "after": totals(1, 1)}))
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = {int(line.split(" | ")[0][2:]): line for line in done.stdout.splitlines() if line.startswith("| ")
            and line[2].isdigit()}
    assert rows[8192].rstrip(" |").endswith(f"{26_000 * 8 / (32 * 8192):.3f}")
    assert rows[16384].endswith("| - |") and rows[28672].endswith("| - |")


def test_serve_table_splits_the_first_decode_gap_from_the_later_ones(tmp_path):
    """With `--save-detailed` the files hold each request's inter-token gaps (s); the second table gives the median
    and the largest first gap after the first token, and the median and p99 of the later gaps (ms), so that one slow
    step after a drop is told from a slower decode. Files without the gaps (older runs) add no second table."""
    write_serve(tmp_path, "standard", 8192, 1, 10.0, 300.0)
    write_serve(tmp_path, "uniprefill", 8192, 1, 9.0, 280.0)
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "first gap" not in done.stdout

    for system, first in (("standard", 0.0055), ("uniprefill", 0.0140)):
        path = tmp_path / f"{system}-8192-c1.json"
        run = json.loads(path.read_text())
        run["itls"] = [[first + 0.0001 * r] + [0.0050 + 0.0001 * (k % 3) for k in range(15)] for r in range(32)]
        run["itls"][5] = []  # a request that ended at its first token has no gap
        path.write_text(json.dumps(run))
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = {line.split(" | ")[2]: line for line in done.stdout.splitlines() if line.startswith("| 8192 | 1 |")
            and line.count("|") == 8}
    # 31 requests with gaps: first gaps first + 0.1 ms x {0..4, 6..31}, their median the 16th (r = 16)
    assert rows["standard"] == "| 8192 | 1 | standard | 7.10 | 8.60 | 5.10 | 5.20 |"
    assert rows["uniprefill"] == "| 8192 | 1 | uniprefill | 15.60 | 17.10 | 5.10 | 5.20 |"


def test_serve_table_reads_the_gaps_by_position(tmp_path):
    """The third table: standard's median gap at each position after the first token, and the system's over it; a
    decode that is slower for a few steps after a drop and then recovers shows as ratios falling back to 1 (the
    pattern of runs aa and ac). Each position's median is over the requests that reached it (a short request does
    not cut the table), a true median; a second system at the point adds its row under one row of standard's. A
    point without standard's gaps adds no row."""
    write_serve(tmp_path, "standard", 8192, 1, 10.0, 300.0)
    write_serve(tmp_path, "uniprefill", 8192, 1, 9.0, 280.0)
    write_serve(tmp_path, "uniprefill-chunked", 8192, 1, 9.5, 290.0)
    for system, slow in (("standard", [1.0] * 4), ("uniprefill", [1.2, 1.1, 1.0, 1.0]),
                         ("uniprefill-chunked", [1.0, 1.0, 1.0, 1.0])):
        path = tmp_path / f"{system}-8192-c1.json"
        run = json.loads(path.read_text())
        run["itls"] = [[0.004] + [0.0075 * s for s in slow] for _ in range(8)] + [[0.004, 0.0075]]  # one short request
        path.write_text(json.dumps(run))
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "| median gap at position | 1 | 2 | 3 | 4 | 5 |\n|---|---|---|---|---|---|---|---|" in done.stdout
    assert done.stdout.count("| 8192 | 1 | standard, ms | 4.00 | 7.50 | 7.50 | 7.50 | 7.50 |") == 1
    assert "| 8192 | 1 | uniprefill / standard | 1.000 | 1.200 | 1.100 | 1.000 | 1.000 |" in done.stdout
    assert "| 8192 | 1 | uniprefill-chunked / standard | 1.000 | 1.000 | 1.000 | 1.000 | 1.000 |" in done.stdout
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path), "--position-baseline",
                           "uniprefill-chunked"], capture_output=True, text=True)  # over another system's gaps too
    assert done.returncode == 0, done.stderr
    assert "| 8192 | 1 | uniprefill-chunked, ms | 4.00 | 7.50 | 7.50 | 7.50 | 7.50 |" in done.stdout
    assert "| 8192 | 1 | uniprefill / uniprefill-chunked | 1.000 | 1.200 | 1.100 | 1.000 | 1.000 |" in done.stdout
    assert "| 8192 | 1 | standard / uniprefill-chunked | 1.000 | 1.000 | 1.000 | 1.000 | 1.000 |" in done.stdout
    assert "| 8192 | 1 | uniprefill / standard | 1.000 | 1.200 |" in done.stdout  # the standard table stays
    path = tmp_path / "uniprefill-8192-c1.json"  # an even count: the mean of the middle two, not the upper one
    run = json.loads(path.read_text())
    run["itls"] = [[0.004, 0.009]] * 5 + [[0.005, 0.009]] * 5
    path.write_text(json.dumps(run))
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    assert "| 8192 | 1 | uniprefill / standard | 1.125 | 1.200 |" in done.stdout  # (4 + 5) / 2 over 4 ms
    for path in tmp_path.glob("standard-*.json"):
        run = json.loads(path.read_text())
        run.pop("itls")
        path.write_text(json.dumps(run))
    done = subprocess.run([sys.executable, "-P", str(SERVE_TABLE), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0 and "median gap at position" not in done.stdout
