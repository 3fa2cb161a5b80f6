"""Decode after a dropped prefill: tokens/s and KV-cache memory, baseline vs uniprefill.

For each system (the uncompiled model, then uniprefill at each `--p` or `--keep-ratio`), one
prefill of the prompt fills a fresh `DynamicCache`; then `--new-tokens` greedy one-token
decode steps run against that cache, each timed (CUDA events on CUDA, wall clock elsewhere).
Reported per system: median decode step time and tokens/s, the bytes held by the cache
after the prefill (every tensor of every cache layer: keys, values, recurrent states),
retention per drop point, and how many greedy tokens agree with the baseline's.

The prompt is a needle-in-a-haystack sample (`niah_single_2` with `--haystack`, else
`niah_single_1`) for a model with a tokenizer, or random token ids for a random-weight
preset (use `--keep-ratio` there: random weights give no meaningful attention pattern).

Systems run side by side in one process: every system prefills its own cache, then the
decode steps go round-robin (step i of every system before step i + 1 of any), so a drift of
the machine affects them alike; absolute times mean something only on the GPU.

Usage:
  python benchmarks/bench_decode.py --model gemma-3-270m --length 32768 --new-tokens 64 \\
      --p 0.99,0.9 --haystack PaulGrahamEssays.json --out decode.json
  python benchmarks/bench_decode.py --model llama-3.1-8b --length 32768 --keep-ratio 0.5,0.3 --out decode-llama.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.measure.environment import environment_info
from uniprefill.bench.models import DTYPES, check_lengths, load_model
from uniprefill.measure.timing import synchronize, timed_call


def cache_bytes(cache) -> int:
    """Bytes of every tensor held by the layers of a transformers cache."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    if total == 0:
        raise ValueError(f"cannot measure a cache of type {type(cache).__name__} (no tensor-holding layers)")
    return total


def prompt_ids(loaded, length: int, haystack: str | None, seed: int, device) -> tuple[torch.Tensor, dict]:
    if loaded.tokenizer is not None:
        from uniprefill.eval.tasks import make_sample

        task = "niah_single_2" if haystack else "niah_single_1"
        sample = make_sample(task, loaded.tokenizer, length, 1, seed=seed, haystack=haystack)
        ids = loaded.tokenizer(sample.prompt, return_tensors="pt").input_ids
        return ids.to(device), {"task": task, "answers": list(sample.answers)}
    vocab = loaded.model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=gen).to(device), {"task": "random ids"}


class Decoder:
    """One system's prefill, then its greedy decode steps one at a time (each timed)."""

    def __init__(self, fn, ids: torch.Tensor, device, decode_sdpa: str = "default") -> None:
        from transformers import DynamicCache

        self.fn, self.device, self.decode_sdpa = fn, device, decode_sdpa
        self.cache = DynamicCache(config=getattr(fn, "config", None))
        with torch.no_grad():
            out, self.prefill_s = timed_call(lambda: fn(input_ids=ids, past_key_values=self.cache, use_cache=True,
                                                        logits_to_keep=1), device)
        self.kv = cache_bytes(out.past_key_values)
        self.token = out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens, self.steps = [int(self.token)], []

    def step(self) -> None:
        from uniprefill.measure.sdpa import decode_sdpa as sdpa_choice

        with torch.no_grad(), sdpa_choice(self.decode_sdpa):
            out, seconds = timed_call(lambda: self.fn(input_ids=self.token, past_key_values=self.cache,
                                                      use_cache=True), self.device)
        self.steps.append(seconds)
        self.token = out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens.append(int(self.token))

    def result(self) -> dict:
        timed_steps = self.steps[1:] if len(self.steps) > 2 else self.steps  # the first step may warm up
        median = statistics.median(timed_steps)
        return {"prefill_s": self.prefill_s, "kv_cache_bytes": self.kv, "decode_step_median_s": median,
                "decode_step_min_s": min(timed_steps), "decode_tokens_per_s": 1.0 / median,
                "steps_timed": len(timed_steps), "tokens": self.tokens}


class KeepsPrefillHistory:
    """A compiled model that keeps the drop history of its own prefill (a multi-token call)."""

    def __init__(self, fast) -> None:
        self.fast, self.config, self.prefill_history = fast, getattr(fast, "config", None), None

    def __call__(self, **kwargs):
        out = self.fast(**kwargs)
        if kwargs["input_ids"].shape[1] > 1:
            self.prefill_history = uniprefill.last_drop_report(self.fast)
        return out


def decode_side_by_side(systems: list, ids: torch.Tensor, new_tokens: int, device, decode_sdpa: str) -> list[dict]:
    """Prefill every system (each its own cache), then decode round-robin: step i of each
    system before step i + 1 of any, so that a drift of the machine (clocks, a busy CPU)
    hits every system alike."""
    decoders = [Decoder(fn, ids, device, decode_sdpa) for fn in systems]
    for _ in range(new_tokens):
        for decoder in decoders:
            decoder.step()
    return [d.result() for d in decoders]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--p", default=None, help="comma-separated p values")
    parser.add_argument("--keep-ratio", default=None, help="comma-separated forced retentions")
    parser.add_argument("--drop-layers", default="all")
    parser.add_argument("--haystack", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-sdpa", default="default",
                        help="SDPA kernels of the decode steps: default, no-cudnn, or both as "
                             "'default,no-cudnn' (each a full side-by-side run)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from uniprefill.measure.sdpa import check_choice

    try:
        choices = [check_choice(c) for c in args.decode_sdpa.split(",")]
    except ValueError as err:
        parser.error(str(err))
    if (args.p is None) == (args.keep_ratio is None):
        parser.error("give exactly one of --p and --keep-ratio")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2")
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    drop_layers = args.drop_layers if args.drop_layers in ("all", "auto") else \
        tuple(int(x) for x in args.drop_layers.split(","))
    knob = "p" if args.p is not None else "keep_ratio"
    values = [float(v) for v in (args.p or args.keep_ratio).split(",")]
    configs = [UniPrefillConfig(**{knob: v}, drop_layers=drop_layers) for v in values]

    loaded = load_model(args.model, dtype=dtype, device=device)
    check_lengths(loaded.model.config, [args.length + args.new_tokens])
    ids, prompt = prompt_ids(loaded, args.length, args.haystack, args.seed, device)
    print(f"{args.model}: prompt of {ids.shape[1]} tokens ({prompt['task']}), {args.new_tokens} decode steps",
          file=sys.stderr)

    results = []
    for choice in choices:
        compiled = [KeepsPrefillHistory(uniprefill.compile(loaded.model, config)) for config in configs]
        runs = decode_side_by_side([loaded.model, *compiled], ids, args.new_tokens, device, choice)
        histories = [c.prefill_history for c in compiled]
        base = runs[0]
        results.append({"system": "baseline", "decode_sdpa": choice, **base})
        print(f"[decode SDPA {choice}] baseline: {base['decode_tokens_per_s']:.1f} tok/s, "
              f"KV {base['kv_cache_bytes'] / 2**20:.1f} MiB", file=sys.stderr)
        for config, run, history in zip(configs, runs[1:], histories):
            agree = sum(a == b for a, b in zip(run["tokens"], base["tokens"]))
            results.append({
                "system": f"uniprefill {knob}={getattr(config, knob)}", "decode_sdpa": choice,
                "config": {knob: getattr(config, knob)},
                **run, "history": history.as_dict() if history else None,
                "decode_speedup": base["decode_step_median_s"] / run["decode_step_median_s"],
                "kv_cache_ratio": run["kv_cache_bytes"] / base["kv_cache_bytes"],
                "tokens_agreeing_with_baseline": agree,
            })
            r = results[-1]
            print(f"[decode SDPA {choice}] {r['system']}: {r['decode_tokens_per_s']:.1f} tok/s "
                  f"({r['decode_speedup']:.2f}x), KV {r['kv_cache_bytes'] / 2**20:.1f} MiB "
                  f"({r['kv_cache_ratio']:.2f}x), retention {history.overall_retention if history else 1.0:.3f}, "
                  f"{agree}/{len(base['tokens'])} tokens as baseline", file=sys.stderr)
        del compiled
        synchronize(device)

    record = {"command": "python benchmarks/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
              "prompt_tokens": int(ids.shape[1]), "prompt": prompt, "new_tokens": args.new_tokens,
              "drop_layers": args.drop_layers, "dtype": str(dtype), "environment": environment_info(device),
              "results": results}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
