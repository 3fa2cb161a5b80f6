"""benchmarks/vllm_side_by_side.py, run as a user runs it: pairs two smoke_llm.py runs point by
point, refuses grids that differ, and reads the drop totals."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_side_by_side.py"


def run(points, drop_totals=None):
    out = {"throughput": {"points": [
        {"length": length, "batch": batch, "tokens_per_s": tps,
         **({"decode": {"available": True, "ms_per_token_median": ms}} if ms is not None else {})}
        for length, batch, tps, ms in points]}}
    if drop_totals is not None:
        out["drop_totals"] = drop_totals
    return out


def table(tmp_path, standard: dict, ours: dict, *extra: str) -> subprocess.CompletedProcess:
    paths = [tmp_path / "standard.json", tmp_path / "uniprefill.json"]
    for path, data in zip(paths, (standard, ours)):
        path.write_text(json.dumps(data))
    return subprocess.run([sys.executable, "-P", str(SCRIPT), *map(str, paths), *extra], capture_output=True,
                          text=True)


def test_rows_pair_points_and_give_the_ratio_and_decode(tmp_path):
    standard = run([(16384, 4, 100.0, 20.0), (16384, 1, 50.0, 5.0)])
    ours = run([(16384, 1, 120.0, 4.0), (16384, 4, 230.0, 9.0)])
    done = table(tmp_path, standard, ours, "--plot", str(tmp_path / "ratio.png"))
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 16384 |")]
    assert rows == ["| 16384 | 1 | 50 | 120 | **2.40x** | 5.0 | 4.0 |", "| 16384 | 4 | 100 | 230 | **2.30x** | 20.0 | 9.0 |"]
    assert (tmp_path / "ratio.png").stat().st_size > 1000


def test_grids_that_differ_are_an_error_not_a_shorter_table(tmp_path):
    standard, ours = run([(8192, 1, 1.0, None), (8192, 4, 1.0, None)]), run([(8192, 1, 2.0, None)])
    done = table(tmp_path, standard, ours)
    assert done.returncode == 2 and "different points" in done.stderr and r"standard only [(8192, 4)]" in done.stderr
    done = table(tmp_path, {"throughput": None}, ours)
    assert done.returncode == 2 and "no throughput points" in done.stderr


def test_decode_columns_only_when_both_runs_timed_decode(tmp_path):
    done = table(tmp_path, run([(8192, 1, 1.0, 5.0)]), run([(8192, 1, 2.0, None)]))
    assert done.returncode == 0 and "decode" not in done.stdout.split("\n\n")[0]


def test_retention_sums_the_first_workers_graphs(tmp_path):
    graph = {"requests_dropped": 3, "rows_in": 1000, "rows_kept": 300, "kv_entries_prompt": 32000,
             "kv_entries_written": 15200}
    other = {"requests_dropped": 1, "rows_in": 1000, "rows_kept": 500, "kv_entries_prompt": 8000,
             "kv_entries_written": 4800}
    points = [(8192, 1, 1.0, None)]
    done = table(tmp_path, run(points), run(points, [[graph, other], [graph]]))  # the second worker is not added in
    totals = next(line for line in done.stdout.splitlines() if line.startswith("uniprefill drop totals"))
    assert "requests_dropped 4" in totals and "rows_kept_share 0.400" in totals
    assert f"kv_written_share {(15200 + 4800) / (32000 + 8000):.3f}" in totals
    for totals in (None, "unavailable: TimeoutError"):
        assert "drop totals" not in table(tmp_path, run(points), run(points, totals)).stdout
