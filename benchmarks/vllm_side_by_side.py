"""Side-by-side table of two `scripts/gpu/vllm/smoke_llm.py` throughput runs (standard vLLM vs
the uniprefill channel), as markdown for `docs/benchmarks.md`.

    python3 benchmarks/vllm_side_by_side.py STANDARD.json UNIPREFILL.json [--plot out.png]

Each row pairs the points with the same prompt length and batch; the ratio is uniprefill's
tokens/s over standard's (B x L / wall time of `llm.generate`, `max_tokens=1`). Decode columns
appear when the runs timed decode (`--decode-tokens`): median ms per output token per request,
from the engine's timestamps. At batch > 1 those include the other requests' prefills that vLLM
schedules between decode steps (one prompt per step when max_num_batched_tokens = the prompt
length), so only batch 1 is a clean per-token decode time; the table says so in its notes.
A point present in one run only is an error, not a silently shorter table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _points(run: dict) -> dict[tuple[int, int], dict]:
    points = (run.get("throughput") or {}).get("points") or []
    if not points:
        raise ValueError("run has no throughput points (was it run with --throughput-lengths?)")
    return {(p["length"], p["batch"]): p for p in points}


def side_by_side_rows(standard: dict, ours: dict) -> list[dict]:
    """One dict per (length, batch) present in both runs, sorted; raises if the grids differ."""
    a, b = _points(standard), _points(ours)
    if set(a) != set(b):
        raise ValueError(f"the runs measured different points: standard only {sorted(set(a) - set(b))}, "
                         f"uniprefill only {sorted(set(b) - set(a))}")
    rows = []
    for key in sorted(a):
        sa, sb = a[key], b[key]
        row = {"length": key[0], "batch": key[1], "standard_tok_s": sa["tokens_per_s"],
               "uniprefill_tok_s": sb["tokens_per_s"], "ratio": sb["tokens_per_s"] / sa["tokens_per_s"]}
        da, db = sa.get("decode") or {}, sb.get("decode") or {}
        if da.get("available") and db.get("available"):
            row["standard_decode_ms"] = da["ms_per_token_median"]
            row["uniprefill_decode_ms"] = db["ms_per_token_median"]
        rows.append(row)
    return rows


def retention(ours: dict) -> dict:
    """Rows kept at the drop points and the share of prompt KV entries written, summed over the
    first worker's compiled graphs (every rank's totals are equal under TP: smoke_llm checks
    `ranks_agree`), as `smoke_llm.kv_written_share` does."""
    workers = ours.get("drop_totals")
    if not isinstance(workers, list) or not workers or not workers[0]:
        return {}
    fields = ("requests_dropped", "rows_in", "rows_kept", "kv_entries_prompt", "kv_entries_written")
    total = {f: sum(graph.get(f, 0) for graph in workers[0]) for f in fields}
    out = {f: total[f] for f in fields[:3]}
    out["rows_kept_share"] = total["rows_kept"] / max(total["rows_in"], 1)
    if total["kv_entries_prompt"]:
        out["kv_written_share"] = total["kv_entries_written"] / total["kv_entries_prompt"]
    return out


def markdown(rows: list[dict]) -> str:
    decode = all("standard_decode_ms" in r for r in rows)
    head = "| L | B | standard tok/s | uniprefill tok/s | ratio |"
    rule = "|---|---|---|---|---|"
    if decode:
        head += " decode ms/token, standard | decode ms/token, uniprefill |"
        rule += "---|---|"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r['length']} | {r['batch']} | {r['standard_tok_s']:,.0f} | {r['uniprefill_tok_s']:,.0f} "
                f"| **{r['ratio']:.2f}x** |")
        if decode:
            line += f" {r['standard_decode_ms']:.1f} | {r['uniprefill_decode_ms']:.1f} |"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for batch in sorted({r["batch"] for r in rows}):
        sel = [r for r in rows if r["batch"] == batch]
        ax.plot([r["length"] for r in sel], [r["ratio"] for r in sel], marker="o", label=f"batch {batch}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tokens/s, uniprefill / standard")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("standard", type=Path)
    parser.add_argument("uniprefill", type=Path)
    parser.add_argument("--plot", type=Path, help="also write the ratio per length and batch as a PNG")
    parser.add_argument("--title", default="vLLM prefill throughput, uniprefill vs standard")
    args = parser.parse_args(argv)
    standard, ours = (json.loads(p.read_text()) for p in (args.standard, args.uniprefill))
    try:
        rows = side_by_side_rows(standard, ours)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(markdown(rows))
    kept = retention(ours)
    if kept:
        print("\nuniprefill drop totals: " + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v:,}" for k, v in kept.items()))
    if args.plot:
        plot(rows, args.plot, args.title)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
