"""`scripts/gpu/vllm/trace_tree.py`: the nesting it prints from a profiler trace with Python stacks (a small
synthetic trace in the profiler's JSON layout: a caller and its op with one span, another thread overlapping), the
kernel time it counts inside the chosen event, and its refusals."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "trace_tree.py"


def _module():
    spec = importlib.util.spec_from_file_location("trace_tree", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


EVENTS = [
    _event("user_annotation", "execute_context_1(8)_generation_0(0)", 0, 10_000),
    _event("python_function", "runner.py(1): execute_model", 100, 9_800),
    _event("python_function", "drop.py(175): _drop", 200, 4_000),
    _event("cpu_op", "aten::sort", 300, 1_000),  # listed before its caller, with the same span
    _event("python_function", "torch.sort", 300, 1_000),
    _event("python_function", "output_thread.py(9): loop", 150, 8_000, tid=2),  # another thread, overlapping
    _event("python_function", "tiny.py(3): f", 1_400, 50),  # under --min-ms
    _event("cpu_op", "aten::mm", 5_000, 2_000),
    _event("kernel", "gemm", 5_100, 3_000),
    _event("kernel", "late", 20_000, 1_000),  # after the step
    _event("user_annotation", "execute_context_1(8)_generation_0(0)", 30_000, 5_000),
]


def test_the_tree_nests_by_time_and_counts_the_kernels_inside(tmp_path):
    path = tmp_path / "t.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    tree = _module()
    lines = tree.tree_lines(tree.load_events(path), "execute_context_1", 0, 0.5)
    assert lines[0] == "'execute_context_1' #0 of 2: 10.00 ms on the host, kernels starting inside it 3.00 ms"
    assert lines[1:] == [
        "  10.00 use execute_context_1(8)_generation_0(0)",  # durations 7 wide, two spaces a level
        "     9.80 pyt runner.py(1): execute_model",
        "       4.00 pyt drop.py(175): _drop",
        "         1.00 pyt torch.sort",
        "           1.00 cpu aten::sort",
        "       2.00 cpu aten::mm",
    ]
    second = tree.tree_lines(tree.load_events(path), "execute_context_1", 1, 0.5)
    assert second[0].endswith("5.00 ms on the host, kernels starting inside it 0.00 ms")


def test_a_name_not_found_or_an_index_past_the_matches_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": EVENTS}))
    tree = _module()
    events = tree.load_events(path)
    with pytest.raises(SystemExit, match="no host event"):
        tree.tree_lines(events, "execute_context_9", 0, 0.5)
    with pytest.raises(SystemExit, match="2 events contain"):
        tree.tree_lines(events, "execute_context_1", 2, 0.5)
