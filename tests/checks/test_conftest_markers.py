"""tests/conftest.py's markers: `gpu` tests skip without CUDA; `interpreter` cases (Triton on CPU tensors) skip on a
CUDA machine unless TRITON_INTERPRET asks for Triton's interpreter."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch


def _skipped(monkeypatch, cuda: bool, interpret: str | None) -> dict[str, bool]:
    spec = importlib.util.spec_from_file_location("tests_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    items = {}
    for name, keywords in (("plain", set()), ("gpu", {"gpu"}), ("interpreter", {"interpreter"})):
        item = types.SimpleNamespace(keywords=keywords, marks=[])
        item.add_marker = item.marks.append
        items[name] = item
    conftest.pytest_collection_modifyitems(None, list(items.values()))
    return {name: any(m.name == "skip" for m in item.marks) for name, item in items.items()}


@pytest.mark.parametrize("cuda, interpret, skipped", [
    (False, "1", {"gpu"}),
    (True, None, {"interpreter"}),
    (True, "0", {"interpreter"}),
    (True, "1", set()),
    (True, "true", set()),  # as Triton reads it
])
def test_each_marker_skips_where_its_tests_cannot_run(monkeypatch, cuda, interpret, skipped):
    got = _skipped(monkeypatch, cuda, interpret)
    assert {name for name, skip in got.items() if skip} == skipped
