"""Smoke test and prefill throughput of vLLM on the GPU box (dummy Llama-shaped or real model).

    python3 scripts/gpu/vllm/smoke_llm.py --out $OUT/smoke-llama8b.json              # standard vLLM, dummy 8B
    python3 scripts/gpu/vllm/smoke_llm.py --layers 4 --uniprefill --out $OUT/x.json  # the uniprefill channel
    python3 scripts/gpu/vllm/smoke_llm.py --model-dir /tmp/gemma-270m --kv-cache-gib 4 \\
        --max-model-len 32768 --throughput-lengths 8192,16384,32000 --throughput-batches 1,4,16 --out $OUT/g.json
    python3 scripts/gpu/vllm/smoke_llm.py --model-dir /tmp/gemma-270m --dump-graph --max-model-len 4096 ...

Model. Without --model-dir: writes a Llama-3.1-8B-shaped config (hidden 4096, `--layers`
layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256, llama3 RoPE scaling) and a word-level
tokenizer built with `tokenizers` into a folder, then loads it with `load_format="dummy"`
(random weights: the text is gibberish; the test is that the engine builds, compiles, captures
CUDA graphs and generates), and generates `--num-prompts` word prompts. With --model-dir: the
folder's real weights and tokenizer, and greedy texts (16 tokens) for TEXT_PROMPTS.

Channel. "Standard vLLM" is the default configuration (mode 3, CUDA graphs on). `--uniprefill`
uses the channel of docs/vllm.md (mode 2, backend "uniprefill.vllm.plugin.vllm_backend");
by default the backend runs the graph unaccelerated and logs "running the vLLM graph
unaccelerated" with the number of attention ops it saw (the check that vLLM handed over the
whole backbone graph); with "vllm_drop": true in --uniprefill-settings it runs the experimental
rewrite and logs "EXPERIMENTAL token dropping inside vLLM". `--dump-graph` uses mode 2 with
scripts/gpu/vllm/dump_backend.py, which writes the graph and the forward context of its first
calls into $UNIPREFILL_VLLM_DUMP_DIR (default /tmp/vllm-dump). Debugging: SMOKE_CUDAGRAPH_MODE
(e.g. NONE) sets the channel's `compilation_config.cudagraph_mode`; UNIPREFILL_VLLM_REWRITE_DUMP
(uniprefill.env) writes the rewritten graph's code.

Memory. On a GPU shared with another job, pass `--kv-cache-gib G` (vLLM's
`kv_cache_memory_bytes`: the KV cache gets exactly G GiB and vLLM skips its memory profiling)
and a modest `--gpu-memory-utilization` (vLLM still checks at start-up that this fraction of
the GPU's memory is free).

Throughput (`--throughput-lengths`, `--throughput-batches`): for each length L, one warm-up
generate (one prompt), then for each batch B one timed `llm.generate` of B distinct prompts of
exactly L token ids, SamplingParams(max_tokens=1). tokens/s = B*L / wall seconds around
generate; also from the engine's request timestamps (first_token_ts - scheduled_ts) when
vLLM provides them. Prefix caching and chunked prefill are off and max_num_batched_tokens is
at least max_model_len, so every prompt is prefilled whole in one step and nothing is served
from a cache. The JSON is rewritten after every point, so a timeout keeps what was measured.

Run it from the repository root with scripts/gpu/vllm/env.sh sourced.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from uniprefill import env
from uniprefill.vllm.engine_settings import compilation_config
from uniprefill.vllm.measure import kv_written_share, ranks_agree, run_throughput
from uniprefill.testing.word_llama import LLAMA_8B, WORDS, prompts, write_model_folder  # noqa: F401

HERE = Path(__file__).resolve().parent
TEXT_PROMPTS = ["The Eiffel Tower is located in the city of", "The capital of France is"]
TEXT_MAX_TOKENS = 16
GIB = 1 << 30


def int_list(text: str) -> list[int]:
    """'8192,16384, 32000' -> [8192, 16384, 32000]; every value must be positive."""
    values = [int(part) for part in text.replace(" ", "").split(",") if part]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def engine_kwargs(args, lengths: list[int] | None) -> tuple[dict, dict]:
    """LLM(...) keyword arguments for the chosen model, channel and throughput settings, and
    the settings to record (max_model_len possibly raised to fit the longest prompt)."""
    kwargs: dict = {"dtype": args.dtype, "gpu_memory_utilization": args.gpu_memory_utilization,
                    "enforce_eager": args.eager, "enable_flashinfer_autotune": False, "seed": 0}
    max_model_len = args.max_model_len
    if lengths:
        max_model_len = max(max_model_len, max(lengths) + 1)
    kwargs["max_model_len"] = max_model_len
    if args.model_dir is None:
        kwargs["load_format"] = "dummy"
    if args.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * GIB)
    if lengths:
        kwargs["enable_prefix_caching"] = False
        kwargs["enable_chunked_prefill"] = args.chunked_prefill
        kwargs["max_num_batched_tokens"] = max(args.max_num_batched_tokens or max_model_len, max(lengths))
        if not args.chunked_prefill:
            kwargs["max_num_batched_tokens"] = max(kwargs["max_num_batched_tokens"], max_model_len)
        kwargs["disable_log_stats"] = False  # RequestOutput.metrics (engine timestamps)
    elif args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.uniprefill:
        kwargs["compilation_config"] = compilation_config(json.loads(args.uniprefill_settings), mode=2,
                                                          decode_graphs=args.decode_graphs)
        if not args.decode_graphs and os.environ.get("SMOKE_CUDAGRAPH_MODE"):  # debugging: e.g. NONE
            kwargs["compilation_config"]["cudagraph_mode"] = os.environ["SMOKE_CUDAGRAPH_MODE"]
        # token dropping refuses prefix caching (a dropped request's blocks must not be reused)
        kwargs["enable_prefix_caching"] = False
    elif args.dump_graph:
        kwargs["compilation_config"] = {"mode": 2, "backend": "dump_backend.backend"}
    return kwargs, {"max_model_len": max_model_len}


def attention_backends(worker) -> list[dict]:
    """Run in the worker (collective_rpc): the attention backend of each attention group."""
    runner = getattr(worker, "model_runner", None)
    out = []
    for groups in getattr(runner, "attn_groups", None) or []:
        for group in groups:
            backend = group.backend
            spec = group.kv_cache_spec
            out.append({
                "backend": backend.get_name() if hasattr(backend, "get_name") else backend.__name__,
                "class": f"{backend.__module__}.{backend.__qualname__}",
                "kv_cache_group": group.kv_cache_group_id, "num_layers": len(group.layer_names),
                "first_layer": group.layer_names[0] if group.layer_names else None,
                "kv_cache_spec": type(spec).__name__, "sliding_window": getattr(spec, "sliding_window", None),
                "block_size": getattr(spec, "block_size", None),
            })
    return out or [{"runner": type(runner).__name__, "note": "no attn_groups found"}]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="layers of the dummy Llama-shaped model")
    parser.add_argument("--folder", type=Path, default=None,
                        help="dummy model folder (default /tmp/llama8b-shaped-<layers>)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a real HF model folder (its weights and tokenizer) instead of the dummy model")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16", help="vLLM dtype (bfloat16, float32, auto)")
    parser.add_argument("--prompt-words", type=int, default=2000)
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="word prompts to generate (default 4 for the dummy model, 0 with --model-dir)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True (no torch.compile, no CUDA graphs)")
    parser.add_argument("--uniprefill", action="store_true", help="the uniprefill channel (mode 2)")
    parser.add_argument("--uniprefill-settings", default='{"p": 0.99}',
                        help="JSON of the UniPrefillConfig fields under inductor_compile_config['uniprefill']; "
                             "with \"vllm_drop\": true in it the experimental rewrite runs")
    parser.add_argument("--dump-graph", action="store_true",
                        help="mode 2 with scripts/gpu/vllm/dump_backend.py (writes $UNIPREFILL_VLLM_DUMP_DIR)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="kv_cache_memory_bytes in GiB")
    parser.add_argument("--throughput-lengths", type=int_list, default=None, help="e.g. 8192,16384,32000")
    parser.add_argument("--throughput-batches", type=int_list, default=[1, 4, 16], help="e.g. 1,4,16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="with throughput: default max_model_len (never below the longest prompt)")
    parser.add_argument("--chunked-prefill", action="store_true",
                        help="with throughput: keep chunked prefill on (default off, so no prompt is split)")
    parser.add_argument("--no-texts", action="store_true", help="with --model-dir: skip the greedy texts")
    parser.add_argument("--decode-tokens", type=int, default=0,
                        help="with throughput: also time this many output tokens after the first at each point "
                             "(ms per output token from the engine's timestamps; decode runs without CUDA graphs "
                             "in the uniprefill channel)")
    parser.add_argument("--decode-graphs", action="store_true",
                        help="with --uniprefill: cudagraph_mode FULL_DECODE_ONLY and the option vllm_decode_graphs "
                             "(decode under CUDA graphs after drops; experimental)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="vLLM's tensor_parallel_size (needs that many GPUs); with dropping, the JSON's "
                             "ranks_agree says whether every rank dropped the same rows")
    parser.add_argument("--out", type=Path, default=None, help="JSON summary path")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the engine settings (LLM keyword arguments and environment) as JSON and exit, "
                             "without vLLM")
    args = parser.parse_args(argv)
    if args.uniprefill and args.dump_graph:
        parser.error("--uniprefill and --dump-graph both choose the compilation backend: pick one")
    if args.decode_graphs and not args.uniprefill:
        parser.error("--decode-graphs is a setting of the uniprefill channel: add --uniprefill")
    if args.num_prompts is None:
        args.num_prompts = 0 if args.model_dir else 4
    return args


def prepare_environment(args) -> None:
    """Environment that vLLM reads at import (the EngineCore subprocess inherits it)."""
    if args.uniprefill or args.dump_graph:
        env.prepare_vllm_channel()  # mode 2: no AOT compile; collective_rpc with functions
    if args.dump_graph:
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = str(HERE) + (os.pathsep + path if path else "")
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
    # collective_rpc with a function (attention_backends) needs pickle on vLLM's IPC.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model_dir is not None:
        folder = args.model_dir
        if not (folder / "config.json").is_file():
            print(f"no config.json in {folder}", file=sys.stderr)
            return 2
    else:
        folder = args.folder or Path(f"/tmp/llama8b-shaped-{args.layers}")
        if not args.dry_run:
            write_model_folder(folder, args.layers)
    prepare_environment(args)
    if args.dry_run:
        kwargs, recorded = engine_kwargs(args, args.throughput_lengths)
        env = {k: os.environ.get(k) for k in ("VLLM_USE_AOT_COMPILE", "VLLM_ALLOW_INSECURE_SERIALIZATION")}
        print(json.dumps({"engine_kwargs": kwargs, **recorded, "env": env}))
        return 0

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    lengths = args.throughput_lengths
    kwargs, recorded = engine_kwargs(args, lengths)
    summary = {
        "python": platform.python_version(), "vllm": vllm.__version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "model": str(folder), "real_weights": args.model_dir is not None,
        "layers": None if args.model_dir else args.layers, "eager": args.eager, "uniprefill": args.uniprefill,
        "dump_graph": args.dump_graph,
        "engine_kwargs": {k: v for k, v in kwargs.items()}, **recorded,
        "env": {k: os.environ.get(k) for k in ("PYTHONPATH", "VLLM_USE_FLASHINFER_SAMPLER", "HF_HUB_OFFLINE",
                                                "VLLM_USE_AOT_COMPILE", "UNIPREFILL_VLLM_DUMP_DIR",
                                                "VLLM_ALLOW_INSECURE_SERIALIZATION")},
    }

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(summary, indent=1, default=str))

    save()
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), tokenizer=str(folder), **kwargs)
    summary["engine_init_s"] = round(time.perf_counter() - t0, 1)
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        summary["gpu_memory_after_init_gib"] = {"free": round(free / GIB, 1), "total": round(total / GIB, 1)}
    try:
        summary["attention_backends"] = llm.collective_rpc(attention_backends, timeout=60)
    except Exception as exc:  # noqa: BLE001 - informative only
        summary["attention_backends"] = f"unavailable: {type(exc).__name__}: {str(exc)[:200]}"
    model_config = llm.llm_engine.model_config
    vocab_size = model_config.get_vocab_size()
    summary["vocab_size"] = vocab_size
    summary["max_num_batched_tokens_effective"] = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    save()
    checks = []

    if args.model_dir is not None and not args.no_texts:
        params = SamplingParams(max_tokens=TEXT_MAX_TOKENS, temperature=0.0)
        t0 = time.perf_counter()
        outputs = llm.generate(TEXT_PROMPTS, params, use_tqdm=False)
        summary["texts_s"] = round(time.perf_counter() - t0, 2)
        summary["texts"] = [{"prompt": p, "text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                             "prompt_token_ids": list(o.prompt_token_ids)} for p, o in zip(TEXT_PROMPTS, outputs)]
        for item in summary["texts"]:
            print(f"text: {item['prompt']!r} -> {item['text']!r}", flush=True)
        checks.append(all(item["token_ids"] for item in summary["texts"]))
        save()

    if args.num_prompts > 0:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        texts = prompts(args.num_prompts, args.prompt_words)
        t0 = time.perf_counter()
        outputs = llm.generate(texts, params, use_tqdm=False)
        summary["generate_s"] = round(time.perf_counter() - t0, 2)
        summary["prompt_tokens"] = [len(o.prompt_token_ids) for o in outputs]
        summary["output_token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
        checks.append(all(len(ids) == args.max_tokens for ids in summary["output_token_ids"]))
        save()

    if lengths:
        summary["throughput"] = {"lengths": lengths, "batches": args.throughput_batches, "max_tokens": 1,
                                 "prefix_caching": False, "chunked_prefill": args.chunked_prefill,
                                 "max_num_batched_tokens": kwargs["max_num_batched_tokens"], "points": []}
        run_throughput(llm, lengths, args.throughput_batches, vocab_size, summary["throughput"]["points"], save,
                       decode_tokens=args.decode_tokens)
        checks.append(all(p["prompt_lengths_ok"] and p["cached_tokens"] == 0 for p in summary["throughput"]["points"]))
        checks.append(all(p["decode"].get("all_generated", True) for p in summary["throughput"]["points"]
                          if "decode" in p))

    if args.uniprefill and json.loads(args.uniprefill_settings).get("vllm_drop"):  # did the engine drop, or not
        from uniprefill.vllm.runner_hook import collect_drop_totals

        summary["drop_totals"] = collect_drop_totals(llm)
        # KV memory a cache sized by the kept tokens would save (vLLM does not reclaim it)
        summary["kv_written_share"] = kv_written_share(summary["drop_totals"])
        if args.tensor_parallel_size > 1:  # the TP selection must take one decision on every rank
            summary["ranks_agree"] = ranks_agree(summary["drop_totals"])
            checks.append(summary["ranks_agree"] is True)
    summary["ok"] = bool(checks) and all(checks)
    save()
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
