"""The host work of the drop points, counted in aten ops (`benchmarks/bench_vllm_drop_host.py`).

On a small model a prefill step's GPU work is a few tens of milliseconds, and each op the drop
points dispatch costs host time between the step's syncs (docs/results/vllm-gemma-profile-h200-2026-12-04).
The count is deterministic on CPU: it must not grow with the prompt's length, and it stays under a
budget a change has to argue for raising.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vllm_drop_host.py"
# uniprefill's own ops for both drop points of one step of one request, Gemma-3-270M's layout, and the calls of the
# row-layout kernels (one launch each on a GPU): 251 + 7 on torch 2.13 at the time of writing, with the layouts'
# rows in those kernels; 394 before that, with the host arithmetic in numpy; 680 before that, 936 before the
# checks, layout fields and slot mappings were computed once or only where read. The H200 trace of 2026-12-05
# (docs/results/vllm-gemma-profile-own-h200-2026-12-05) put each op at 17-20 us of a host-bound step.
RUNTIME_OPS_BUDGET = 300
UPLOADS_BUDGET = 14


def _bench():
    spec = importlib.util.spec_from_file_location("bench_vllm_drop_host", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_drop_points_host_ops_do_not_grow_with_the_prompt_and_stay_in_budget():
    bench = _bench()
    short, long = (bench.measure(length, 1, repeats=1) for length in (2048, 8192))
    assert 0 < short["kept"] < 2048 and 0 < long["kept"] < 8192  # both steps dropped
    # a few branches depend on the data (which requests' tails fit, ...), none on the length
    assert abs(short["runtime_ops"] - long["runtime_ops"]) <= 16, (short["top"], long["top"])
    assert long["runtime_ops"] + long["row_kernels"] <= RUNTIME_OPS_BUDGET, long["top"]
    assert long["row_kernels"] == 7  # vLLM's batch once; per drop point the left and right layouts, the window counts
    # host-to-device copies (one cudaMemcpyAsync each on a GPU, from pinned memory): 13 a step at the time of writing,
    # one per dtype of each layout and of the selection, the window counts' inputs, the sinks; like the ops, a change
    # has to argue for more
    assert 0 < long["uploads"] <= UPLOADS_BUDGET and short["uploads"] == long["uploads"], (short["uploads"], long["uploads"])


def test_each_more_request_of_a_step_adds_few_host_ops():
    """A batched step (vLLM batches 16 requests of 8K in one step by default) pays per request only for what is per
    request: recording its drop history (the views of its kept positions, one per drop point, and the store's host
    tables). 6 ops a request at the time of writing; 14 before the history's host numbers were read through numpy."""
    bench = _bench()
    two, eight = (bench.measure(2048, batch, repeats=1) for batch in (2, 8))
    assert eight["kept"] > 3 * two["kept"] > 0  # every request dropped
    assert eight["runtime_ops"] - two["runtime_ops"] <= 6 * 6, (two["top"], eight["top"])
    assert eight["uploads"] == two["uploads"] and eight["row_kernels"] == two["row_kernels"]


def test_a_decode_graph_replays_few_kernels_of_uniprefills():
    """Each replay of a vLLM decode graph after drops reruns what the drop points recorded at capture (the later
    layers' KV lengths, slots and window rows): on the H200 those small kernels were all of the +6% decode gap to
    standard (docs/results/vllm-gemma-profile-h200-2026-12-05). Now two kernels per drop point and an `arange` (62
    torch kernels before, `benchmarks/bench_vllm_decode_graph.py`), whatever the batch."""
    path = BENCH.parent / "bench_vllm_decode_graph.py"
    spec = importlib.util.spec_from_file_location("bench_vllm_decode_graph", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for batch in (1, 4):
        r = module.measure(1024, batch)
        assert r["triton"] == 4 and r["torch_kernels"] + r["triton"] <= 8, r
