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

from uniprefill import env
from uniprefill.eval.paired import compare, make_prompts, score_records
from uniprefill.vllm.engine_settings import dropping_engine_kwargs

DEFAULT_TASKS = "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1"


def engine_kwargs(args, max_len: int) -> dict:
    """LLM(...) settings: standard is vLLM's defaults (mode 3, CUDA graphs) with prompts prefilled
    whole; uniprefill adds the channel's settings (`uniprefill.vllm.engine_settings`)."""
    kwargs = {"dtype": "bfloat16", "max_model_len": max_len, "gpu_memory_utilization": args.gpu_memory_utilization,
              "enable_prefix_caching": False, "enable_chunked_prefill": False,
              "max_num_batched_tokens": max_len, "seed": 0, "enable_flashinfer_autotune": False}
    if args.kv_cache_gib:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    if args.system == "uniprefill":
        kwargs.update(dropping_engine_kwargs(json.loads(args.settings), max_model_len=max_len, mode=2))  # as measured
    return kwargs


def run(args) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.dry_run:  # the engine settings, without vLLM, a tokenizer or a model
        print(json.dumps(engine_kwargs(args, max(lengths) + 64)))
        return
    if args.system == "uniprefill":
        env.prepare_vllm_channel()  # before vLLM is imported; its EngineCore process inherits it
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    samples = make_prompts(tokenizer, args.tasks.split(","), lengths, args.samples, args.haystack, args.seed)
    print(f"{len(samples)} prompts, {min(s.num_tokens for s in samples)}-{max(s.num_tokens for s in samples)} tokens",
          flush=True)
    start = time.perf_counter()
    llm = LLM(model=str(args.model_dir), tokenizer=str(args.model_dir), **engine_kwargs(args, max(lengths) + 64))
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
    r.add_argument("--dry-run", action="store_true", help="print the engine settings as JSON and exit, without vLLM")
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
