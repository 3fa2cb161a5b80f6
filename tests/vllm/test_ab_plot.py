"""scripts/gpu/vllm/ab_plot.py: the runs of each machine call in their order, and the plot."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "ab_plot.py"
spec = importlib.util.spec_from_file_location("ab_plot", SCRIPT)
ab_plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_plot)


def write(folder: Path, name: str, walls: list[float]) -> str:
    path = folder / name
    path.write_text(json.dumps({"prefill_wall_ms": walls, "prefill_wall_ms_median": sorted(walls)[len(walls) // 2]}))
    return str(path)


def test_each_call_keeps_its_run_order_and_engine_names(tmp_path):
    a, b, c = write(tmp_path, "old78-2.json", [3.0, 1.0]), write(tmp_path, "head.json", [2.0]), \
        write(tmp_path, "standard-3.json", [5.0, 4.0, 6.0])
    calls = ab_plot.calls_of([f"first: {a} {b}", f"second:{c}"])
    assert calls == [("first", [("old78", [3.0, 1.0]), ("head", [2.0])]), ("second", [("standard", [5.0, 4.0, 6.0])])]


def test_the_plot_is_written_and_the_medians_printed(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a, b = write(tmp_path, "head.json", [300.0, 320.0, 310.0]), write(tmp_path, "standard.json", [250.0, 240.0])
    out = tmp_path / "ab.png"
    assert ab_plot.main([f"call 1: {a} {b}", "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    assert capsys.readouterr().out.strip() == "call 1: head 310.0 ms, standard 240.0 ms"
