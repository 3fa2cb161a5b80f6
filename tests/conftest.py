"""Shared pytest setup.

* Tests marked `gpu` are skipped cleanly where CUDA is missing.
* Every test starts with dynamo's caches reset: each compiled model adds cache entries to
  the same transformers code objects, so without a reset a test's outcome would depend on
  how many models earlier tests compiled (dynamo's recompile limits).
* Under pytest-xdist (`-n 2` in pyproject's addopts) each worker process uses one torch thread.
* Without CUDA, the Triton kernels (tests/kernels/test_kernels.py) run in Triton's CPU interpreter.
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
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist runs the suite in processes, one per core (addopts)
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()  # and nothing compiled here outlives the test
