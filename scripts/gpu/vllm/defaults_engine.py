"""One vLLM engine on its DEFAULT settings, with or without the one uniprefill option (GPU box).

    python3 -P scripts/gpu/vllm/defaults_engine.py --model-dir /tmp/smollm2-135m --parity 120 --out $OUT/std.json
    python3 -P scripts/gpu/vllm/defaults_engine.py --model-dir /tmp/smollm2-135m --parity 120 \\
        --uniprefill '{"p": 1.0, "vllm_drop": true}' --out $OUT/p1.json
    python3 -P scripts/gpu/vllm/defaults_engine.py --layers 32 --throughput-lengths 8192,16384 \\
        --throughput-batches 1,4 --uniprefill '{"keep_ratio": 0.3, "drop_layers": [7], "vllm_drop": true}' --out ...

"Defaults" means `LLM(model, max_model_len=..., seed=0, disable_log_stats=False[, load_format="dummy"][, compilation_config=
{"inductor_compile_config": {"uniprefill": SETTINGS}}])` and nothing else: compilation mode 3
(Inductor, piecewise CUDA graphs), AOT compile, cudagraph_mode, chunked prefill with vLLM's own
step budget, prefix caching. The JSON records what vLLM settled on (mode, cudagraph mode, budget,
chunking, caching, AOT compile), the engine's start time, and:

* `--parity N`: N prompts of mixed lengths (log-spaced from 32 tokens to `max_model_len` - 64,
  cut from the haystack with the model's tokenizer), greedy, 16 new tokens each: the token ids
  (`compare_engines.py` compares two runs token for token); all at once (vLLM batches them as they
  arrive: the steps' composition depends on timing) or, `--parity-sequential`, one at a time;
  `--parity-logprobs` adds each token's logprob (where two runs' numbers first part); `--parity-repeat`
  generates the same prompts a second time, each request's cached prompt tokens recorded (prefix-cache hits
  on the blocks the first pass published: a dropping request publishes those of its earlier chunks only),
  with the second pass's token ids (`compare_engines.py` counts the prompts the two passes agree on);
  `--parity-sequential-after` then empties the prefix cache and generates them once more, one at a time
  (`chunked_parity.py --pass sequential_after`: whether the prompts that parted batched part alone);
  `--record-steps` (not a default: the engine core in this process) records the first pass's schedule;
* `--throughput-lengths/--throughput-batches`: `uniprefill.vllm.measure.run_throughput` (prefill
  tokens/s of B prompts of exactly L tokens, engine timestamps; `--decode-tokens` more for ms per
  output token);
* `--needles LENGTHS`: RULER-style needle prompts (`uniprefill.eval.paired.make_prompts`, the prompts
  of `uniprefill eval` and `needle_parity.py`), greedy, scored records to `--needles-out` (JSONL;
  `needle_parity.py compare` pairs two runs);
* with the option: the drop totals of every worker (`collect_drop_totals`).

`--max-num-batched-tokens` and `--cudagraph-mode` depart from the defaults on purpose (experiments on
vLLM's step budget, where a smaller one chunks more prompts and a larger one prefills them in one step,
and on decode without full CUDA graphs); the JSON's `llm_kwargs` says so.

Run each engine in its own process (a fresh GPU), back to back; `scripts/gpu/vllm/defaults_grid.sh`
runs the sets of docs/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

HAYSTACK = Path(os.environ.get("UNIPREFILL_HAYSTACK", "/tmp/eval/PaulGrahamEssays.json"))


def parity_prompts(tokenizer, count: int, longest: int) -> list[list[int]]:
    """`count` prompts of log-spaced lengths in [32, longest], each a different window of the haystack."""
    data = json.loads(HAYSTACK.read_text())
    text = data["text"] if isinstance(data, dict) else " ".join(item.get("text", "") for item in data)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = []
    for i in range(count):
        length = int(round(math.exp(math.log(32) + (math.log(longest) - math.log(32)) * i / max(count - 1, 1))))
        start = (i * 7919) % max(1, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def settled(llm) -> dict:
    config = llm.llm_engine.vllm_config
    cc, sched, cache = config.compilation_config, config.scheduler_config, config.cache_config
    from vllm import envs

    return {"mode": str(cc.mode), "cudagraph_mode": str(cc.cudagraph_mode), "splitting_ops": cc.splitting_ops,
            "max_num_batched_tokens": sched.max_num_batched_tokens, "chunked_prefill": sched.enable_chunked_prefill,
            "prefix_caching": cache.enable_prefix_caching, "aot_compile": bool(envs.VLLM_USE_AOT_COMPILE),
            "max_num_seqs": sched.max_num_seqs}


class record_steps:
    """Wraps the in-process scheduler's `schedule()` until `stop()`: every step's (request id, tokens scheduled,
    tokens computed before) for the requests it scheduled."""

    def __init__(self, llm) -> None:
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # InprocClient -> EngineCore
        if core is None:
            raise RuntimeError("--record-steps needs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        self.scheduler, self.steps = core.scheduler, []
        original = self.original = self.scheduler.schedule

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
            cached = out.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens))
            if out.num_scheduled_tokens:
                self.steps.append([[rid, n, computed.get(rid)] for rid, n in out.num_scheduled_tokens.items()])
            return out

        self.scheduler.schedule = schedule

    def stop(self) -> None:
        self.scheduler.schedule = self.original

    def by_prompt(self, first: int) -> list[list[list[int]]]:
        """Each step as [[prompt index, tokens, computed before], ...] sorted by prompt (request ids "N-suffix":
        the prompt index is N - `first`)."""
        return [sorted([int(rid.split("-")[0]) - first, n, c] for rid, n, c in step) for step in self.steps]


def run_needles(llm, args, sampling_params) -> dict:
    """The needle prompts in one `generate` call (vLLM batches them continuously); scored records to
    `args.needles_out`; returns the score per length."""
    from uniprefill.eval.paired import make_prompts, score_records

    samples = make_prompts(llm.get_tokenizer(), args.needle_tasks.split(","),
                           [int(x) for x in args.needles.split(",")], args.needle_samples, HAYSTACK)
    params = [sampling_params(temperature=0.0, max_tokens=s.max_new_tokens, stop=["\n"] if s.stop_at_newline else None)
              for s in samples]
    start = time.perf_counter()
    outputs = llm.generate([s.prompt for s in samples], params, use_tqdm=False)
    seconds = round(time.perf_counter() - start, 2)
    system = "uniprefill" if args.uniprefill is not None else "standard"
    records = score_records(samples, [o.outputs[0].text for o in outputs], system,
                            {"settings": json.loads(args.uniprefill or "null")})
    out = args.needles_out or args.out.with_suffix(".needles.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    by_length: dict = {}
    for r in records:
        by_length.setdefault(r["length"], []).append(r["score"])
    return {"seconds": seconds, "prompts": len(records), "records": str(out),
            "score_by_length": {k: round(100 * sum(v) / len(v), 1) for k, v in sorted(by_length.items())}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="a real HF model folder")
    parser.add_argument("--layers", type=int, default=32, help="without --model-dir: a dummy Llama-3.1-8B shape")
    parser.add_argument("--qwen3next-layers", type=int, default=0,
                        help="a dummy Qwen3-Next-80B-A3B shape of this many layers (a full-attention layer every 4th)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's (8192 dummy)")
    parser.add_argument("--uniprefill", default=None, help="JSON of the uniprefill settings (the one option)")
    parser.add_argument("--inductor", default=None,
                        help="JSON of Inductor options for inductor_compile_config (a control run: what uniprefill's "
                             "hook changes there, without uniprefill)")
    parser.add_argument("--compile-ranges-endpoints", default=None,
                        help="comma-separated compilation_config.compile_ranges_endpoints (a control run: a step budget "
                             "raised past vLLM's default, with vLLM's default kept as the end of a compiled range)")
    parser.add_argument("--parity", type=int, default=0)
    parser.add_argument("--parity-tokens", type=int, default=16)
    parser.add_argument("--parity-sequential", action="store_true",
                        help="generate the parity prompts one at a time (every step holds one request: no "
                             "batch composition, which vLLM's kernels are not invariant to, enters the comparison)")
    parser.add_argument("--parity-logprobs", action="store_true",
                        help="also record each generated token's logprob (compare_engines.py finds the first "
                             "position where two runs' logprobs differ: the prefill's, or a decode step's)")
    parser.add_argument("--parity-repeat", action="store_true",
                        help="generate the parity prompts again, after the first pass: prefix-cache hits")
    parser.add_argument("--parity-sequential-after", action="store_true",
                        help="after the passes above, empty the prefix cache and generate the parity prompts once more, "
                             "one at a time (a diagnosis in one engine: every chunked prompt then splits at the step "
                             "budget alone, whatever the batched pass's composition was)")
    parser.add_argument("--spread-dummy-weights", type=float, default=0.0,
                        help="with dummy weights: refill every matrix with normal(0, STD) after the engine started "
                             "(word_llama.spread_dummy_weights; the same in every engine), so that outputs depend on "
                             "the prompt (vLLM's own dummy weights give the Qwen3-Next shape flat logits)")
    parser.add_argument("--record-steps", action="store_true",
                        help="NOT a default: run the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so "
                             "every request of a pass is added before the first step) and record each step of the "
                             "first parity pass: which prompt got how many tokens over how many computed ones "
                             "(chunked_parity.py compares two runs' schedules)")
    parser.add_argument("--throughput-lengths", default="")
    parser.add_argument("--throughput-batches", default="1,4")
    parser.add_argument("--decode-tokens", type=int, default=0)
    parser.add_argument("--throughput-repeats", type=int, default=1,
                        help="timed calls per point, each on fresh prompts; the median counts")
    parser.add_argument("--needles", default="", help="comma-separated needle prompt lengths")
    parser.add_argument("--needle-samples", type=int, default=10, help="prompts per task and length")
    parser.add_argument("--needle-tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1")
    parser.add_argument("--needles-out", type=Path, default=None, help="JSONL of the scored needle answers")
    parser.add_argument("--cudagraph-mode", default=None,
                        help="NOT a default: compilation_config's cudagraph_mode (a diagnosis: PIECEWISE decodes "
                             "without full graphs)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="NOT a default: vLLM's step budget, for the chunking experiments")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collect_drop_totals: a function over RPC
    if args.record_steps:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process, where it can be watched

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    from uniprefill.vllm.measure import run_throughput

    summary: dict = {"python": platform.python_version(), "vllm": vllm.__version__, "torch": torch.__version__,
                     "device": torch.cuda.get_device_name(0), "uniprefill": json.loads(args.uniprefill or "null")}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1, default=str))

    kwargs: dict = {"seed": 0, "disable_log_stats": False}  # engine timestamps (TTFT, decode): observability only
    if args.qwen3next_layers:
        from uniprefill.testing import word_llama

        folder = Path(f"/tmp/qwen3-next-80b-shaped-{args.qwen3next_layers}")
        word_llama.write_qwen3_next_folder(folder, word_llama.qwen3_next_layer_types(args.qwen3next_layers),
                                           word_llama.QWEN3_NEXT_80B_A3B)
        kwargs["load_format"] = "dummy"
        kwargs["max_model_len"] = args.max_model_len or 32768
    elif args.model_dir is None:
        from uniprefill.testing.word_llama import write_model_folder

        folder = Path(f"/tmp/llama8b-shaped-{args.layers}")
        write_model_folder(folder, args.layers)
        kwargs["load_format"] = "dummy"
        kwargs["max_model_len"] = args.max_model_len or 32768
    else:
        folder = args.model_dir
        if args.max_model_len:
            kwargs["max_model_len"] = args.max_model_len
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    inductor = json.loads(args.inductor) if args.inductor else {}
    if args.uniprefill is not None:
        inductor["uniprefill"] = json.loads(args.uniprefill)
    compilation: dict = {"cudagraph_mode": args.cudagraph_mode} if args.cudagraph_mode else {}
    if args.compile_ranges_endpoints:
        compilation["compile_ranges_endpoints"] = [int(x) for x in args.compile_ranges_endpoints.split(",")]
    if inductor:
        compilation["inductor_compile_config"] = inductor
    if compilation:
        kwargs["compilation_config"] = compilation
    summary["model"], summary["llm_kwargs"] = str(folder), dict(kwargs)
    save()
    start = time.perf_counter()
    llm = LLM(model=str(folder), tokenizer=str(folder), **kwargs)
    summary["engine_init_s"] = round(time.perf_counter() - start, 1)
    if args.spread_dummy_weights:
        if kwargs.get("load_format") != "dummy":
            raise SystemExit("--spread-dummy-weights is for dummy weights only")
        from uniprefill.testing.word_llama import spread_dummy_weights

        summary["spread_dummy_weights"] = {"std": args.spread_dummy_weights, "refilled": llm.collective_rpc(
            spread_dummy_weights, args=(args.spread_dummy_weights, 0))}
    summary["settled"] = settled(llm)
    max_len = llm.llm_engine.model_config.max_model_len
    save()
    if args.parity:
        prompts = parity_prompts(llm.get_tokenizer(), args.parity, max_len - args.parity_tokens - 48)
        params = SamplingParams(max_tokens=args.parity_tokens, temperature=0.0, ignore_eos=True,
                                logprobs=0 if args.parity_logprobs else None)
        start = time.perf_counter()
        requests = [{"prompt_token_ids": p} for p in prompts]
        def run_all():  # as the first pass runs, so does the repeat: one at a time, or all at once
            if args.parity_sequential:
                return [llm.generate([r], params, use_tqdm=False)[0] for r in requests]
            return llm.generate(requests, params, use_tqdm=False)

        steps = record_steps(llm) if args.record_steps else None
        try:
            outputs = run_all()
        finally:
            if steps is not None:
                steps.stop()
        summary["parity"] = {"seconds": round(time.perf_counter() - start, 2), "sequential": args.parity_sequential,
                             "prompt_lengths": [len(p) for p in prompts],
                             "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs]}
        summary["parity"]["cached_tokens"] = [o.num_cached_tokens or 0 for o in outputs]
        if steps is not None:
            summary["parity"]["steps"] = steps.by_prompt(first=int(outputs[0].request_id.split("-")[0]))
        if args.parity_repeat:
            start = time.perf_counter()
            again = run_all()
            summary["parity"]["repeat"] = {"seconds": round(time.perf_counter() - start, 2),
                                           "cached_tokens": [o.num_cached_tokens or 0 for o in again],
                                           "output_token_ids": [list(o.outputs[0].token_ids) for o in again]}
        def logprobs(outs):  # the sampled token's logprob at each position (float32 from vLLM's sampler)
            return [[step[token].logprob for token, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                    for o in outs]

        if args.parity_logprobs:
            summary["parity"]["output_logprobs"] = logprobs(outputs)
        if args.parity_sequential_after:
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not empty its prefix cache: a sequential pass would read the first's blocks")
            start = time.perf_counter()
            alone = [llm.generate([r], params, use_tqdm=False)[0] for r in requests]
            summary["parity"]["sequential_after"] = {
                "seconds": round(time.perf_counter() - start, 2),
                "cached_tokens": [o.num_cached_tokens or 0 for o in alone],
                "output_token_ids": [list(o.outputs[0].token_ids) for o in alone]}
            if args.parity_logprobs:
                summary["parity"]["sequential_after"]["output_logprobs"] = logprobs(alone)
        save()
    if args.needles:
        summary["needles"] = run_needles(llm, args, SamplingParams)
        save()
    if args.throughput_lengths:
        lengths = [int(x) for x in args.throughput_lengths.split(",")]
        batches = [int(x) for x in args.throughput_batches.split(",")]
        summary["throughput"] = {"points": []}
        run_throughput(llm, lengths, batches, llm.llm_engine.model_config.get_vocab_size(),
                       summary["throughput"]["points"], save, decode_tokens=args.decode_tokens,
                       repeats=args.throughput_repeats)
    if args.uniprefill is not None:
        from uniprefill.vllm.runner_hook import collect_drop_totals

        summary["drop_totals"] = collect_drop_totals(llm)
    save()
    print(json.dumps({k: v for k, v in summary.items() if k not in ("parity",)}, default=str)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
