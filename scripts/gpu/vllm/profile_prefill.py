"""Where one vLLM prefill's device time goes, standard vLLM or with the uniprefill option (GPU box; written after
Gemma-3-270M came out at 0.69-0.91x of standard vLLM on its defaults, 2026-12-04; run on 2026-12-04 and 05,
docs/results/vllm-gemma-profile-h200-2026-12-0*).

    python3 -P scripts/gpu/vllm/profile_prefill.py --model-dir /tmp/gemma-270m --length 32000 --out $OUT/std.json
    python3 -P scripts/gpu/vllm/profile_prefill.py --model-dir /tmp/gemma-270m --length 32000 \\
        --uniprefill '{"p": 0.95, "vllm_drop": true}' --out $OUT/p095.json
    python3 -P scripts/gpu/vllm/profile_prefill.py ... --uniprefill '{...}' --per-row-too --out $OUT/p095.json
    python3 -P scripts/gpu/vllm/profile_prefill.py --compare $OUT/std.json $OUT/p095.json
    python3 -P scripts/gpu/vllm/profile_prefill.py ... --own-process --out $OUT/p095-own.json   # walls only
    python3 -P scripts/gpu/vllm/profile_prefill.py ... --own-process --trace-dir $OUT/trace --out $OUT/p095-own.json

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so torch.profiler sees the model runner's
kernels; everything else is vLLM's defaults (as `defaults_engine.py`; with uniprefill's option a prompt of up to
32K tokens is one step, standard vLLM's `LLM` budget of 16384 splits a 32000-token prompt in two). After warm-ups on prompts of their own, it
times `--repeats` prefills of one prompt (`--batch` prompts at once) of `--length` random token ids (median wall time), then profiles one
prefill (`max_tokens=1`) and one prefill plus `--decode-tokens` greedy tokens (`--decode-walls`: timed too, the decode's
wall per token from the medians; `--early-tokens K`: the same prompts with K tokens too, so the first K decode steps
after the prefill get a wall per token of their own). Timed and profiled prefills run from an empty prefix cache, and the prefill-only and
prefill+decode runs take the same prompts (since 2026-12-07: before, two prompts, whose p-driven drops differ, so
run ab's decode parts carry the two prefills' difference). The JSON holds, for each profile,
the device time per kernel (top 40) and per kind (`KINDS`: the window kernel, flash attention, GEMMs, Inductor's
Triton kernels, the score-and-select ops, copies, the rest), and the decode part as the difference of the two.
`--own-process` leaves the engine in its own process, as vLLM runs it by default and the throughput grid measures
it, and times the prefills only: on 2026-12-05 uniprefill's 32K Gemma-3-270M prefill took 88 ms in-process against
standard's 97, but 142 against 102 ms in the grid. With `--trace-dir` it then also asks the engine's own process for
what it did around the timed prefills (`collective_rpc`, which needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 for a
function: set here, a diagnosis run) and records one more prefill with vLLM's own profiler (`profiler_config`,
torch, no stacks) there: the caching allocator's device mallocs, frees and retries, the garbage collector's pauses,
and the trace's step by step summary (`trace_summary`: host time of the step, the device's busy time, the CUDA
runtime calls that wait, by name). With `--decode-walls` too, one prefill plus the decode is traced as well, and its
`decode_steps` give each decode step's period against the device's busy time in it (where the server's decode gap
after a drop would show: the engine in its own process, vLLM's asynchronous scheduling; `sync_check.py` names the
host waits).
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


def python_profile(fn, top: int = 40, dump: Path | None = None) -> dict:
    """cProfile of one call: the Python functions by own time and by cumulative time (milliseconds, calls);
    `dump`: the raw stats too (`python -m pstats FILE` reads them)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    if dump is not None:
        dump.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(dump))
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


# ----------------------------------------------------------------------------- the engine's own process (--trace-dir)
_MEMORY_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms",
                "allocated_bytes.all.peak", "reserved_bytes.all.current", "reserved_bytes.all.peak")


def _worker_start_gc_timer(worker) -> bool:
    """Run in the worker (collective_rpc): time every garbage collection from here on."""
    import gc
    import time as _time

    state = {"collections": 0, "seconds": 0.0, "by_generation": [0, 0, 0], "started": None}

    def on_gc(phase, info):
        if phase == "start":
            state["started"] = _time.perf_counter()
        elif state["started"] is not None:
            state["seconds"] += _time.perf_counter() - state["started"]
            state["collections"] += 1
            state["by_generation"][info.get("generation", 0)] += 1
            state["started"] = None

    gc.callbacks.append(on_gc)
    worker._uniprefill_diag_gc = state
    return True


def _worker_stats(worker) -> dict:
    """Run in the worker (collective_rpc): the caching allocator's counters and the GC timer's totals."""
    import gc

    import torch as _torch

    stats = _torch.cuda.memory_stats()
    state = getattr(worker, "_uniprefill_diag_gc", None) or {}
    return {"memory": {k: stats.get(k) for k in _MEMORY_KEYS}, "gc_frozen": gc.get_freeze_count(), "gc_collections": state.get("collections"),
            "gc_ms": round(1e3 * state.get("seconds", 0.0), 3), "gc_by_generation": state.get("by_generation")}


def _diff(after: dict, before: dict) -> dict:
    """What happened between two `_worker_stats`: counter increments, the allocator's current and peak bytes after."""
    memory = {k: (after["memory"][k] - before["memory"][k]) if k.startswith("num_") else after["memory"][k]
              for k in _MEMORY_KEYS if after["memory"].get(k) is not None and before["memory"].get(k) is not None}
    return {"memory": memory, "gc_collections": (after["gc_collections"] or 0) - (before["gc_collections"] or 0),
            "gc_ms": round((after["gc_ms"] or 0) - (before["gc_ms"] or 0), 3),
            "gc_by_generation": after["gc_by_generation"], "gc_frozen": after["gc_frozen"]}


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def inside_summary(path: Path, op: str, top: int = 20) -> dict:
    """Where the host's time goes inside each call of the CPU operator `op` (e.g. `uniprefill::vllm_drop`) of a
    torch.profiler chrome trace: the calls' host ms, and every event nested in them on the same thread (operators,
    CUDA runtime and driver calls) by name, as host ms and count per call of `op` (nested operators count in their
    parents' time too)."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    host = sorted((e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")),
                  key=lambda e: (e["ts"], -e["dur"]))
    calls, end = [], {}
    for e in host:  # the outermost calls only (an operator may appear nested in itself)
        if e["name"] == op and e["ts"] >= end.get((e["pid"], e["tid"]), float("-inf")):
            calls.append(e)
            end[e["pid"], e["tid"]] = e["ts"] + e["dur"]
    inside: dict[tuple, list] = {}
    for call in calls:
        t0, t1 = call["ts"], call["ts"] + call["dur"] + 1  # 1 us: the trace's rounding
        for e in host:
            if e["ts"] > t1:
                break
            if (e is not call and (e["pid"], e["tid"]) == (call["pid"], call["tid"]) and t0 <= e["ts"]
                    and e["ts"] + e["dur"] <= t1):
                row = inside.setdefault((e["cat"], e["name"][:80]), [0, 0.0])
                row[0] += 1
                row[1] += e["dur"] / 1e3
    n = max(len(calls), 1)
    ranked = sorted(inside.items(), key=lambda kv: -kv[1][1])[:top]
    return {"file": path.name, "op": op, "calls": len(calls), "call_ms": [round(c["dur"] / 1e3, 3) for c in calls],
            "per_call": [[cat, name, round(v[1] / n, 3), round(v[0] / n, 1)] for (cat, name), v in ranked]}


def trace_summary(path: Path, top: int = 25) -> dict:
    """A torch.profiler chrome trace (vLLM's `profiler_config`, gzip or not), summarised: the span from the first to
    the last event, the device's busy time (the union of kernels, copies and sets), the CUDA runtime calls by name
    (count, host ms: the synchronising ones show where the host waits), the CPU operators by total host ms, and
    vLLM's step annotations (`user_annotation`) with the device time inside each."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not events:
        return {"file": path.name, "events": 0}
    device = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime: dict[str, list] = {}
    ops: dict[str, list] = {}
    for e in events:
        cat = e.get("cat")
        table = runtime if cat in ("cuda_runtime", "cuda_driver") else ops if cat == "cpu_op" else None
        if table is not None:
            row = table.setdefault(e["name"], [0, 0.0])
            row[0] += 1
            row[1] += e["dur"] / 1e3
    steps = []
    cpu_ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"]))
    for e in sorted((e for e in events if e.get("cat") == "user_annotation"), key=lambda e: e["ts"]):
        t0, t1 = e["ts"], e["ts"] + e["dur"]
        inside = [(max(a, t0), min(b, t1)) for a, b in device if b > t0 and a < t1]
        step = {"name": e["name"][:100], "host_ms": round(e["dur"] / 1e3, 3),
                "device_busy_ms": round(_union_ms(inside), 3)}
        if e["dur"] > 5000:  # a real step: its outermost operators by name (where the host's time goes)
            outer: dict[str, list] = {}
            end = float("-inf")
            for op in (op for op in cpu_ops if t0 <= op["ts"] < t1):
                if op["ts"] >= end:
                    end = op["ts"] + op["dur"]
                    row = outer.setdefault(re.sub(r"CompiledFxGraph \w+", "CompiledFxGraph", op["name"])[:80], [0, 0.0])
                    row[0] += 1
                    row[1] += op["dur"] / 1e3
            by_time = sorted(outer.items(), key=lambda kv: -kv[1][1])[:12]
            step["outer_ops_ms"] = [[k, v[0], round(v[1], 3)] for k, v in by_time]
        steps.append(step)
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    decode = decode_steps([e for e in events if e.get("cat") == "user_annotation"], device)
    ranked = lambda table: [[k[:100], v[0], round(v[1], 3)] for k, v in sorted(table.items(), key=lambda kv: -kv[1][1])]
    return {"file": path.name, "events": len(events), "span_ms": round((end - start) / 1e3, 3),
            "device_busy_ms": round(_union_ms(device), 3), "device_ops": len(device),
            "runtime_calls": ranked(runtime)[:top], "cpu_ops": ranked(ops)[:top], "annotations": steps[:200]} | (
                {"decode_steps": decode} if decode else {})


FIRST_STEPS = 16
DECODE_STEP = re.compile(r"^execute_context_0\(0\)_generation_[1-9]")  # vLLM's annotation of a decode-only step


def decode_steps(annotations: list[dict], device: list[tuple[float, float]]) -> dict:
    """The decode-only steps of a trace (vLLM's `execute_context_0(0)_generation_R(R)` annotations): their period
    (one step's start to the next's, what a token costs), the host time inside the annotation, and the device's busy
    time within each period (kernels, copies, sets), as medians in ms; `device_idle_share` is 1 - busy / period;
    `first_periods_ms` / `first_busy_ms` the first `FIRST_STEPS` periods and busy times one by one (the serve runs
    aa and ac found the gaps after a drop longer in the first ten or so decode steps only). A period longer than its
    device work is time the device waited for the host; a longer busy time, slower kernels."""
    starts = sorted((e["ts"], e["dur"]) for e in annotations if DECODE_STEP.match(e["name"]))
    if len(starts) < 2:
        return {}
    periods, busy = [], []
    for (t0, _), (t1, _) in zip(starts, starts[1:]):
        periods.append((t1 - t0) / 1e3)
        busy.append(_union_ms([(max(a, t0), min(b, t1)) for a, b in device if b > t0 and a < t1]))
    median = lambda xs: round(statistics.median(xs), 4)
    return {"steps": len(starts), "period_ms_median": median(periods), "host_ms_median": median([d / 1e3 for _, d in starts]),
            "device_busy_ms_median": median(busy), "device_idle_share": round(1 - sum(busy) / sum(periods), 4),
            "first_periods_ms": [round(x, 4) for x in periods[:FIRST_STEPS]],
            "first_busy_ms": [round(x, 4) for x in busy[:FIRST_STEPS]]}


def traced_prefill(llm, run, prefill, trace_dir: Path, tag: str = "traced") -> dict:
    """One more prefill (`prefill`: the sampling parameters, a decode too where they ask for more tokens) under
    vLLM's own profiler, in the engine's process; the new trace files summarised."""
    before = set(trace_dir.rglob("*.json*")) if trace_dir.exists() else set()
    llm.start_profile()
    wall = run(tag, prefill)
    llm.stop_profile()
    deadline = time.time() + 120  # the worker writes its trace after stop_profile returns
    files: list[Path] = []
    while time.time() < deadline:
        files = sorted(set(trace_dir.rglob("*.json*")) - before)
        if files and all(f.stat().st_size > 0 for f in files):
            time.sleep(2)
            break
        time.sleep(1)
    return {"traced_prefill_wall_ms": round(1e3 * wall, 3), "traces": [trace_summary(f) for f in files]}


def profile(args) -> dict:
    if not args.own_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.trace_dir:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (a diagnosis run)
    import torch
    from vllm import LLM, SamplingParams

    from uniprefill.vllm.measure import token_prompts

    kwargs: dict = {"seed": 0, "max_model_len": args.max_model_len}
    if args.load_format:
        kwargs["load_format"] = args.load_format
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    compilation: dict = {}
    if args.uniprefill:
        compilation["inductor_compile_config"] = {"uniprefill": json.loads(args.uniprefill)}
    if args.compile_ranges_endpoints:
        compilation["compile_ranges_endpoints"] = [int(x) for x in args.compile_ranges_endpoints.split(",")]
    if compilation:
        kwargs["compilation_config"] = compilation
    if args.trace_dir:
        kwargs["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": str(args.trace_dir.resolve()),
                                     "torch_profiler_with_stack": args.trace_stack}
    llm = LLM(model=str(args.model_dir), tokenizer=str(args.model_dir), **kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=1 + args.decode_tokens, temperature=0.0, ignore_eos=True)

    generated: dict[str, list] = {}  # tag -> each prompt's output token ids

    def run(tag: str, params) -> float:
        prompt = [{"prompt_token_ids": ids} for ids in token_prompts(args.length, args.batch, tag, vocab)]  # before the clock
        sync = (lambda: None) if args.own_process else torch.cuda.synchronize  # no CUDA in this process then
        sync()
        start = time.perf_counter()
        outputs = llm.generate(prompt, params, use_tqdm=False)
        sync()
        wall = time.perf_counter() - start
        generated[tag] = [list(o.outputs[0].token_ids) for o in outputs]
        return wall

    def cold(tag: str, params) -> float:
        """`run` from an empty prefix cache: a prompt run before is prefilled again, not read from the cache. The
        prefill-only and prefill+decode runs take the same prompts, so that their difference is the decode's alone
        (a p-driven drop keeps another share of each prompt: over two prompts one prefill's work would count)."""
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache (a request still running?)")
        return run(tag, params)

    def measure(tag: str) -> dict:
        for i in range(3):
            run(f"{tag}warm{i}", decode)
        if args.trace_dir:
            llm.collective_rpc(_worker_start_gc_timer)
            before = llm.collective_rpc(_worker_stats)[0]
        walls = [cold(f"{tag}timed{i}", prefill) for i in range(args.repeats)]
        out = {"prefill_wall_ms_median": round(1e3 * statistics.median(walls), 3),
               "prefill_wall_ms": [round(1e3 * w, 3) for w in walls]}
        if args.decode_walls:  # the same prompts plus the decode: the decode's wall per token, medians subtracted
            with_decode = [cold(f"{tag}timed{i}", decode) for i in range(args.repeats)]
            out["prefill_decode_wall_ms"] = [round(1e3 * w, 3) for w in with_decode]
            out["decode_wall_ms_per_token"] = round(
                1e3 * (statistics.median(with_decode) - statistics.median(walls)) / args.decode_tokens, 4)
            if args.early_tokens:  # the same prompts once more with only the first K tokens: those steps apart
                k = args.early_tokens
                early = SamplingParams(max_tokens=1 + k, temperature=0.0, ignore_eos=True)
                with_early = [cold(f"{tag}timed{i}", early) for i in range(args.repeats)]
                out["prefill_early_wall_ms"] = [round(1e3 * w, 3) for w in with_early]
                out["decode_wall_ms_per_token_first"] = round(
                    1e3 * (statistics.median(with_early) - statistics.median(walls)) / k, 4)
                out["decode_wall_ms_per_token_after_first"] = round(
                    1e3 * (statistics.median(with_decode) - statistics.median(with_early)) / (args.decode_tokens - k), 4)
        if args.trace_dir:
            out["engine_process_during_timed"] = _diff(llm.collective_rpc(_worker_stats)[0], before)
            out |= traced_prefill(llm, run, prefill, args.trace_dir)
            if args.decode_walls:  # and one prefill + decode: the decode steps' periods against their device time
                traced = traced_prefill(llm, run, decode, args.trace_dir, "traced-decode")
                out["traced_decode_wall_ms"] = traced["traced_prefill_wall_ms"]
                out["decode_traces"] = traced["traces"]
        if args.own_process:  # the engine core's kernels are in another process: walls only
            return out
        if args.host:  # the host's side before any torch.profiler session (CUPTI can slow later launches)
            for label, params in (("prefill", prefill), ("prefill+decode", decode)):
                dump = args.pstats_dir / f"{tag}{label}.pstats" if args.pstats_dir else None
                out[f"host_python_{label}"] = python_profile(lambda: run(f"{tag}cprofiled-{label}", params), dump=dump)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        profiles = {}
        for label, params in (("prefill", prefill), ("prefill+decode", decode)):
            if not llm.reset_prefix_cache():  # one prompt for both profiles (`cold`), reset outside the profile
                raise RuntimeError("vLLM did not reset its prefix cache")
            with torch.profiler.profile(activities=activities) as prof:
                run(f"{tag}profiled", params)
            profiles[label] = device_times(prof)
            out[label] = summary(profiles[label])
            out[label]["host_top_ms"] = host_times(prof)
        out["decode_token_ids"] = generated[f"{tag}profiled"]  # the last run: prefill+decode; one prompt in every engine
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
    if "decode_token_ids" in a and "decode_token_ids" in b:
        same = sum(x == y for p, q in zip(a["decode_token_ids"], b["decode_token_ids"]) for x, y in zip(p, q))
        lines.append(f"profiled prefill + decode tokens: {same} of {sum(map(len, a['decode_token_ids']))} equal")
    if "decode_wall_ms_per_token" in a and "decode_wall_ms_per_token" in b:
        lines.append(f"decode wall ms per token: {a['decode_wall_ms_per_token']} -> {b['decode_wall_ms_per_token']}")
    for key in ("decode_wall_ms_per_token_first", "decode_wall_ms_per_token_after_first"):
        if key in a and key in b:
            lines.append(f"{key.replace('_', ' ').replace('ms per token', 'ms per token,')}: {a[key]} -> {b[key]}")
    if "decode_part" in a and "decode_part" in b:  # the kernels whose decode time moved most (each side's top 40)
        ka, kb = ({} for _ in (a, b))
        for x, into in ((a, ka), (b, kb)):  # names are cut at 160 characters: kernels that share one are summed
            for name, ms in x["decode_part"]["top_kernels_ms"]:
                into[name] = into.get(name, 0.0) + ms
        moved = sorted(set(ka) | set(kb), key=lambda k: -abs(kb.get(k, 0.0) - ka.get(k, 0.0)))[:12]
        lines.append("decode_part kernels that moved most (ms, each side's top 40; absent = 0):")
        lines += [f"  {ka.get(k, 0.0):9.3f} -> {kb.get(k, 0.0):9.3f}  {k[:110]}" for k in moved]
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
    parser.add_argument("--batch", type=int, default=1, help="prompts of --length submitted at once (one generate call)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--decode-walls", action="store_true",
                        help="also time --repeats prefills plus --decode-tokens tokens: the decode's wall per token")
    parser.add_argument("--early-tokens", type=int, default=0, metavar="K",
                        help="with --decode-walls: also time the same prompts with only K tokens, so the first K decode "
                             "steps after the prefill and the later ones get a wall per token each (the serve runs "
                             "aa / ac found the gaps after a drop longer in the first steps)")
    parser.add_argument("--load-format", default=None, help="vLLM's load_format (dummy: a folder without weights)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="vLLM's step budget (a control: standard vLLM at `vllm serve`'s 8192 or at the 33791 a "
                             "dropping server raises it to; run ad found the budget alone lengthens the decode)")
    parser.add_argument("--compile-ranges-endpoints", default=None,
                        help="comma-separated compilation_config.compile_ranges_endpoints (e.g. 8192 beside a raised "
                             "budget: the decode then runs code compiled for vLLM's own range)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--host", action="store_true",
                        help="also the host's side: cProfile of one prefill and one prefill+decode, and the top "
                             "host calls of the torch.profiler sessions")
    parser.add_argument("--pstats-dir", type=Path, default=None,
                        help="with --host: the raw cProfile stats of each profiled call into this folder")
    parser.add_argument("--per-row-too", action="store_true",
                        help="then time and profile again with the per-row window kernel in prefill steps "
                             "(UNIPREFILL_DEBUG_PER_ROW_WINDOW)")
    parser.add_argument("--own-process", action="store_true",
                        help="the engine in its own process, as vLLM runs it by default (the throughput grid's "
                             "setting): prefill walls only, no profiles (torch.profiler sees one process)")
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="with --own-process: the engine process's allocator and GC counters over the timed "
                             "prefills, and one more prefill traced by vLLM's profiler into this folder, summarised")
    parser.add_argument("--trace-stack", action="store_true",
                        help="with --trace-dir: the trace records Python stacks (host times grow; it names the "
                             "callers of host ops)")
    parser.add_argument("--summarise-trace", type=Path, default=None, help="print trace_summary of one trace file")
    parser.add_argument("--inside", default=None, metavar="OP",
                        help="with --summarise-trace: print inside_summary of the operator OP instead")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("STANDARD", "OTHER"))
    args = parser.parse_args(argv)
    if args.decode_walls and args.decode_tokens < 1:
        parser.error("--decode-walls needs --decode-tokens >= 1")
    if args.early_tokens and not (args.decode_walls and 0 < args.early_tokens < args.decode_tokens):
        parser.error("--early-tokens K needs --decode-walls and 0 < K < --decode-tokens")
    if args.inside and not args.summarise_trace:
        parser.error("--inside needs --summarise-trace")
    if args.summarise_trace:
        summary_of = inside_summary(args.summarise_trace, args.inside) if args.inside else trace_summary(args.summarise_trace)
        print(json.dumps(summary_of, indent=1))
        return 0
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
            print(label + json.dumps({k: one[k] for k in ("prefill_wall_ms_median", "prefill_wall_ms",
                                                           "decode_wall_ms_per_token", "decode_wall_ms_per_token_first",
                                                           "decode_wall_ms_per_token_after_first") if k in one}))
            if "engine_process_during_timed" in one:
                print(json.dumps(one["engine_process_during_timed"]))
                for t in one["traces"]:
                    print(json.dumps({k: t.get(k) for k in ("file", "span_ms", "device_busy_ms", "device_ops")}))
                    print("  runtime:", json.dumps(t.get("runtime_calls", [])[:10]))
                    for step in t.get("annotations", [])[:8]:
                        print("  step:", json.dumps(step))
                for t in one.get("decode_traces", []):
                    print("decode trace:", t.get("file"), json.dumps(t.get("decode_steps")))
        elif one:
            print(label + json.dumps({"prefill_wall_ms_median": one["prefill_wall_ms_median"]} | {
                part: {"device_ms": one[part]["device_ms"], "by_kind_ms": one[part]["by_kind_ms"]}
                for part in ("prefill", "decode_part")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
