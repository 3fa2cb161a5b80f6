"""Host work of the vLLM runtime's drop points in one prefill step, on Gemma-3-270M's layout (CPU).

On Gemma-3-270M the GPU work of a 32K prefill is 23-27 ms and the drop points' host work 3-4 ms
each (`docs/results/vllm-gemma-profile-h200-2026-12-04`): a small model's step is bound by host
work as much as by the GPU, so every op the drop points launch counts. This runs both drop points
of one step (`VllmDropRuntime.drop` at layers 5 and 11) on the fake vLLM forward context of the
tests with Gemma-3-270M's layout: 18 attention layers in 6 KV-cache groups of 3 (the full layers
5, 11, 17 one group, the sliding ones five), window 512, blocks of 16, p = 0.95. It counts what
would cost host time on a GPU, per step:

* aten ops dispatched (each a kernel launch or a host op on the GPU); host-to-device copies are not among them
  (on the CPU `.to(device)` dispatches nothing): the layouts make one per dtype (`vllm.host_arrays._to_device`),
* calls of the row-layout kernels (`kernels.layout_rows`, one launch each on a GPU; their PyTorch references run
  here and are not counted as ops),
* ops that read a value back to the host (`item`, `tolist`, `bool` of a tensor, `nonzero`: a
  device sync on the GPU; here every tensor is on the CPU, so this counts the calls that WOULD
  sync if their input lived on the device, host-side `_cpu` tensors included: an upper bound),
* host-to-device copies (calls of `kernels._common.to_device`, through which the runtime and the kernels move host
  arrays: one `cudaMemcpyAsync` each on a GPU, from pinned memory; `tests/checks/test_host_copies.py` keeps every copy
  on it),
* Python function calls (cProfile) and the median CPU time (tiny head size, one thread: the
  tensors' arithmetic is small beside the dispatch).

    python3 benchmarks/bench_vllm_drop_host.py --lengths 8192,32000 --batches 1,4
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
from fake_vllm import make_world, step  # noqa: E402  (the tests' fake vLLM context)

from uniprefill.config import UniPrefillConfig  # noqa: E402
from uniprefill.vllm.drop import VllmDropRuntime  # noqa: E402
from uniprefill.vllm.drop_records import WindowLayer  # noqa: E402

LAYERS, GROUPS, DROPS, WINDOW, BLOCK, Q_HEADS, KV_HEADS, HEAD_SIZE = 18, 6, (5, 11), 512, 16, 4, 1, 8
REPO = str(Path(__file__).resolve().parents[1]) + "/"
READ_BACK = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default"}


class OpCounter(TorchDispatchMode):
    """aten ops by name, and by the innermost frame of this repository that called them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.sites: Counter = Counter()
        self.pairs: Counter = Counter()  # (site, op name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(REPO):
            frame = frame.f_back
        site = "?" if frame is None else f"{frame.f_code.co_filename[len(REPO):]}:{frame.f_code.co_name}"
        self.sites[site] += 1
        self.pairs[site, str(func)] += 1
        return func(*args, **(kwargs or {}))

    def runtime_ops(self) -> int:
        """Ops of uniprefill's own code: not the PyTorch references of the kernels (Triton on a GPU, where each call
        of a row kernel is one launch: `row_kernel_calls`)."""
        return sum(n for site, n in self.sites.items()
                   if site.startswith("uniprefill/") and not site.startswith("uniprefill/kernels/"))


class RowKernelCalls:
    """Counts the runtime's calls of the row-layout kernels (`kernels.layout_rows`: one launch each on a GPU for up
    to 8 KV-cache groups; their PyTorch references run here and are not counted as runtime ops)."""

    def __init__(self) -> None:
        import uniprefill.vllm.layout as layout
        import uniprefill.vllm.window as window

        # (an older tree without them, benched against: nothing to count)
        self.targets = [(m, name) for m, name in ((layout, "layout_rows"), (window, "row_window_counts"))
                        if hasattr(m, name)]
        self.calls = 0

    def __enter__(self):
        self.saved = [getattr(module, name) for module, name in self.targets]
        for (module, name), real in zip(self.targets, self.saved):
            setattr(module, name, self._counted(real))
        return self

    def _counted(self, real):
        def run(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        return run

    def __exit__(self, *exc) -> None:
        for (module, name), real in zip(self.targets, self.saved):
            setattr(module, name, real)


class UploadCalls(RowKernelCalls):
    """Counts the host-to-device copies: calls of `kernels._common.to_device` from the modules that import it."""

    def __init__(self) -> None:
        import importlib

        names = ("uniprefill.vllm.host_arrays", "uniprefill.vllm.selection", "uniprefill.vllm.window",
                 "uniprefill.vllm.layout", "uniprefill.vllm.metadata", "uniprefill.kernels.select_blocks.kernel")
        modules = []
        for name in names:
            try:
                modules.append(importlib.import_module(name))
            except ImportError:  # the Triton kernel module on a machine without Triton
                continue
        self.targets = [(m, "to_device") for m in modules if hasattr(m, "to_device")]
        self.calls = 0


def one_step(length: int, batch: int, seed: int = 0, graph_decode_max_reqs: int = 0, world_out: list | None = None,
             context: int = 0):
    """(runtime, prepare, run): `run()` is one prefill step's two drop points on fresh requests (`prepare()` makes
    them); `graph_decode_max_reqs`: the runtime's, for decode under full graphs; `world_out` receives the world;
    `context` > 0: the step's last request is the last chunk of a prompt whose first `context` tokens an earlier
    step prefilled (its sink tokens among them: a step mixing two sink counts, as chunked prefill makes them)."""
    world = make_world([length] * batch, layers=LAYERS, groups=GROUPS, block=BLOCK, kv_heads=KV_HEADS,
                       head_size=HEAD_SIZE, room=1 + context)
    if world_out is not None:
        world_out.append(world)
    full = {d for d in range(LAYERS) if d % GROUPS == GROUPS - 1}
    assert set(DROPS) <= full
    windows = {n: WINDOW for i, n in enumerate(world.names) if i not in full}

    def window_layer(name):
        cache = world.kv_caches[name]
        return WindowLayer(cache[0].view(-1, BLOCK, KV_HEADS, HEAD_SIZE), cache[1].view(-1, BLOCK, KV_HEADS, HEAD_SIZE),
                           HEAD_SIZE ** -0.5, window=WINDOW)

    config = UniPrefillConfig(p=0.95, drop_layers=DROPS, impl="torch")
    computed = [0] * (batch - 1) + [context]
    prompts = torch.tensor([c + length for c in computed])
    runtime = VllmDropRuntime(config, world.names, DROPS, lambda: world, lambda name: BLOCK,
                              request_ids_fn=lambda: world.request_ids, windows=windows,
                              window_layer_fn=window_layer, graph_decode_max_reqs=graph_decode_max_reqs,
                              num_prompt_tokens_fn=lambda: prompts)
    gen = torch.Generator().manual_seed(seed)
    rows = length * batch
    q0 = torch.randn(rows, Q_HEADS, HEAD_SIZE, generator=gen)
    k0 = torch.randn(rows, KV_HEADS, HEAD_SIZE, generator=gen)
    count = 0

    def prepare():
        """A new step of fresh requests (each drops anew), its metadata built as vLLM builds it: not measured."""
        nonlocal count
        for r in list(world.request_ids):
            runtime.free(r)
        world.request_ids = [f"s{count}-{r}" for r in range(batch)]
        count += 1
        step(world, computed, [length] * batch)

    def run():
        runtime.begin_step()
        kept = runtime.drop(q0, k0, DROPS[0])
        kept = runtime.drop(q0[kept], k0[kept], DROPS[1])
        return kept.numel()

    return runtime, prepare, run


class ReplayedScores:
    """`score_and_select` answering each call of a step with what the same call of the first step returned: the
    PyTorch reference of the score kernels (Triton kernels on a GPU) then costs nothing, and the CPU time left is the
    runtime's own. `step_done()` after the first step fixes the calls a step makes."""

    def __init__(self, api) -> None:
        self.api, self.real, self.answers, self.calls, self.per_step = api, api.score_and_select, [], 0, None

    def __enter__(self):
        def replay(*args, **kwargs):
            i, self.calls = self.calls, self.calls + 1
            if self.per_step is None:  # the first step records
                self.answers.append(self.real(*args, **kwargs))
                return self.answers[-1]
            return self.answers[i % self.per_step]

        self.api.score_and_select = replay
        return self

    def step_done(self) -> None:
        if self.per_step is None:
            self.per_step = self.calls

    def __exit__(self, *exc) -> None:
        self.api.score_and_select = self.real


def measure(length: int, batch: int, repeats: int, context: int = 0) -> dict:
    runtime, prepare, run = one_step(length, batch, context=context)
    prepare()
    run()  # first use: lazy imports, caches
    prepare()
    counter = OpCounter()
    with counter, RowKernelCalls() as row_kernels, UploadCalls() as uploads:
        kept = run()
    prepare()
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    calls = pstats.Stats(profile).total_calls
    times, own = [], []
    for _ in range(repeats):
        prepare()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    import uniprefill.kernels.api as api
    with ReplayedScores(api) as replayed:
        for _ in range(repeats + 1):  # the first records the scores
            prepare()
            start = time.perf_counter()
            run()
            own.append(time.perf_counter() - start)
            replayed.step_done()
    ops = counter.ops
    return {"length": length, "batch": batch, "kept": kept, "ops": sum(ops.values()),
            "runtime_ops": counter.runtime_ops(), "row_kernels": row_kernels.calls, "uploads": uploads.calls,
            "read_back": sum(n for f, n in ops.items() if f in READ_BACK),
            "python_calls": calls, "selections": replayed.per_step, "ms": 1e3 * statistics.median(times),
            "own_ms": 1e3 * statistics.median(own[1:]), "top": counter.sites.most_common(15)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="8192,32000")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--top", action="store_true", help="also print where the ops come from")
    parser.add_argument("--context", type=int, default=0,
                        help="the last request of each step: the last chunk of a prompt with this many tokens before it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; Gemma-3-270M layout: {LAYERS} layers, {GROUPS} KV-cache groups, drops at "
          f"{DROPS}, window {WINDOW}, p = 0.95; per prefill step (both drop points)")
    if args.context:
        print(f"the last request of each step: a last chunk after {args.context} tokens of context")
    print("length  batch  rows kept  aten ops  of uniprefill's code  row kernels  uploads  selections  read-backs  "
          "python calls  CPU ms  of which the runtime's (medians)")
    for length in (int(x) for x in args.lengths.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            r = measure(length, batch, args.repeats, args.context)
            print(f"{length:6d}  {batch:5d}  {r['kept']:9d}  {r['ops']:8d}  {r['runtime_ops']:20d}  "
                  f"{r['row_kernels']:11d}  {r['uploads']:7d}  {r['selections']:10d}  {r['read_back']:10d}  "
                  f"{r['python_calls']:12d}  {r['ms']:6.1f}  {r['own_ms']:6.2f}")
            if args.top:
                print("    " + ", ".join(f"{f} {n}" for f, n in r["top"]))


if __name__ == "__main__":
    main()
