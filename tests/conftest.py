"""Shared pytest setup.

* Tests marked `gpu` are skipped cleanly where CUDA is missing.
* Without CUDA, the Triton kernels (tests/test_kernels.py) run in Triton's CPU interpreter.
  Triton chooses interpreter or compiler when it is first imported (it decorates its own
  `triton.language` helpers then), and other test modules import it early through
  torch._dynamo, so the choice is made here, before any test module is imported. It only
  affects code that launches Triton kernels on CPU tensors.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
