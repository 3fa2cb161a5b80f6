"""scripts/gpu/vllm/grid_plot.py: each timed call over standard's median, point by point, and the plot."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "grid_plot.py"
spec = importlib.util.spec_from_file_location("grid_plot", SCRIPT)
grid_plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grid_plot)


def run(points):
    return {"throughput": {"points": [{"length": n, "batch": b, "seconds_each": s} for (n, b), s in points.items()]}}


def test_each_call_is_its_throughput_over_standards_median_and_unshared_points_are_left_out():
    standard = {(8192, 1): [0.1, 0.2, 0.3], (8192, 4): [1.0]}
    other = {(8192, 1): [0.1, 0.4], (16384, 1): [0.5]}
    rel = grid_plot.relative_calls(standard, other)
    assert list(rel) == [(8192, 1)]
    assert rel[(8192, 1)] == pytest.approx([2.0, 0.5])  # median 0.2 s: twice as fast, half as fast


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "s.json").write_text(json.dumps(run({(8192, 1): [0.1, 0.2], (32000, 4): [1.0, 1.1]})))
    (tmp_path / "o.json").write_text(json.dumps(run({(8192, 1): [0.1], (32000, 4): [0.8, 0.9]})))
    assert grid_plot.main([str(tmp_path / "s.json"), f"p095={tmp_path / 'o.json'}", "--out", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert grid_plot.load_points(tmp_path / "o.json") == {(8192, 1): [0.1], (32000, 4): [0.8, 0.9]}
