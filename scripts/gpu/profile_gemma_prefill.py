"""Where does uniprefill's prefill time go on a Gemma-3-270M-shaped model? (diagnostic, GPU)

Random weights with Gemma-3-270M's shapes (18 layers, 5:1 sliding/full, window 512,
head_dim 256, vocab 262144), bf16, SDPA, batch 1: exactly the prefill the eval times
(`System.prefill`: use_cache=False, logits of the last position). Retention is forced
(`keep_ratio` per drop point), so the speed is judged apart from attention patterns.

1. TTFT per length and system, baseline and method alternated (median of REPEATS after
   warm-ups), with the FLOP-model ideal of the same retention and the ratio of the two.
2. torch.profiler of one length: device time per op for the baseline and one method
   setting, the wall time per call, and the number of host syncs of a method call.

Usage (GPU box): python -P scripts/gpu/profile_gemma_prefill.py [--lengths 4096,16384,32000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from uniprefill import UniPrefillConfig
from uniprefill.eval.systems import System, baseline_spec, uniprefill_spec

REPEATS = 7


def gemma_270m_shape():
    cfg = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                           num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                           head_dim=256, sliding_window=512, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    return cfg


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - start) * 1e3


def sync_count(fn) -> int:
    if not torch.cuda.is_available():
        return -1
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def profile_table(fn, calls: int = 5) -> tuple[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms = statistics.median(wall_ms(fn) for _ in range(calls))
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30), ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384,32000")
    parser.add_argument("--keep", default="0.5,0.25")
    parser.add_argument("--profile-length", type=int, default=16384)
    parser.add_argument("--out", default="profile-gemma-prefill.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = gemma_270m_shape()
    model = AutoModelForCausalLM.from_config(cfg).to(args.device, getattr(torch, args.dtype)).eval()
    systems = [System(baseline_spec(), model)]
    for drop in ("auto", "all"):
        for keep in (float(x) for x in args.keep.split(",")):
            systems.append(System(uniprefill_spec(UniPrefillConfig(keep_ratio=keep, drop_layers=drop)), model))
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(0, cfg.vocab_size, (1, length), device=args.device)
        mask = torch.ones_like(ids)
        times = {s.spec.label: [] for s in systems}
        with torch.no_grad():
            for s in systems:
                for _ in range(2):
                    s.prefill(ids, mask)
            for _ in range(REPEATS):
                for s in systems:
                    times[s.spec.label].append(wall_ms(lambda: s.prefill(ids, mask)))
            base = statistics.median(times[systems[0].spec.label])
            for s in systems:
                s.prefill(ids, mask)
                report = s.drop_report()
                ideal = s.ideal_speedup(report, length)
                med = statistics.median(times[s.spec.label])
                row = {"length": length, "system": s.spec.label, "ttft_ms": med,
                       "spread_ms": [min(times[s.spec.label]), max(times[s.spec.label])],
                       "speedup": base / med, "ideal": ideal,
                       "speedup_vs_ideal": (base / med / ideal) if ideal else None,
                       "retention": [p["retention"] for p in (report or {}).get("drop_points", [])]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "torch": torch.__version__, "rows": rows}

    ids = torch.randint(0, cfg.vocab_size, (1, args.profile_length), device=args.device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for s in (systems[0], systems[2]):
            table, ms = profile_table(lambda: s.prefill(ids, mask))
            syncs = sync_count(lambda: s.prefill(ids, mask))
            print(f"== {s.spec.label} at {args.profile_length}: {ms:.2f} ms per call under the profiler, "
                  f"{syncs} host syncs\n{table}", flush=True)
            result[f"profile_{s.spec.label}"] = {"ms": ms, "syncs": syncs, "table": table}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
