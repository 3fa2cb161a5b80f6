"""The `census` and `fuzz` subcommands: the correctness checks a maintainer runs at scale.
"""

from __future__ import annotations

import json
import os
import sys

from .arguments import UsageError, _split


def cmd_census(args, checks) -> int:
    import transformers
    import torch

    from ..testing.census import as_dict, causal_lm_types, census_one, table, CensusRow

    with checks():
        known = causal_lm_types()
        types = known if args.types == "all" else _split(args.types)
        unknown = sorted(set(types) - set(known))
        if unknown:
            raise UsageError(f"model types {unknown} have no causal-LM class in transformers {transformers.__version__}")
    done = {}
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as fh:
            done = {r["model_type"]: r for r in map(json.loads, fh) if r.get("model_type")}
    todo = [t for t in types if t not in done]
    for i, model_type in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {model_type} ...", file=sys.stderr, flush=True)
        row = census_one(model_type)
        print(f"    {row.status} {row.reason[:150]} ({row.seconds} s)", file=sys.stderr, flush=True)
        done[model_type] = as_dict(row)
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(as_dict(row)) + "\n")
    rows = [CensusRow(**{k: v for k, v in done[t].items()}) for t in sorted(done)]
    versions = f"transformers {transformers.__version__}, torch {torch.__version__}"
    text = table(rows, versions)
    if args.table:
        with open(args.table, "w", encoding="utf-8") as fh:
            fh.write(text)
    print(text.split("\n")[4])  # the counts
    print(text.split("\n")[6])  # the accelerated share
    return 1 if any(r.status in ("mismatch", "error") for r in rows if r.model_type in types) else 0


def cmd_fuzz(args, checks) -> int:
    import json
    import os
    import sys

    from ..testing.fuzz import ARCHS, run_fuzz

    with checks():
        archs = ARCHS if args.archs == "all" else tuple(a.strip() for a in args.archs.split(","))
        unknown = sorted(set(archs) - set(ARCHS))
        if unknown:
            raise ValueError(f"unknown architectures {unknown}; choose from {', '.join(ARCHS)}")
        if args.cases < 1 or args.fresh_every < 1 or (args.seconds is not None and args.seconds <= 0):
            raise ValueError("--cases, --fresh-every and --seconds must be positive")

    def write(summary):
        if args.out:
            with open(args.out + ".part", "w") as fh:
                json.dump(summary.as_json(args.seed, archs), fh, indent=1)
            os.replace(args.out + ".part", args.out)

    def progress(done, summary):
        write(summary)
        if not args.quiet:
            print(f"\r{done}/{args.cases} cases, {summary.seconds:.0f} s: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(summary.by_status.items())), end="", file=sys.stderr)

    summary = run_fuzz(args.cases, args.seed, archs, args.fresh_every, progress, args.seconds)
    if not args.quiet:
        print(file=sys.stderr)
    print(summary)
    write(summary)
    return 1 if summary.mismatches else 0
