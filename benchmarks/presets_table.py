"""Table (and plot) of the presets' TTFT sweep: the JSON files `scripts/gpu/bench_presets.sh` writes.

Each file is one `uniprefill bench` run of one (preset, length) with forced retentions at one
drop point. The table puts beside every speedup the measured ideal (the plain model on the
kept token counts), the FLOP-model ideal and the paper's 128K figure for the preset's model
family (UniPrefill's RULER-setting TTFT speedups: Llama-3.1-8B 2.26x, Qwen3-Next-80B-A3B
1.68x, Gemma-3-12B 1.49x; those are p-driven retentions on the real models, ours are forced
retentions on random weights, so they are side by side, not like for like).

    python benchmarks/presets_table.py docs/results/bench-presets-h200 \
        --plot docs/results/bench-presets-h200/speedup-vs-length.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAPER_128K = {"llama-3.1-8b": 2.26, "qwen3-next-80b-a3b": 1.68, "gemma-3-12b": 1.49}
PRESET_ORDER = ("llama-3.1-8b", "gemma-3-12b", "qwen3-next-80b-a3b")


def _gib(peak_bytes: int | None) -> float | None:
    return None if peak_bytes is None else peak_bytes / 2**30  # None: not measured (CPU)


def load_rows(folder: Path) -> list[dict]:
    """One row per method result, with its run's baseline; sorted by preset, length, keep."""
    rows = []
    for path in sorted(folder.glob("bench-*.json")):
        run = json.loads(path.read_text())
        results = run["results"]
        baselines = {r["system"]: r for r in results if r["role"] == "baseline"}
        for result in results:
            if result["role"] != "method":
                continue
            baseline = baselines[result["baseline_system"]]
            rows.append({
                "preset": result["model"],
                "length": result["length"],
                "keep": result["config"]["keep_ratio"][0],
                "drop_layers": result["config"]["drop_layers"],
                "retention": result["overall_retention"],
                "baseline_ms": baseline["ttft_ms"],
                "ms": result["ttft_ms"],
                "speedup": result["speedup"],
                "ideal_measured": result.get("ideal_speedup"),
                "ideal_flops": result.get("analytic_ideal_speedup"),
                "peak_gib_baseline": _gib(baseline["ttft"]["peak_memory_bytes"]),
                "peak_gib": _gib(result["ttft"]["peak_memory_bytes"]),
                "date": run["environment"]["date"],
            })
    order = {name: i for i, name in enumerate(PRESET_ORDER)}
    rows.sort(key=lambda r: (order.get(r["preset"], 99), r["length"], -r["keep"]))
    return rows


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _peaks(row: dict) -> str:
    if row["peak_gib"] is None or row["peak_gib_baseline"] is None:
        return ""
    return f"{row['peak_gib_baseline']:.1f} / {row['peak_gib']:.1f}"


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| preset | N | keep | baseline ms | uniprefill ms | speedup | ideal (meas.) | ideal (FLOPs) "
        "| speedup / ideal (meas.) | peak GiB base / ours | paper, 128K |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "" if not r["ideal_measured"] else f"{r['speedup'] / r['ideal_measured']:.2f}"
        paper = _x(PAPER_128K.get(r["preset"])) if r["length"] >= 131072 else ""
        lines.append(
            f"| {r['preset']} | {r['length'] // 1024}K | {r['keep']} | {r['baseline_ms']:.1f} | {r['ms']:.1f} "
            f"| **{r['speedup']:.2f}x** | {_x(r['ideal_measured'])} | {_x(r['ideal_flops'])} | {ratio} "
            f"| {_peaks(r)} | {paper} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in rows))  # rows come sorted
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.6), sharey=True, squeeze=False)
    for ax, preset in zip(axes[0], presets):
        mine = [r for r in rows if r["preset"] == preset]
        for keep in sorted({r["keep"] for r in mine}, reverse=True):
            points = sorted((r["length"], r["speedup"], r["ideal_measured"]) for r in mine if r["keep"] == keep)
            xs = [p[0] / 1024 for p in points]
            line, = ax.plot(xs, [p[1] for p in points], marker="o", label=f"keep {keep}")
            ax.plot(xs, [p[2] for p in points], linestyle=":", color=line.get_color())
        if preset in PAPER_128K:
            ax.scatter([128], [PAPER_128K[preset]], marker="*", s=140, color="black", zorder=5,
                       label="paper, 128K (real model, p-driven)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([8, 32, 64, 128], labels=["8K", "32K", "64K", "128K"])
        ax.set_xlim(6, 170)
        ax.set_title(preset)
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TTFT speedup (dotted: measured ideal)")
    axes[0][-1].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--plot", type=Path, help="write speedup vs length, one panel per preset")
    args = parser.parse_args(argv)
    rows = load_rows(args.folder)
    if not rows:
        raise SystemExit(f"no bench-*.json results in {args.folder}")
    print(markdown_table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
