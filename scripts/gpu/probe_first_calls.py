"""How many Triton compiles a serving engine's first dropping steps trigger in the
score-and-select kernels, with and without `kernels/warm_up.py` (GPU; one fresh Triton cache
per process, so every compile counts).

    python3 -P scripts/gpu/probe_first_calls.py --mode cold --out cold.json
    python3 -P scripts/gpu/probe_first_calls.py --mode warm --out warm.json

The steps are the prompt batches of a serving engine's first prefills (Gemma-3-270M's heads:
4 query heads, 1 KV head, head_dim 256, bf16; block 64, sink 128, last 128 queries, p 0.95):
one 8K prompt, then 4 and 16 of them, 16K, 32K, a length that is not a multiple of 16, and a
mixed batch. Each step's first call is timed (CUDA-synchronised) with the compiles it caused
(`triton.knobs.runtime.jit_post_compile_hook`), then the same call again. `--mode warm` runs
`warm_up_score_and_select` first. Runs on CPU too (TRITON_INTERPRET=1: no compiles, a dry run).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-probe-")  # before Triton is imported

import torch  # noqa: E402

from uniprefill.kernels.api import SelectionRule, score_and_select  # noqa: E402
from uniprefill.kernels.warm_up import warm_up_score_and_select  # noqa: E402

HEADS = dict(num_heads=4, num_kv_heads=1, head_dim=256)
SELECT = dict(block_size=64, sink=128, last_q=128, min_tokens=256)
STEPS = [[8192], [8192] * 4, [8192] * 16, [16384], [16384] * 4, [32000], [32000] * 4, [8191], [5000, 7000, 9001]]

compiles: list[str] = []


def record_compiles() -> bool:
    try:
        from triton import knobs
    except ImportError:
        return False
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        compiles.append(getattr(kwargs.get("fn"), "name", "?"))
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    return True


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_step(lengths: list[int], device, dtype, scale: float, lengths_scale: float) -> dict:
    lengths = [max(SELECT["min_tokens"] + 1, int(n * lengths_scale)) for n in lengths]
    n_q = [min(n, SELECT["last_q"]) for n in lengths]
    q = torch.randn(sum(n_q), HEADS["num_heads"], HEADS["head_dim"], device=device, dtype=dtype)
    k = torch.randn(sum(lengths), HEADS["num_kv_heads"], HEADS["head_dim"], device=device, dtype=dtype)
    host_q, host_k = [0], [0]
    for a, b in zip(n_q, lengths):
        host_q.append(host_q[-1] + a)
        host_k.append(host_k[-1] + b)
    cu_q, cu_k = (torch.tensor(h, dtype=torch.int32, device=device) for h in (host_q, host_k))
    rule = SelectionRule(**SELECT, p=0.95)

    def call():
        return score_and_select(q, k, cu_q, cu_k, max(lengths), rule, scale=scale, host_cu_seqlens=(host_q, host_k))

    before = len(compiles)
    times = []
    for _ in range(2):
        sync(device)
        start = time.perf_counter()
        call()
        sync(device)
        times.append(time.perf_counter() - start)
    return {"lengths": lengths, "first_ms": round(times[0] * 1e3, 2), "second_ms": round(times[1] * 1e3, 2),
            "compiles": compiles[before:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["cold", "warm"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths-scale", type=float, default=1.0, help="shrink the prompts (CPU dry runs)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hooked = record_compiles() and device.type == "cuda"
    summary = {"mode": args.mode, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "compiles_recorded": hooked, "heads": HEADS, "select": SELECT}
    if args.mode == "warm":
        before = len(compiles)
        ran = warm_up_score_and_select(**HEADS, **SELECT, dtype=dtype, device=device,
                                       max_seqlen=int(32768 * args.lengths_scale), p=0.95)
        sync(device)
        summary["warm_up"] = {"score_and_select_calls": ran.score_and_select_calls, "select_calls": ran.select_calls,
                              "seconds": round(ran.seconds, 3), "compiles": len(compiles) - before}
        print(f"warm-up: {summary['warm_up']}", flush=True)
    summary["steps"] = []
    for lengths in STEPS:
        step = run_step(lengths, device, dtype, HEADS["head_dim"] ** -0.5, args.lengths_scale)
        summary["steps"].append(step)
        print(f"{len(step['lengths'])} x {step['lengths'][0]}: first {step['first_ms']} ms, then "
              f"{step['second_ms']} ms, {len(step['compiles'])} compiles {sorted(set(step['compiles']))}", flush=True)
    summary["compiles_in_steps"] = sum(len(s["compiles"]) for s in summary["steps"])
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"compiles during the steps: {summary['compiles_in_steps']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
