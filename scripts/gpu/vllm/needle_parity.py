"""Needle parity in vLLM (issue 6, stage 2): RULER-style prompts answered by standard vLLM and
by vLLM with uniprefill, same prompts, greedy, then the paired comparison.

    # on the GPU box, scripts/gpu/vllm/env.sh sourced, Gemma converted into /tmp/gemma-270m:
    python3 scripts/gpu/vllm/needle_parity.py run --system standard --model-dir /tmp/gemma-270m \\
        --haystack .gpu_data/PaulGrahamEssays.json --out $OUT/needles-standard.jsonl
    python3 scripts/gpu/vllm/needle_parity.py run --system uniprefill \\
        --settings '{"p": 0.99}' --model-dir /tmp/gemma-270m --haystack ... --out $OUT/needles-p099.jsonl
    python3 scripts/gpu/vllm/needle_parity.py compare $OUT/needles-standard.jsonl $OUT/needles-p099.jsonl

Prompts come from `uniprefill.eval.tasks.make_sample` with the model's own tokenizer, so they
are the prompts `uniprefill eval` uses (same seed, same lengths: at most L tokens with the
answer budget). Every prompt of a run goes to ONE `llm.generate` call, so vLLM batches them
continuously (prefills of new requests beside decodes of earlier ones). Prefix caching and
chunked prefill are off, so each prompt is prefilled whole in one step (stage 2 drops only
such requests). "standard" is vLLM's default configuration (mode 3, CUDA graphs); "uniprefill"
is the channel of docs/vllm.md (mode 2 and the uniprefill backend; with "vllm_drop": true in --settings
it drops, without it runs the graph unaccelerated). Scores: RULER's string_match_all /
string_match_part (`uniprefill.eval.scoring.score`); `compare` pairs the prompts both runs
answered and prints per-length differences with paired bootstrap 95% CIs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

DEFAULT_TASKS = "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1"


def make_prompts(tokenizer, tasks: list[str], lengths: list[int], samples: int, haystack, seed: int = 0) -> list:
    """The `Sample`s of every (task, length, index), as `uniprefill eval` makes them."""
    from uniprefill.eval.tasks import make_sample

    return [make_sample(task, tokenizer, length, i, seed=seed, haystack=haystack)
            for length in lengths for task in tasks for i in range(samples)]


def score_records(samples: list, texts: list[str], system: str, extra: dict | None = None) -> list[dict]:
    """One JSON-able record per sample: its key, the prediction and its score."""
    from uniprefill.eval.scoring import score

    if len(samples) != len(texts):
        raise ValueError(f"{len(samples)} samples but {len(texts)} outputs")
    return [{"system": system, "task": s.task, "length": s.length, "index": s.index, "seed": s.seed,
             "num_tokens": s.num_tokens, "answers": list(s.answers), "prediction": text,
             "score": score(s.task, text, s.answers), **(extra or {})} for s, text in zip(samples, texts)]


def compare(base: list[dict], other: list[dict], n_boot: int = 10_000) -> list[dict]:
    """Per length (and overall): mean scores and the paired difference other - base with its
    bootstrap 95% CI, over the prompts both answered."""
    from uniprefill.eval.scoring import paired_bootstrap_ci

    def key(r):
        return r["task"], r["length"], r["index"], r["seed"]

    mine = {key(r): r for r in other}
    pairs = defaultdict(list)  # length -> [(base record, other record)]
    for r in base:
        if key(r) in mine:
            pairs[r["length"]].append((r, mine[key(r)]))
    rows = []
    for length in sorted(pairs) + ["all"]:
        both = pairs[length] if length != "all" else [p for v in pairs.values() for p in v]
        if not both:
            continue
        a, b = [x["score"] for x, _ in both], [y["score"] for _, y in both]
        delta, low, high = paired_bootstrap_ci(a, b, n_boot=n_boot)
        rows.append({"length": length, "n": len(both), "base": 100 * sum(a) / len(a), "other": 100 * sum(b) / len(b),
                     "delta": delta, "ci": [low, high],
                     "same_prediction": sum(1 for x, y in both if x["prediction"] == y["prediction"])})
    return rows


def _engine_kwargs(args, max_len: int) -> dict:
    kwargs = {"dtype": "bfloat16", "max_model_len": max_len, "gpu_memory_utilization": args.gpu_memory_utilization,
              "enable_prefix_caching": False, "enable_chunked_prefill": False,
              "max_num_batched_tokens": max_len, "seed": 0, "enable_flashinfer_autotune": False}
    if args.kv_cache_gib:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    if args.system == "uniprefill":
        kwargs["compilation_config"] = {"mode": 2, "backend": "uniprefill.vllm.plugin.vllm_backend",
                                        "inductor_compile_config": {"uniprefill": json.loads(args.settings)}}
    return kwargs


def run(args) -> None:
    import os

    if args.system == "uniprefill":
        # mode 2 with vLLM's AOT compile needs a serialisable compiled function (docs/vllm.md);
        # set before vLLM is imported, and inherited by its EngineCore process
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"
        # collective_rpc(drop_totals) below sends a function: pickle on vLLM's IPC
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    lengths = [int(x) for x in args.lengths.split(",")]
    samples = make_prompts(tokenizer, args.tasks.split(","), lengths, args.samples, args.haystack, args.seed)
    print(f"{len(samples)} prompts, {min(s.num_tokens for s in samples)}-{max(s.num_tokens for s in samples)} tokens",
          flush=True)
    start = time.perf_counter()
    llm = LLM(model=str(args.model_dir), tokenizer=str(args.model_dir), **_engine_kwargs(args, max(lengths) + 64))
    built = time.perf_counter() - start
    params = [SamplingParams(temperature=0.0, max_tokens=s.max_new_tokens, stop=["\n"] if s.stop_at_newline else None)
              for s in samples]
    start = time.perf_counter()
    outputs = llm.generate([s.prompt for s in samples], params)
    wall = time.perf_counter() - start
    extra = {"settings": json.loads(args.settings) if args.system == "uniprefill" else None,
             "vllm_drop": bool(json.loads(args.settings).get("vllm_drop")) if args.system == "uniprefill" else False, "generate_wall_s": wall, "engine_init_s": built}
    if args.system == "uniprefill":  # did requests drop inside the engine? (the runtimes' totals, per worker)
        from uniprefill.vllm.runner_hook import collect_drop_totals

        extra["drop_totals"] = collect_drop_totals(llm)
    records = score_records(samples, [o.outputs[0].text for o in outputs], args.system, extra)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    by_length = defaultdict(list)
    for r in records:
        by_length[r["length"]].append(r["score"])
    for length, scores in sorted(by_length.items()):
        print(f"{args.system} {length}: {100 * sum(scores) / len(scores):.1f} over {len(scores)} prompts")
    print(f"engine {built:.0f} s, generate {wall:.1f} s -> {args.out}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--system", choices=["standard", "uniprefill"], required=True)
    r.add_argument("--settings", default='{"p": 0.99}', help="uniprefill settings (JSON), with --system uniprefill")
    r.add_argument("--model-dir", type=Path, required=True)
    r.add_argument("--haystack", required=True, help="essay file (PaulGrahamEssays.json)")
    r.add_argument("--tasks", default=DEFAULT_TASKS)
    r.add_argument("--lengths", default="8192,16384,32000")
    r.add_argument("--samples", type=int, default=10)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--kv-cache-gib", type=float, default=8.0)
    r.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("base", type=Path)
    c.add_argument("other", type=Path)
    c.add_argument("--out", type=Path, default=None, help="JSON of the comparison rows")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
        return
    load = lambda p: [json.loads(line) for line in p.read_text().splitlines() if line.strip()]  # noqa: E731
    rows = compare(load(args.base), load(args.other))
    for row in rows:
        print(f"{row['length']!s:>6}  n={row['n']:4d}  base {row['base']:5.1f}  other {row['other']:5.1f}  "
              f"delta {row['delta']:+5.1f} [{row['ci'][0]:+.1f}, {row['ci'][1]:+.1f}]  "
              f"same prediction {row['same_prediction']}/{row['n']}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    if not rows:
        sys.exit("no prompt answered by both runs")


if __name__ == "__main__":
    main()
