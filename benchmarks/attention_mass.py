"""Where the last queries' attention goes at every full-attention layer of a real model.

For each prompt (RULER-style needle tasks of `uniprefill.eval.tasks`) the plain model runs
once, unchanged; an attention function registered with transformers' `AttentionInterface`
computes SDPA as usual and, at every full-attention layer, also the token scores the method
uses (softmax of the last `last_q` queries over all keys, mean over queries, sum over heads:
`kernels.score_blocks.reference.token_scores`), averaged over blocks of `block_size` tokens. Per layer it
records the share of that score held by the sink blocks, the window blocks, the needle's
blocks and the rest, the needle's rank among the free (not forced) blocks, and what each
selection rule would keep if that layer were a drop point fed the full prompt: the kept
share of the tokens and whether every needle block survives.

The rules are the ones `UniPrefillConfig.selection` offers (`kernels.select_blocks.reference.select_one`):
"paper" (forced blocks count toward p) and "content" (p is the share of the free blocks'
score; forced blocks are kept on top).

    python benchmarks/attention_mass.py --model smollm2-135m --lengths 4096,8192 --samples 5 \
        --out docs/results/attention-mass-cpu/smollm2.jsonl --plot docs/results/attention-mass-cpu/smollm2.png

Each line of the JSONL is one (prompt, layer); `--plot` draws the mean shares per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from uniprefill.measure.attention_mass import PS, RULES, ScoreProbe, layer_record, needle_token_span

TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue")


def load(name: str, device: str, dtype: torch.dtype):
    if name == "smollm2-135m":
        from uniprefill.models.smollm2 import load_smollm2_135m

        return load_smollm2_135m(dtype, device)
    if name == "gemma-3-270m":
        from uniprefill.models.gemma import load_gemma3_270m

        return load_gemma3_270m(dtype, device)
    raise SystemExit(f"unknown model {name!r}: smollm2-135m or gemma-3-270m")


def plot(records, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in records})
    fig, axes = plt.subplots(len(lengths), 3, figsize=(18, 4.2 * len(lengths)), squeeze=False)
    for row, length in enumerate(lengths):
        rows = [r for r in records if r["length"] == length]
        layers = sorted({r["layer"] for r in rows})
        names = [str(layer) for layer in layers]

        def mean(key, layer):
            vals = [float(r[key]) for r in rows if r["layer"] == layer and r[key] is not None]
            return sum(vals) / len(vals) if vals else float("nan")

        ax = axes[row][0]
        bottom = [0.0] * len(layers)
        for key, label in (("sink_share", "sink blocks"), ("window_share", "window blocks"),
                           ("needle_share", "needle blocks"), ("free_share", "other free blocks")):
            vals = [mean(key, l) - (mean("needle_share", l) if key == "free_share" else 0) for l in layers]
            ax.bar(names, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{title}, {length} tokens: where the last queries' score goes", fontsize=9)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, loc="lower left")
        for col, (suffix, what, log) in enumerate((("kept", "kept share of the tokens", True),
                                                   ("needle", "needle blocks all kept (share of prompts)", False)), 1):
            ax = axes[row][col]
            for rule, style in (("paper", "-"), ("content", "--")):
                for p, colour in zip(PS, ("C0", "C1", "C2")):
                    ax.plot(names, [mean(f"{rule}@{p}_{suffix}", l) for l in layers], style, color=colour,
                            label=f"{rule} p={p}")
            if log:
                ax.set_yscale("log")
            ax.set_title(f"one drop at this layer: {what}", fontsize=9)
            ax.legend(fontsize=7)
        for ax in axes[row]:
            ax.set_xlabel("full-attention layer")
            ax.tick_params(axis="x", labelsize=7, rotation=90)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def summary_table(records, ps=(0.9, 0.99)) -> str:
    """Markdown: per length and layer, the mean shares, the needle's rank among the free blocks
    (0 = the top one), and per rule the kept share / the share of prompts keeping the needle."""
    lines = []
    for length in sorted({r["length"] for r in records}):
        rows = [r for r in records if r["length"] == length]
        prompts = len({(r["task"], r["index"]) for r in rows})
        head = ["layer", "sink", "window", "needle", "free", "needle rank"]
        head += [f"{rule} p={p}: kept / needle" for rule in RULES for p in ps]
        lines += [f"{rows[0]['model']}, {length} tokens, {prompts} prompts:", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for layer in sorted({r["layer"] for r in rows}):
            at = [r for r in rows if r["layer"] == layer]

            def mean(key):
                vals = [float(r[key]) for r in at if r[key] is not None]
                return sum(vals) / len(vals) if vals else float("nan")

            cells = [str(layer)] + [f"{mean(k):.2f}" for k in ("sink_share", "window_share", "needle_share",
                                                               "free_share", "needle_rank")]
            cells += [f"{mean(f'{rule}@{p}_kept'):.2f} / {mean(f'{rule}@{p}_needle'):.2f}"
                      for rule in RULES for p in ps]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m or gemma-3-270m")
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--samples", type=int, default=5,
                    help="samples per task and length: indices 1..N (index 0 puts the needle at depth 0, in the sink)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--haystack", default=os.path.join("..", "shared", "data", "PaulGrahamEssays.json"))
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--last-q", type=int, default=128)
    ap.add_argument("--sink", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True, help="JSONL, one line per (prompt, layer)")
    ap.add_argument("--plot", help="PNG of the mean shares and kept shares per layer")
    ap.add_argument("--summary", help="write a markdown table of the per-layer means here")
    ap.add_argument("--from-out", action="store_true",
                    help="read --out (JSONL, or .jsonl.gz) instead of running the model")
    args = ap.parse_args(argv)
    if args.from_out:
        import gzip

        with (gzip.open if args.out.endswith(".gz") else open)(args.out, "rt") as f:
            records = [json.loads(line) for line in f]
        _report(records, args)
        return 0

    from transformers import AttentionInterface

    from uniprefill.eval.tasks import make_sample

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tokenizer = load(args.model, args.device, dtype)
    probe = ScoreProbe(args.last_q)
    AttentionInterface.register("uniprefill_probe", probe)
    model.config._attn_implementation = "uniprefill_probe"
    for sub in (model.config, getattr(model.config, "text_config", None)):
        if sub is not None:
            sub._attn_implementation = "uniprefill_probe"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    records = []
    lengths = [int(x) for x in args.lengths.split(",")]
    tasks = args.tasks.split(",")
    todo = [(length, task, i) for length in lengths for task in tasks for i in range(1, args.samples + 1)]
    with open(args.out, "w") as out:
        for done, (length, task, index) in enumerate(todo, 1):
            t0 = time.perf_counter()
            sample = make_sample(task, tokenizer, length, index, haystack=args.haystack)
            ids = tokenizer(sample.prompt, return_tensors="pt").input_ids.to(args.device)
            spans = needle_token_span(tokenizer, sample.prompt, sample.answers)
            probe.scores.clear()
            with torch.no_grad():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
            for layer, scores in sorted(probe.scores.items()):
                rec = {"model": args.model, "length": length, "task": task, "index": index,
                       "layer": layer, "depth": sample.depth,
                       **layer_record(scores.float(), spans, block_size=args.block_size,
                                      sink=args.sink, last_q=args.last_q)}
                records.append(rec)
                out.write(json.dumps(rec) + "\n")
            out.flush()
            print(f"[{done}/{len(todo)}] {task} {length} tokens: {len(probe.scores)} full layers, "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    _report(records, args)
    return 0


def _report(records, args) -> None:
    if args.plot:
        plot(records, args.plot, records[0]["model"])
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(summary_table(records) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
