"""scripts/gpu/vllm/pooled_grid.py: several engine starts per system, read against standard's own spread."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "pooled_grid.py"
spec = importlib.util.spec_from_file_location("pooled_grid", SCRIPT)
pooled_grid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pooled_grid)


def run(points):
    return {"throughput": {"points": [{"length": n, "batch": b, "seconds": sorted(s)[len(s) // 2], "seconds_each": s}
                                      for (n, b), s in points.items()]}}


def test_a_gain_beyond_standards_own_spread_is_faster_and_one_inside_it_is_noise():
    # standard's two starts: 1.0 and 1.2 s (20% apart); the other engine: 0.5 and 0.55 s (about 2x), or 0.95 s
    faster = pooled_grid.point_summary([1.0, 1.2], [0.5, 0.55])
    assert faster["band"] == pytest.approx([1 / 1.2, 1.2], abs=1e-3)
    assert faster["cross"] == pytest.approx([1.0 / 0.55, 1.2 / 0.5], abs=1e-3)
    assert faster["verdict"] == "faster"
    assert faster["pooled_ratio"] == pytest.approx(1.1 / 0.525, abs=1e-3)
    assert pooled_grid.point_summary([1.0, 1.2], [0.95])["verdict"] == "within noise"
    assert pooled_grid.point_summary([1.0, 1.2], [1.6, 1.7])["verdict"] == "slower"
    assert pooled_grid.point_summary([1.0], [0.5])["verdict"] == "no band"  # one standard start: no noise estimate


def test_a_point_where_two_standard_starts_agree_gets_the_grids_typical_band_not_a_zero_width_one():
    standard = [run({(8192, 1): [1.0], (16384, 1): [2.0], (32000, 1): [4.0]}),
                run({(8192, 1): [1.0], (16384, 1): [2.4], (32000, 1): [4.4]})]  # 8K agree; 16K 1.2x; 32K 1.1x
    other = [run({(8192, 1): [0.98], (16384, 1): [1.0], (32000, 1): [4.0], (65536, 1): [1.0]})]
    rows = pooled_grid.pooled([{k: v["seconds"] for k, v in _points(r).items()} for r in standard],
                              [{k: v["seconds"] for k, v in _points(r).items()} for r in other])
    assert [(r["length"], r["verdict"]) for r in rows] == [(8192, "within noise"), (16384, "faster"),
                                                          (32000, "within noise")]  # 65536: only one run has it
    assert rows[0]["band"] == pytest.approx([1 / 1.1, 1.1], abs=1e-3)  # the median of 1.0, 1.2, 1.1


def _points(r):
    return {(p["length"], p["batch"]): p for p in r["throughput"]["points"]}


def test_main_reads_gzipped_runs_and_writes_the_summary(tmp_path, capsys):
    paths = {}
    for name, points in {"s1": {(8192, 4): [0.10, 0.11, 0.12]}, "s2": {(8192, 4): [0.12, 0.12, 0.13]},
                         "o1": {(8192, 4): [0.05, 0.06, 0.07]}}.items():
        paths[name] = tmp_path / f"{name}.json.gz"
        paths[name].write_bytes(gzip.compress(json.dumps(run(points)).encode()))
    out = tmp_path / "pooled.json"
    assert pooled_grid.main(["--standard", str(paths["s1"]), str(paths["s2"]), "--other", str(paths["o1"]),
                             "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["points"][0]["verdict"] == "faster"
    assert summary["points"][0]["pooled_ratio"] == pytest.approx(0.115 / 0.06, abs=1e-3)
    assert "| 8K x 4 | 1.92 |" in capsys.readouterr().out


def test_one_standard_start_gives_no_band_and_no_runs_raise(tmp_path, capsys):
    rows = pooled_grid.pooled([{(8192, 1): 1.0}], [{(8192, 1): 0.5}])
    assert rows[0]["verdict"] == "no band" and rows[0]["band"] is None and rows[0]["pooled_ratio"] == 2.0
    with pytest.raises(ValueError, match="at least one run"):
        pooled_grid.pooled([], [{(8192, 1): 0.5}])
    # a point one run lacks is left out and named; runs that share no point exit non-zero
    paths = []
    for name, points in (("s", {(8192, 1): [1.0], (16384, 1): [2.0]}), ("o", {(8192, 1): [0.5]}), ("x", {})):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(run(points)))
    assert pooled_grid.main(["--standard", str(paths[0]), "--other", str(paths[1])]) == 0
    assert "left out (not in every run): [(16384, 1)]" in capsys.readouterr().out
    assert pooled_grid.main(["--standard", str(paths[0]), "--other", str(paths[2])]) == 1
    assert "no point is in every run" in capsys.readouterr().out
