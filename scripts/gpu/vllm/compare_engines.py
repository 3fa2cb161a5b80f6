"""Compare two `defaults_engine.py` runs: greedy outputs token for token, and prefill throughput.

    python3 scripts/gpu/vllm/compare_engines.py STANDARD.json OTHER.json [--out SUMMARY.json]

Parity: per prompt, equal token ids or the first position where they differ (prompt lengths must
match); with OTHER's `--parity-repeat` pass, how many of its outputs equal its first pass's and standard's
(standard's repeat pass where it ran one; standard's own agreement between its two passes beside it), and how
many prompt tokens came from the prefix cache. Throughput: per (length, batch) point present in both, OTHER's prefill tokens/s over
STANDARD's (ratio of the medians), the ratio of the two fastest calls and each engine's spread (slowest call over
fastest), the engine-side prefill span ratio, and decode ms per token of each. Gzipped runs are read as they are.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def load(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def parity(a: dict, b: dict) -> dict | None:
    if "parity" not in a or "parity" not in b:
        return None
    pa, pb = a["parity"], b["parity"]
    if pa["prompt_lengths"] != pb["prompt_lengths"]:
        raise SystemExit("the two runs did not use the same prompts")
    differ = []
    for i, (x, y) in enumerate(zip(pa["output_token_ids"], pb["output_token_ids"])):
        if x != y:
            first = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            differ.append({"prompt": i, "length": pa["prompt_lengths"][i], "first_different_token": first})
    n = len(pa["output_token_ids"])
    result = {"prompts": n, "identical": n - len(differ), "differ": differ,
              "lengths": [min(pa["prompt_lengths"]), max(pa["prompt_lengths"])]}
    if "repeat" in pb:  # the same prompts again in OTHER's engine: prefix-cache hits
        repeat = pb["repeat"]
        standard_repeat = pa.get("repeat", pa)  # standard's own second pass where it ran one
        result["repeat"] = {"identical_to_first_pass": sum(x == y for x, y in zip(pb["output_token_ids"],
                                                                                   repeat["output_token_ids"])),
                            "identical_to_standard": sum(x == y for x, y in zip(standard_repeat["output_token_ids"],
                                                                                 repeat["output_token_ids"])),
                            "standard_identical_to_its_first_pass": sum(
                                x == y for x, y in zip(pa["output_token_ids"], standard_repeat["output_token_ids"])),
                            "prompts_with_cached_tokens": sum(c > 0 for c in repeat["cached_tokens"]),
                            "cached_tokens": sum(repeat["cached_tokens"]), "prompt_tokens": sum(pa["prompt_lengths"])}
    if "output_logprobs" in pa and "output_logprobs" in pb:
        result["logprobs"] = logprob_differences(pa, pb)
    return result


def logprob_differences(pa: dict, pb: dict) -> dict:
    """Where two runs' numbers first part, finer than their tokens: per prompt the first position
    whose sampled token or its logprob differs (bit for bit). Position 0 is the prefill's output, later
    positions are decode steps; a run equal everywhere has no first position."""
    first_positions = {}
    for x, y, lx, ly in zip(pa["output_token_ids"], pb["output_token_ids"], pa["output_logprobs"], pb["output_logprobs"]):
        first = next((j for j, (u, v, a, b) in enumerate(zip(x, y, lx, ly)) if u != v or a != b), None)
        key = "equal" if first is None else str(first)
        first_positions[key] = first_positions.get(key, 0) + 1
    first_token_gap = prefill_logprob_gaps(pa, pb)
    return {"first_difference_at": dict(sorted(first_positions.items(), key=lambda kv: (kv[0] == "equal", len(kv[0]), kv[0]))),
            "prefill_logprob_equal": sum(g == 0 for g in first_token_gap),
            "prefill_logprob_abs_diff": _quantiles(first_token_gap)}


def prefill_logprob_gaps(pa: dict, pb: dict) -> list[float]:
    """|logprob difference| of the first generated token (the prefill's output), for the prompts whose
    first token the two runs agree on (`parity_plot.py` draws them)."""
    if pa["prompt_lengths"] != pb["prompt_lengths"]:
        raise SystemExit("the two runs did not use the same prompts")
    return [abs(lx[0] - ly[0]) for x, y, lx, ly in zip(pa["output_token_ids"], pb["output_token_ids"],
                                                        pa["output_logprobs"], pb["output_logprobs"]) if x[:1] == y[:1]]


def _quantiles(values: list[float]) -> dict:
    """Median, 90th percentile and maximum (nearest rank) of `values`; empty: zeros."""
    ordered = sorted(values) or [0.0]
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median": at(0.5), "p90": at(0.9), "max": ordered[-1]}


def throughput(a: dict, b: dict) -> list[dict]:
    index = {(p["length"], p["batch"]): p for p in a.get("throughput", {}).get("points", [])}
    rows = []
    for p in b.get("throughput", {}).get("points", []):
        q = index.get((p["length"], p["batch"]))
        if q is None:
            continue
        row = {"length": p["length"], "batch": p["batch"], "standard_tokens_per_s": q["tokens_per_s"],
               "tokens_per_s": p["tokens_per_s"], "ratio": round(p["tokens_per_s"] / q["tokens_per_s"], 3)}
        if p.get("seconds_each") and q.get("seconds_each"):  # the timed calls (median taken above)
            row["ratio_fastest"] = round(min(q["seconds_each"]) / min(p["seconds_each"]), 3)
            row["calls_spread"] = [round(max(e) / min(e), 3) for e in (q["seconds_each"], p["seconds_each"])]
        ea, eb = q.get("engine", {}), p.get("engine", {})
        if ea.get("available") and eb.get("available"):
            row["engine_span_ratio"] = round(ea["span_s"] / eb["span_s"], 3)
            for key in ("call_to_queued_s", "first_token_to_return_s"):  # outside the span (runs since 2026-12-05)
                if key in ea and key in eb:
                    row[key] = [ea[key], eb[key]]  # standard, other
        if "decode" in p and "decode" in q:
            row["decode_ms_standard"] = q["decode"].get("ms_per_token_median")
            row["decode_ms"] = p["decode"].get("ms_per_token_median")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("standard", type=Path)
    parser.add_argument("other", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    a, b = load(args.standard), load(args.other)
    summary = {"standard": str(args.standard), "other": str(args.other), "other_uniprefill": b.get("uniprefill"),
               "settled": {"standard": a.get("settled"), "other": b.get("settled")},
               "engine_init_s": {"standard": a.get("engine_init_s"), "other": b.get("engine_init_s")},
               "parity": parity(a, b), "throughput": throughput(a, b), "drop_totals": b.get("drop_totals")}
    text = json.dumps(summary, indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
