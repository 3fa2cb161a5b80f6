"""Where one vLLM prefill's device time goes, standard vLLM or with the uniprefill option (GPU box; written after
Gemma-3-270M came out at 0.69-0.91x of standard vLLM on its defaults, 2026-12-04; run on 2026-12-04 and 05,
docs/results/vllm-gemma-profile-h200-2026-12-0*).

    python3 -P scripts/gpu/vllm/profile_prefill.py --model-dir /tmp/gemma-270m --length 32000 --out $OUT/std.json
    python3 -P scripts/gpu/vllm/profile_prefill.py --model-dir /tmp/gemma-270m --length 32000 \\
        --uniprefill '{"p": 0.95, "vllm_drop": true}' --out $OUT/p095.json
    python3 -P scripts/gpu/vllm/profile_prefill.py ... --uniprefill '{...}' --per-row-too --out $OUT/p095.json
    python3 -P scripts/gpu/vllm/profile_prefill.py --compare $OUT/std.json $OUT/p095.json
    python3 -P scripts/gpu/vllm/profile_prefill.py ... --own-process --out $OUT/p095-own.json   # walls only

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so torch.profiler sees the model runner's
kernels; everything else is vLLM's defaults (as `defaults_engine.py`; with uniprefill's option a prompt of up to
32K tokens is one step, standard vLLM's `LLM` budget of 16384 splits a 32000-token prompt in two). After warm-ups on prompts of their own, it
times `--repeats` prefills of one prompt of `--length` random token ids (median wall time), then profiles one
prefill (`max_tokens=1`) and one prefill plus `--decode-tokens` greedy tokens. The JSON holds, for each profile,
the device time per kernel (top 40) and per kind (`KINDS`: the window kernel, flash attention, GEMMs, Inductor's
Triton kernels, the score-and-select ops, copies, the rest), and the decode part as the difference of the two.
`--own-process` leaves the engine in its own process, as vLLM runs it by default and the throughput grid measures
it, and times the prefills only: on 2026-12-05 uniprefill's 32K Gemma-3-270M prefill took 88 ms in-process against
standard's 97, but 142 against 102 ms in the grid.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path

KINDS = (("inductor triton", r"^triton_"),  # Inductor's generated kernels, whatever they fuse
         ("window", r"^paged_window"),  # uniprefill's paged window kernels (kernels/paged_window)
         ("score/select", r"^_(softmax_stats|combine_stats|token_scores|block_means|select_blocks|kept_offsets|"
                          r"expand_kept)_kernel"),  # uniprefill's score-and-select kernels
         ("kv write", r"reshape_and_cache"), ("flash attention", r"flash|fmha"),
         ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|cublas"), ("copy/gather", r"copy|gather|index|scatter|cat"))


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def device_times(prof) -> dict[str, float]:
    """Device microseconds per kernel name (self time: each kernel counted once)."""
    out: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0.0)
        if us > 0 and event.device_type.name == "CUDA":
            out[event.key] = out.get(event.key, 0.0) + us
    return out


def host_times(prof, top: int = 30) -> list:
    """The host's self time per operator or runtime call (cudaStreamSynchronize, cudaMemcpyAsync: where the host
    waits for the device), top `top`, milliseconds."""
    rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.self_cpu_time_total > 0]
    return [[name[:120], round(us / 1e3, 3), count] for name, us, count in sorted(rows, key=lambda r: -r[1])[:top]]


def python_profile(fn, top: int = 40) -> dict:
    """cProfile of one call: the Python functions by own time and by cumulative time (milliseconds, calls)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, tottime, cumtime, callers)}

    def name(key):
        file, line, func = key
        return f"{'/'.join(file.split('/')[-3:])}:{line}({func})"

    def ranked(index):
        rows = sorted(stats.items(), key=lambda kv: -kv[1][index])[:top]
        return [[name(k), round(1e3 * v[index], 3), v[1]] for k, v in rows]
    return {"total_ms": round(1e3 * max(v[3] for v in stats.values()), 3), "by_own_time": ranked(2),
            "by_cumulative_time": ranked(3)}


def summary(times: dict[str, float]) -> dict:
    kinds: dict[str, float] = {}
    for name, us in times.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + us
    top = sorted(times.items(), key=lambda kv: -kv[1])[:40]
    return {"device_ms": round(sum(times.values()) / 1e3, 3),
            "by_kind_ms": {k: round(v / 1e3, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[name[:160], round(us / 1e3, 3)] for name, us in top]}


def profile(args) -> dict:
    if not args.own_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    from uniprefill.vllm.measure import token_prompts

    kwargs: dict = {"seed": 0, "max_model_len": args.max_model_len}
    if args.uniprefill:
        kwargs["compilation_config"] = {"inductor_compile_config": {"uniprefill": json.loads(args.uniprefill)}}
    llm = LLM(model=str(args.model_dir), tokenizer=str(args.model_dir), **kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=1 + args.decode_tokens, temperature=0.0, ignore_eos=True)

    def run(tag: str, params) -> float:
        prompt = [{"prompt_token_ids": token_prompts(args.length, 1, tag, vocab)[0]}]  # built before the clock starts
        sync = (lambda: None) if args.own_process else torch.cuda.synchronize  # no CUDA in this process then
        sync()
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        sync()
        return time.perf_counter() - start

    def measure(tag: str) -> dict:
        for i in range(3):
            run(f"{tag}warm{i}", decode)
        walls = [run(f"{tag}timed{i}", prefill) for i in range(args.repeats)]
        out = {"prefill_wall_ms_median": round(1e3 * statistics.median(walls), 3),
               "prefill_wall_ms": [round(1e3 * w, 3) for w in walls]}
        if args.own_process:  # the engine core's kernels are in another process: walls only
            return out
        if args.host:  # the host's side before any torch.profiler session (CUPTI can slow later launches)
            for label, params in (("prefill", prefill), ("prefill+decode", decode)):
                out[f"host_python_{label}"] = python_profile(lambda: run(f"{tag}cprofiled-{label}", params))
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        profiles = {}
        for label, params in (("prefill", prefill), ("prefill+decode", decode)):
            with torch.profiler.profile(activities=activities) as prof:
                run(f"{tag}profiled-{label}", params)
            profiles[label] = device_times(prof)
            out[label] = summary(profiles[label])
            out[label]["host_top_ms"] = host_times(prof)
        names = set(profiles["prefill"]) | set(profiles["prefill+decode"])
        out["decode_part"] = summary({n: profiles["prefill+decode"].get(n, 0.0) - profiles["prefill"].get(n, 0.0)
                                      for n in names})
        return out

    result = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}} | measure("")
    if args.per_row_too and not args.own_process:  # the same engine again with the per-row window kernel in prefill steps (the A/B aid is
        os.environ["UNIPREFILL_DEBUG_PER_ROW_WINDOW"] = "1"  # read at each step; decode graphs keep what they captured)
        result["per_row"] = measure("per-row-")
    return result


def compare(a: dict, b: dict) -> str:
    lines = [f"prefill wall ms (median): {a['prefill_wall_ms_median']} -> {b['prefill_wall_ms_median']}"]
    for part in (part for part in ("prefill", "decode_part") if part in a and part in b):  # not with --own-process
        lines.append(f"{part}: device ms {a[part]['device_ms']} -> {b[part]['device_ms']}")
        for kind in sorted(set(a[part]["by_kind_ms"]) | set(b[part]["by_kind_ms"])):
            lines.append(f"  {kind:16s} {a[part]['by_kind_ms'].get(kind, 0.0):9.3f} -> "
                         f"{b[part]['by_kind_ms'].get(kind, 0.0):9.3f}")
    for key in ("tiled", "per_row"):  # "tiled": results of 2026-12-04, when the per-row kernel ran by default
        if key in b:
            lines.append(f"-- the same engine with the {key.replace('_', '-')} window kernel in prefill steps:")
            lines.append(compare(a, b[key]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--length", type=int, default=32000)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--uniprefill", default=None, help="JSON of the uniprefill settings (the one option)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--host", action="store_true",
                        help="also the host's side: cProfile of one prefill and one prefill+decode, and the top "
                             "host calls of the torch.profiler sessions")
    parser.add_argument("--per-row-too", action="store_true",
                        help="then time and profile again with the per-row window kernel in prefill steps "
                             "(UNIPREFILL_DEBUG_PER_ROW_WINDOW)")
    parser.add_argument("--own-process", action="store_true",
                        help="the engine in its own process, as vLLM runs it by default (the throughput grid's "
                             "setting): prefill walls only, no profiles (torch.profiler sees one process)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("STANDARD", "OTHER"))
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(*(json.loads(p.read_text()) for p in args.compare)))
        return 0
    if args.model_dir is None or args.out is None:
        parser.error("--model-dir and --out are needed to profile")
    result = profile(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    for label, one in (("", result), ("per-row: ", result.get("per_row"))):
        if one and args.own_process:
            print(label + json.dumps({"prefill_wall_ms_median": one["prefill_wall_ms_median"],
                                      "prefill_wall_ms": one["prefill_wall_ms"]}))
        elif one:
            print(label + json.dumps({"prefill_wall_ms_median": one["prefill_wall_ms_median"]} | {
                part: {"device_ms": one[part]["device_ms"], "by_kind_ms": one[part]["by_kind_ms"]}
                for part in ("prefill", "decode_part")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
