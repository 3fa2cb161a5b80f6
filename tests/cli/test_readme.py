"""Every Python block of the README runs as written, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    torch.manual_seed(0)
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102  (the README's own code)
    printed = capsys.readouterr().out
    assert "drop history" in printed and "graph rewritten" in printed
    assert namespace["out"].shape[1] > namespace["ids"].shape[1]
