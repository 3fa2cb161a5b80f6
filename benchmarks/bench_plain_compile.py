"""TTFT through plain `torch.compile(model, backend="uniprefill")` vs `uniprefill.compile` (GPU).

Both on the same Llama-3.1-8B-shaped model (random bf16 weights, batch 1, one drop point at
layer 7 with `keep_ratio` forced), side by side in one process, plus the uncompiled model:

* `first_call_s`: wall time of each door's first call at each length, compile included,
  and whether that call dropped tokens (plain torch.compile used to trace it statically and
  run it unaccelerated);
* `ttft_ms`: median steady-state TTFT after warm-up; `plain_vs_compile` is plain torch.compile's
  TTFT over uniprefill.compile's (target: within 5%).

Usage: python benchmarks/bench_plain_compile.py --lengths 16384,32768 --keep-ratio 0.3 --out plain.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch._dynamo

from bench_backend_ttft import build_llama8b, timed  # noqa: E402  (run from the repository root or benchmarks/)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="16384,32768")
    parser.add_argument("--keep-ratio", type=float, default=0.3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="plain_compile.json")
    args = parser.parse_args()

    import uniprefill

    model, cfg = build_llama8b(args.layers)
    options = {"keep_ratio": args.keep_ratio, "drop_layers": (7,)}
    doors = {
        "plain torch.compile": torch.compile(model, backend="uniprefill", options=options),
        "uniprefill.compile": uniprefill.compile(model, uniprefill.UniPrefillConfig(**options)),
    }
    rows = []
    with torch.no_grad():
        for length in [int(x) for x in args.lengths.split(",")]:
            ids = torch.randint(0, cfg.vocab_size, (1, length), device="cuda")
            row = {"length": length, "keep_ratio": args.keep_ratio, "first_call_s": {}, "first_call_dropped": {},
                   "ttft_ms": {}}
            for name, door in doors.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                door(input_ids=ids, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize()
                row["first_call_s"][name] = time.perf_counter() - start
                row["first_call_dropped"][name] = uniprefill.last_drop_report(door) is not None
            samples = {name: [] for name in doors}
            samples["uncompiled"] = []
            calls = {**doors, "uncompiled": model}
            for _ in range(args.repeats):  # interleaved, so drifts hit every door alike
                for name, door in calls.items():
                    samples[name] += timed(lambda d=door: d(input_ids=ids, use_cache=False, logits_to_keep=1), 1, 1)
            row["ttft_ms"] = {name: statistics.median(v) for name, v in samples.items()}
            row["plain_vs_compile"] = row["ttft_ms"]["plain torch.compile"] / row["ttft_ms"]["uniprefill.compile"]
            row["graphs_plain"] = len(uniprefill.graph_reports(doors["plain torch.compile"]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
