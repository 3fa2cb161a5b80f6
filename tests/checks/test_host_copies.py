"""Host-to-device copies on the serving path go through `kernels._common.to_device` (pinned staging).

A copy from pageable host memory to a CUDA device synchronises the stream whatever `non_blocking` says, so the host
waits for every kernel queued before it; the H100 trace of 2026-12-06 (docs/results/vllm-h100-2026-12-06h) counted
13-16 `cudaMemcpyAsync` calls in each vLLM drop point, and the CPU count 13 host-to-device copies in a step's two
(`benchmarks/bench_vllm_drop_host.py`), all from pageable memory then. The check is a heuristic over the spellings
the code uses (`.to(<...device...>)`, `non_blocking=`); `torch.tensor(..., device=)`, `.cuda()` and `.to(tensor)`
are not looked for (none is on the serving path). This check reads the vLLM runtime's and the kernels' sources: a `.to(...)`
that moves a tensor to a device, or a copy with `non_blocking`, outside the helpers that stage it, fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from uniprefill.kernels._common import to_device

ROOT = Path(__file__).resolve().parents[2]
SERVING = sorted([*ROOT.glob("uniprefill/vllm/*.py"), *ROOT.glob("kernels/**/*.py")])
# the helpers that stage through pinned memory themselves
ALLOWED = {("kernels/_common.py", "to_device"), ("uniprefill/vllm/graph_decode.py", "upload")}
DEVICE_WORDS = ("device",)  # `.to(device)`, `.to(x.device)`, `.to(self.device, ...)`
# warm-ups and references build tiny inputs once at the engine's start, off the serving path
OFF_PATH = ("reference.py", "warm_up.py")


def _moves_to_a_device(call: ast.Call) -> bool:
    if any(k.arg == "non_blocking" for k in call.keywords):
        return True
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "to" and call.args):
        return False
    first = call.args[0]
    name = first.attr if isinstance(first, ast.Attribute) else getattr(first, "id", "")
    return any(word in name for word in DEVICE_WORDS)


def _offending_calls(path: Path) -> list[str]:
    rel = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and _moves_to_a_device(child) and (rel, function) not in ALLOWED:
                found.append(f"{rel}:{child.lineno} in {function or '<module>'}: {ast.unparse(child)[:90]}")
            visit(child, name)

    visit(tree, "")
    return found


def test_the_serving_path_moves_host_tensors_only_through_pinned_staging():
    files = [p for p in SERVING if not p.name.endswith(OFF_PATH) and "__pycache__" not in p.parts]
    assert len(files) > 20  # the glob found the sources
    offending = [line for path in files for line in _offending_calls(path)]
    assert not offending, "host-to-device copies from pageable memory (use kernels._common.to_device):\n" + \
        "\n".join(offending)


def test_the_check_finds_a_pageable_copy(tmp_path):
    """The check itself: both spellings of a pageable copy are found, a dtype conversion is not."""
    source = tmp_path / "x.py"
    source.write_text("def f(t, device, q):\n    a = t.to(device, non_blocking=True)\n    b = t.to(q.device)\n"
                      "    return t.to(torch.int32)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = _offending_calls(source)
    finally:
        ROOT = saved
    assert [line.split(" in ")[0] for line in found] == ["x.py:2", "x.py:3"]


def test_to_device_leaves_a_tensor_already_on_the_target_alone():
    host = torch.arange(10)
    assert to_device(host, torch.device("cpu")) is host  # nothing to move
    assert to_device(host, "cpu") is host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", ["contiguous", "strided", "bool", "pinned"])
def test_to_device_stages_a_copy_the_host_may_change_at_once(form):
    base = torch.arange(8192, dtype=torch.int64)
    host = {"contiguous": base[:4096].clone(), "strided": base[::2], "bool": base[:4096] % 3 == 0,
            "pinned": base[:4096].clone().pin_memory()}[form]
    expected = host.clone()
    torch.cuda._sleep(10_000_000)  # a queued kernel: the copy goes behind it, reading the staging copy, not `host`
    moved = to_device(host, "cuda")
    host.fill_(0)  # the staging copy was taken before this, whatever the source's strides or memory
    assert moved.device.type == "cuda" and moved.dtype == expected.dtype
    assert torch.equal(moved.cpu(), expected)
    assert to_device(moved, torch.device("cuda")) is moved  # already there
