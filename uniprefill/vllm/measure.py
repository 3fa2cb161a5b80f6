"""Measuring a vLLM engine from outside (the GPU scripts under scripts/gpu/vllm/): prompts of exact
token lengths, prefill throughput per (length, batch) with the engine's own timestamps, decode time
per output token, and the reading of the drop totals that `runner_hook.collect_drop_totals`
returns (one list per worker, one dict per rewritten graph). Nothing here imports vLLM at module
level.
"""

from __future__ import annotations

import random
import time

# Throughput prompts use token ids in [ID_LOW, ID_LOW + ID_SPAN): clear of the special and
# control tokens at the start of the Llama-3 and Gemma-3 vocabularies, inside both.
ID_LOW = 1000
ID_SPAN = 20000


def ranks_agree(totals) -> bool | None:
    """Whether every worker's drop totals (`collect_drop_totals`: one list per worker, one dict
    per rewritten graph) are identical: rank-consistent selection keeps the same rows on every
    rank. None when there is nothing to compare (an error text, or fewer than two workers)."""
    if not isinstance(totals, list) or len(totals) < 2:
        return None
    return all(worker == totals[0] for worker in totals[1:])


def kv_written_share(totals) -> float | None:
    """The share of the dropping prompts' KV entries still written (`DropTotals.kv_entries_*`),
    over the first worker's rewritten graphs; None without drops (or an error text)."""
    if not isinstance(totals, list) or not totals or not isinstance(totals[0], list):
        return None
    prompt = sum(graph.get("kv_entries_prompt", 0) for graph in totals[0])
    return sum(graph.get("kv_entries_written", 0) for graph in totals[0]) / prompt if prompt else None


def token_prompts(length: int, batch: int, tag: str, vocab_size: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `length` token ids; `tag` (e.g. "warm", "timed")
    makes prompts of different runs differ too. Deterministic."""
    span = max(1, min(ID_SPAN, vocab_size - ID_LOW))
    rows = []
    for row in range(batch):
        rng = random.Random(f"{tag}/{length}/{batch}/{row}")
        rows.append([ID_LOW + rng.randrange(span) for _ in range(length)])
    assert len({tuple(r[:64]) for r in rows}) == batch, "prompts of one batch must differ"
    return rows


def request_metrics(outputs, called: float | None = None, returned: float | None = None) -> dict:
    """Engine-side prefill timing from RequestOutput.metrics (the engine core's `time.monotonic()`). With `called` /
    `returned`, this process's `time.monotonic()` around the `generate` call (one clock for every process on Linux),
    also the time before the engine queued the first request and after it stamped the last first token: where a
    wall time longer than the engine's span goes (on 2026-12-05 a 32K Gemma-3-270M prefill spent 28 ms more outside
    the span with uniprefill than without)."""
    stats = [getattr(o, "metrics", None) for o in outputs]
    if not stats or any(s is None or not getattr(s, "first_token_ts", 0) for s in stats):
        return {"available": False}
    scheduled = [s.scheduled_ts for s in stats]
    first = [s.first_token_ts for s in stats]
    queued = min(s.queued_ts for s in stats)
    out = {"available": True, "span_s": round(max(first) - min(scheduled), 4),
           "per_request_prefill_s": [round(f - s, 4) for f, s in zip(first, scheduled)],
           "queued_to_first_token_s": round(max(first) - queued, 4)}
    if called is not None and returned is not None:
        out["call_to_queued_s"] = round(queued - called, 4)
        out["first_token_to_return_s"] = round(returned - max(first), 4)
    return out


def decode_metrics(outputs, decode_tokens: int) -> dict:
    """Time per output token after the first, from the engine's timestamps (last_token_ts -
    first_token_ts over the tokens between them), median and max over the batch's requests."""
    stats = [getattr(o, "metrics", None) for o in outputs]
    if not stats or any(s is None or not getattr(s, "last_token_ts", 0) for s in stats):
        return {"available": False}
    per_token = sorted((s.last_token_ts - s.first_token_ts) / decode_tokens * 1e3 for s in stats)
    return {"available": True, "tokens_after_first": decode_tokens,
            "ms_per_token_median": round(per_token[len(per_token) // 2], 3), "ms_per_token_max": round(per_token[-1], 3),
            "all_generated": all(len(o.outputs[0].token_ids) == decode_tokens + 1 for o in outputs)}


def run_throughput(llm, lengths: list[int], batches: list[int], vocab_size: int, points: list, save,
                   decode_tokens: int = 0, repeats: int = 1) -> None:
    """Appends one dict per (length, batch) to `points`, calling save() after each. `repeats` timed
    calls per point, each on fresh prompts, give its median (a small model's prefill takes milliseconds,
    so one call is noise). With
    `decode_tokens`, each point also generates that many tokens after the first from fresh
    prompts of the same shape and records the time per output token (`decode_metrics`)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode_params = SamplingParams(max_tokens=1 + decode_tokens, temperature=0.0, ignore_eos=True)
    for length in lengths:
        # Warm-up per length, at every batch of the grid: a step of several prompts may compile what one of fewer
        # does not. On 2026-12-01 Gemma-3-270M's first multi-request drop (8192 x 4) took 2.1 s instead of ~0.2 s
        # after a one-prompt warm-up (likely Triton specialising integer arguments equal to 1, a sequence count);
        # on 2026-12-05 the Qwen3-Next shape's 8192 x 4 point took 7.8 s after warm-ups of 1 and 2 prompts:
        # FlashInfer's GDN prefill takes another kernel (compiled at its first use) from 3 sequences in a step on
        # (`num_seqs * heads >= SMs / 2`), which only a one-step prefill of 4 prompts reached.
        t0 = time.perf_counter()
        for warm_batch in sorted({1, *batches}):
            warm = [{"prompt_token_ids": ids} for ids in token_prompts(length, warm_batch, "warm", vocab_size)]
            llm.generate(warm, params, use_tqdm=False)
        warm_s = time.perf_counter() - t0
        for batch in batches:
            runs = []  # (seconds, outputs, monotonic at the call and return) per repeat, each on prompts of its own
            for repeat in range(repeats):
                tag = "timed" if repeat == 0 else f"timed{repeat}"
                batch_prompts = [{"prompt_token_ids": ids} for ids in token_prompts(length, batch, tag, vocab_size)]
                t0, called = time.perf_counter(), time.monotonic()
                outputs = llm.generate(batch_prompts, params, use_tqdm=False)
                runs.append((time.perf_counter() - t0, outputs, called, time.monotonic()))
            seconds, outputs, called, returned = sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2]  # median
            engine = request_metrics(outputs, called, returned)
            point = {
                "length": length, "batch": batch, "seconds": round(seconds, 4),
                "seconds_each": [round(run[0], 4) for run in runs],
                "tokens_per_s": round(batch * length / seconds, 1), "warmup_s_for_length": round(warm_s, 3),
                "prompt_lengths_ok": all(len(o.prompt_token_ids) == length for o in outputs),
                "cached_tokens": max((o.num_cached_tokens or 0) for o in outputs),
                "engine": engine,
            }
            if engine.get("available") and engine["span_s"] > 0:
                point["engine_tokens_per_s"] = round(batch * length / engine["span_s"], 1)
            if decode_tokens:
                decode_prompts = [{"prompt_token_ids": ids} for ids in token_prompts(length, batch, "decode", vocab_size)]
                point["decode"] = decode_metrics(llm.generate(decode_prompts, decode_params, use_tqdm=False),
                                                 decode_tokens)
            points.append(point)
            decode = point.get("decode", {})
            print(f"throughput: L={length} B={batch}: {seconds:.3f} s, {point['tokens_per_s']:.0f} tok/s"
                  f" (engine {point.get('engine_tokens_per_s', 'n/a')} tok/s), cached {point['cached_tokens']}"
                  + (f", decode {decode['ms_per_token_median']} ms/token" if decode.get("available") else ""),
                  flush=True)
            save()
