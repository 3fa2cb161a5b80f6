"""Host time of the vLLM runtime's drop point on decode steps, against the context length (CPU).

After a prefill that dropped, every decode step of a dropping engine passes the drop point:
`VllmDropRuntime.drop` reads the batch, finds the requests' drop histories and points the
later layers at their shorter KV (`install_layer_metadata`). That work should not grow with
the context; this measures it, on the fake vLLM forward context of the tests (one KV-cache
group of 32 layers, blocks of 16: a Llama-3.1-8B shape's layout), with a drop at layer 7:

    python3 benchmarks/bench_vllm_decode_host.py --lengths 16384,32000 --batches 1,4

Prints the median and spread of the host time per decode step; on the H200 (2026-12-01) the
dropping engine decoded 16.5 ms per output token at 16K and 21.8 ms at 32K (batch 1), standard
vLLM 5.3 and 5.8 ms: this tells whether the runtime's own host work is where that grew.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fake_vllm import make_world, step  # noqa: E402  (the tests' fake vLLM context)

from uniprefill.config import UniPrefillConfig  # noqa: E402
from uniprefill.vllm.drop import VllmDropRuntime  # noqa: E402

LAYERS, DROP_LAYER, BLOCK, HEADS, HEAD_SIZE = 32, 7, 16, 2, 16


def decode_step_times(length: int, batch: int, steps: int) -> list[float]:
    world = make_world([length] * batch, layers=LAYERS, groups=1, block=BLOCK, kv_heads=HEADS,
                       head_size=HEAD_SIZE, room=steps + 1)
    config = UniPrefillConfig(keep_ratio=0.3, drop_layers=(DROP_LAYER,), min_tokens=256, impl="torch")
    runtime = VllmDropRuntime(config, world.names, (DROP_LAYER,), lambda: world, lambda name: BLOCK,
                              request_ids_fn=lambda: world.request_ids)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(length * batch, HEADS, HEAD_SIZE, generator=gen) for _ in range(2))
    runtime.begin_step()
    runtime.drop(q, k, DROP_LAYER)  # the prefill: every request drops
    assert runtime.totals.requests_dropped == batch, runtime.totals
    times = []
    for s in range(steps):
        step(world, [length + s] * batch, [1] * batch)
        q1, k1 = (torch.randn(batch, HEADS, HEAD_SIZE, generator=gen) for _ in range(2))
        start = time.perf_counter()
        runtime.begin_step()
        kept = runtime.drop(q1, k1, DROP_LAYER)
        times.append(time.perf_counter() - start)
        assert kept.numel() == batch
    later = world.attn_metadata[world.names[-1]]
    assert int(later.seq_lens.max()) < length, "the layers after the drop should see their shorter KV"
    return times[2:]  # the first steps warm the store's caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="16384,32000")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {LAYERS} layers, drop at {DROP_LAYER}, keep 0.3, {args.steps} decode steps")
    print("length  batch  host ms per decode step: median  (min-max)")
    for length in (int(x) for x in args.lengths.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            times = [t * 1e3 for t in decode_step_times(length, batch, args.steps)]
            print(f"{length:6d}  {batch:5d}  {statistics.median(times):8.3f}  ({min(times):.3f}-{max(times):.3f})")


if __name__ == "__main__":
    main()
