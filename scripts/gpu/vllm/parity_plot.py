"""How far apart two engines' numbers are, pair by pair: the cumulative share of prompts whose prefill
logprob (the first generated token's, where both runs chose the same token) differs by at most x.

    python3 scripts/gpu/vllm/parity_plot.py --pair "LABEL" A.json B.json [--pair ...] --out parity.png

A.json, B.json: `defaults_engine.py --parity-logprobs` runs (gzipped ones are read as they are). A pair
whose curve starts at 1 is bit-equal; the x axis is logarithmic, with the bit-equal prompts drawn at its
left edge (with any gap below 1e-6; the legend counts the bit-equal ones).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path


def load(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)["parity"]


def _compare_engines():
    """compare_engines.py beside this script (`python3 -P` keeps the script's folder off sys.path)."""
    spec = importlib.util.spec_from_file_location("compare_engines", Path(__file__).with_name("compare_engines.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", nargs=3, action="append", metavar=("LABEL", "A", "B"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefill_logprob_gaps = _compare_engines().prefill_logprob_gaps
    floor = 1e-6
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, a, b in args.pair:
        raw = prefill_logprob_gaps(load(Path(a)), load(Path(b)))
        equal = sum(g == 0 for g in raw)
        gaps = sorted(max(g, floor) for g in raw)
        ys = [(i + 1) / len(gaps) for i in range(len(gaps))]
        ax.step(gaps, ys, where="post", label=f"{label} ({equal}/{len(gaps)} bit-equal)")
    ax.set_xscale("log")
    ax.set_xlabel("|prefill logprob difference| (bit-equal and below 1e-6 drawn at 1e-6)")
    ax.set_ylabel("share of prompts")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
