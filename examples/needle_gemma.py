"""Needle in a haystack on the real Gemma-3-270M: baseline vs uniprefill, by generation.

    python examples/needle_gemma.py --length 8192 --p 0.99 --haystack ../shared/data/PaulGrahamEssays.json

Prints, for each system, the generated answer, whether it contains the needle's value, the
prefill time and the retention per drop layer; writes the same as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch._dynamo

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.eval.tasks import make_sample
from uniprefill.models.gemma import load_gemma3_270m


def run(system, model, ids, max_new_tokens):
    with torch.no_grad():
        t0 = time.perf_counter()
        out = system.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, ids.shape[1]:], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--p", type=float, nargs="+", default=[0.99])
    ap.add_argument("--drop-layers", default="all")
    ap.add_argument("--haystack", required=True)
    ap.add_argument("--task", default="niah_single_2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, tok = load_gemma3_270m(dtype=torch.float32, device="cpu")
    drop_layers = args.drop_layers if args.drop_layers in ("all", "auto") else [int(x) for x in args.drop_layers.split(",")]
    systems = [("baseline", model)]
    for p in args.p:
        systems.append((f"uniprefill p={p} drop_layers={args.drop_layers}",
                        uniprefill.compile(model, UniPrefillConfig(p=p, drop_layers=drop_layers))))
    results = []
    for index in range(args.samples):
        sample = make_sample(args.task, tok, args.length, index, seed=args.seed, haystack=args.haystack)
        ids = tok(sample.prompt, return_tensors="pt").input_ids
        for name, system in systems:
            text, seconds = run(system, model, ids, 12)
            answer = tok.decode(text)
            history = uniprefill.last_drop_report(system) if system is not model else None
            results.append({"sample": index, "tokens": int(ids.shape[1]), "depth": sample.depth, "system": name,
                            "answer": answer, "expected": sample.answers, "seconds": seconds,
                            "correct": all(r.lower() in answer.lower() for r in sample.answers),
                            "history": history.as_dict() if history else None})
    for r in results:
        retention = ""
        if r.get("history"):
            retention = "  ".join(f"L{d['layer']}: {d['retention']:.1%}" for d in r["history"]["drop_points"])
        print(f"sample {r['sample']} ({r['tokens']} tok, depth {r['depth']:.2f}) {r['system']:40s} correct={r['correct']!s:5s} {r['seconds']:7.1f}s  {retention}  answer={r['answer']!r}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"length": args.length, "task": args.task, "seed": args.seed, "command": " ".join(sys.argv),
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
