"""benchmarks/vllm_side_by_side.py: pairs two smoke_llm.py runs point by point, refuses grids
that differ, and reads the drop totals."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_side_by_side.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("vllm_side_by_side", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(points, drop_totals=None):
    out = {"throughput": {"points": [
        {"length": length, "batch": batch, "tokens_per_s": tps,
         **({"decode": {"available": True, "ms_per_token_median": ms}} if ms is not None else {})}
        for length, batch, tps, ms in points]}}
    if drop_totals is not None:
        out["drop_totals"] = drop_totals
    return out


def test_rows_pair_points_and_give_the_ratio_and_decode(table):
    standard = run([(16384, 4, 100.0, 20.0), (16384, 1, 50.0, 5.0)])
    ours = run([(16384, 1, 120.0, 4.0), (16384, 4, 230.0, 9.0)])
    rows = table.side_by_side_rows(standard, ours)
    assert [(r["length"], r["batch"]) for r in rows] == [(16384, 1), (16384, 4)]
    assert [r["ratio"] for r in rows] == [2.4, 2.3]
    assert (rows[1]["standard_decode_ms"], rows[1]["uniprefill_decode_ms"]) == (20.0, 9.0)
    text = table.markdown(rows)
    assert "| 16384 | 1 | 50 | 120 | **2.40x** | 5.0 | 4.0 |" in text


def test_grids_that_differ_are_an_error_not_a_shorter_table(table, tmp_path, capsys):
    standard, ours = run([(8192, 1, 1.0, None), (8192, 4, 1.0, None)]), run([(8192, 1, 2.0, None)])
    with pytest.raises(ValueError, match=r"standard only \[\(8192, 4\)\]"):
        table.side_by_side_rows(standard, ours)
    with pytest.raises(ValueError, match="no throughput points"):
        table.side_by_side_rows({"throughput": None}, ours)
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, data in zip(paths, (standard, ours)):
        path.write_text(json.dumps(data))
    assert table.main([str(p) for p in paths]) == 2
    assert "different points" in capsys.readouterr().err


def test_decode_columns_only_when_both_runs_timed_decode(table):
    rows = table.side_by_side_rows(run([(8192, 1, 1.0, 5.0)]), run([(8192, 1, 2.0, None)]))
    assert "decode" not in table.markdown(rows)


def test_retention_sums_the_first_workers_graphs(table):
    graph = {"requests_dropped": 3, "rows_in": 1000, "rows_kept": 300, "kv_entries_prompt": 32000,
             "kv_entries_written": 15200}
    other = {"requests_dropped": 1, "rows_in": 1000, "rows_kept": 500, "kv_entries_prompt": 8000,
             "kv_entries_written": 4800}
    kept = table.retention(run([], [[graph, other], [graph]]))  # the second worker is not added in
    assert (kept["requests_dropped"], kept["rows_kept_share"]) == (4, 0.4)
    assert kept["kv_written_share"] == (15200 + 4800) / (32000 + 8000)
    assert table.retention(run([])) == {} and table.retention(run([], "unavailable: TimeoutError")) == {}
