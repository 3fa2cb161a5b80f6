"""The ratio table of `bench_throughput.sh`: uniprefill over standard vLLM, per prompt length, from the
`--output-json` files of `vllm bench throughput` (`standard-L.json`, `uniprefill-L.json` in one folder).

    python3 scripts/gpu/vllm/bench_table.py OUT_DIR [--plot ratio.png]

Prints a Markdown table (requests/s and tokens/s of each, the ratio of tokens/s) and writes it to
OUT_DIR/table.md; a length present for one system only is an error, not a shorter table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def load(folder: Path) -> dict[tuple[str, int], dict]:
    runs = {}
    for path in folder.glob("*.json"):
        match = re.fullmatch(r"(standard|uniprefill)-(\d+)\.json", path.name)
        if match:
            runs[match.group(1), int(match.group(2))] = json.loads(path.read_text())
    return runs


def table(runs: dict[tuple[str, int], dict]) -> tuple[list[str], list[tuple[int, float]]]:
    lengths = sorted({length for _, length in runs})
    missing = [(s, n) for n in lengths for s in ("standard", "uniprefill") if (s, n) not in runs]
    if missing:
        raise SystemExit(f"runs missing (a failed engine?): {missing}")
    if not lengths:
        raise SystemExit("no standard-L.json / uniprefill-L.json files")
    lines = ["| prompt tokens | standard req/s | uniprefill req/s | standard tok/s | uniprefill tok/s | ratio |",
             "|---|---|---|---|---|---|"]
    ratios = []
    for n in lengths:
        a, b = runs["standard", n], runs["uniprefill", n]
        ratio = b["tokens_per_second"] / a["tokens_per_second"]
        ratios.append((n, ratio))
        lines.append(f"| {n} | {a['requests_per_second']:.2f} | {b['requests_per_second']:.2f} | "
                     f"{a['tokens_per_second']:,.0f} | {b['tokens_per_second']:,.0f} | **{ratio:.2f}x** |")
    return lines, ratios


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    lines, ratios = table(load(args.folder))
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    (args.folder / "table.md").write_text(text)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([n for n, _ in ratios], [r for _, r in ratios], marker="o")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("uniprefill / standard (tokens/s)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
