"""Shared pytest setup.

* Tests marked `gpu` are skipped cleanly where CUDA is missing.
* Tests marked `interpreter` launch Triton kernels on CPU tensors, which only Triton's CPU interpreter runs: on a
  CUDA machine they are skipped unless TRITON_INTERPRET=1 is set (run them there as
  `TRITON_INTERPRET=1 pytest -m interpreter`, the rest as plain `pytest`).
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
        from uniprefill.kernels._common import interpret_enabled  # TRITON_INTERPRET read as the kernels read it

        if interpret_enabled():
            return
        skip = pytest.mark.skip(reason="Triton kernels on CPU tensors: Triton's CPU interpreter "
                                       "(TRITON_INTERPRET=1 pytest -m interpreter)")
        marker = "interpreter"
    else:
        skip, marker = pytest.mark.skip(reason="needs a CUDA device"), "gpu"
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()  # and nothing compiled here outlives the test
