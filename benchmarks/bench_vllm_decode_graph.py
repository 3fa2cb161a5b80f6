"""Kernels uniprefill adds to each replay of a vLLM decode graph after drops, on Gemma-3-270M's layout (CPU).

Under vLLM's default full decode graphs, a decode step replays the kernels recorded at capture; the drop points'
capture path (`uniprefill.vllm.graph_decode`) records, per drop point, what the later layers need: their KV lengths
and slots (full layers) and their window rows (sliding layers). On the H200 (2026-12-05,
docs/results/vllm-gemma-profile-h200-2026-12-05) the small kernels of these took 1.5 ms of a 16-token decode's
16.25 ms of device time, against standard's 15.35 ms. This runs the capture path of one decode step on the tests'
fake vLLM context with the layout of `bench_vllm_drop_host.py` (18 layers, 6 KV-cache groups, drop points 5 and 11,
window 512), after a prefill that dropped, and counts what a replay would launch:

* torch ops of uniprefill's code that launch a kernel (views, slices and allocations launch none and are not
  counted; nor are the ops of the kernels' PyTorch references, which run here in place of Triton),
* calls of the decode kernels (`kernels.layout_rows.decode_segment` / `decode_window`: one Triton launch each on a
  GPU).

    python3 benchmarks/bench_vllm_decode_graph.py --batches 1,4,16
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
from bench_vllm_drop_host import DROPS, HEAD_SIZE, KV_HEADS, Q_HEADS, OpCounter, one_step  # noqa: E402
from fake_vllm import step  # noqa: E402

NO_KERNEL = {"aten.view.default", "aten.slice.Tensor", "aten.select.int", "aten.expand.default", "aten.alias.default",
             "aten.detach.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default",
             "aten.as_strided.default", "aten.t.default", "aten.transpose.int", "aten._reshape_alias.default",
             "aten.split.Tensor", "aten.unbind.int", "aten.empty.memory_format", "aten.empty_strided.default",
             "aten.lift_fresh.default", "aten._unsafe_view.default"}


def triton_calls():
    """A context counting the capture path's calls of the decode kernels (`kernels.layout_rows.decode_segment` /
    `decode_window`, as `uniprefill.vllm.graph_decode` imported them: one launch each on a GPU); an older tree
    without them: nothing to count."""
    import contextlib

    import uniprefill.vllm.graph_decode as graph_decode

    @contextlib.contextmanager
    def counting():
        calls = {"calls": 0}
        names = [n for n in ("decode_segment", "decode_window") if hasattr(graph_decode, n)]
        saved = {n: getattr(graph_decode, n) for n in names}

        def counted(real):
            def run(*a, **kw):
                calls["calls"] += 1
                return real(*a, **kw)
            return run
        for n in names:
            setattr(graph_decode, n, counted(saved[n]))
        try:
            yield calls
        finally:
            for n in names:
                setattr(graph_decode, n, saved[n])
    return counting()


def measure(length: int, batch: int) -> dict:
    worlds: list = []
    runtime, prepare, run = one_step(length, batch, graph_decode_max_reqs=max(batch, 8), world_out=worlds)
    world = worlds[0]
    prepare()
    run()  # the prefill drops; the histories are recorded
    ids = tuple(world.request_ids)
    step(world, [length] * batch, [1] * batch)
    world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
    runtime.before_step(ids)
    q = torch.zeros(batch, Q_HEADS, HEAD_SIZE)
    k = torch.zeros(batch, KV_HEADS, HEAD_SIZE)

    def forward():
        runtime.begin_step()
        for layer in DROPS:
            runtime.drop(q, k, layer)

    forward()  # vLLM runs a capture's forward once before recording it
    counter = OpCounter()
    with counter, triton_calls() as launches:
        forward()
    kernels = sum(n for (site, op), n in counter.pairs.items()
                  if site.startswith("uniprefill/") and not site.startswith("uniprefill/kernels/")
                  and op not in NO_KERNEL)
    return {"batch": batch, "torch_kernels": kernels, "triton": launches["calls"],
            "ops": counter.runtime_ops()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens before the decode step")
    parser.add_argument("--batches", default="1,4,16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; Gemma-3-270M layout, drops at {DROPS}; one decode step's capture path "
          f"after a {args.length}-token prefill that dropped")
    print("batch  kernels from torch ops  Triton launches  all  (uniprefill's ops, views included)")
    for batch in (int(x) for x in args.batches.split(",")):
        r = measure(args.length, batch)
        print(f"{batch:5d}  {r['torch_kernels']:22d}  {r['triton']:15d}  {r['torch_kernels'] + r['triton']:3d}  "
              f"({r['ops']})")


if __name__ == "__main__":
    main()
