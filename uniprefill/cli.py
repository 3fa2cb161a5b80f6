"""Command line: `uniprefill demo | bench | eval`.

Every argument is checked before a model is loaded (task names, lengths, shard, p and the
other `UniPrefillConfig` fields, paths); a bad one ends the command at once with a usage
error naming it. Results are written as JSON with every setting, package versions, device,
git commit and date, and printed as a table.

Environment: UNIPREFILL_HAYSTACK names the essay haystack file when --haystack is not given.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Any

_TYPES = ("float32", "bfloat16", "float16")


class UsageError(ValueError):
    """A bad command-line value; reported as a usage error of the subcommand."""


# ----------------------------------------------------------------------------- parsing


def parse_length(text: str) -> int:
    """"4096", "4k" or "128K" (K = 1024) -> tokens."""
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise UsageError(f"length {text!r} is not a number of tokens (e.g. 4096 or 4k)") from None
    if value <= 0:
        raise UsageError(f"length {text!r} must be positive")
    return value


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_drop_layers(text: str):
    if text in ("auto", "all"):
        return text
    try:
        return tuple(int(x) for x in _split(text))
    except ValueError:
        raise UsageError(f"--drop-layers {text!r}: give auto, all or layer indices like 7,11,15"
                         ) from None


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in _split(text)]
    except ValueError:
        raise UsageError(f"{what} {text!r} must be numbers separated by commas") from None


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in _split(text)]
    except ValueError:
        raise UsageError(f"{what} {text!r} must be integers separated by commas") from None


def _configs(args) -> list:
    """One UniPrefillConfig per (selection rule, drop set, policy, p); its ValueError names a bad value.

    `--drop-layers` holds one drop set or several separated by ";" (e.g. "all;auto;11,17").
    """
    from uniprefill.config import UniPrefillConfig

    drops = [parse_drop_layers(d.strip()) for d in args.drop_layers.split(";") if d.strip()]
    if not drops:
        raise UsageError(f"--drop-layers {args.drop_layers!r} names no drop set")
    return [UniPrefillConfig(p=p, policy=policy, drop_layers=drop, window_positions=window, selection=rule)
            for rule in _split(args.selection) for window in _split(args.window_positions) for drop in drops
            for policy in _split(args.policy) for p in _floats(args.p, "--p")]


def _haystack(args) -> tuple[str | None, str]:
    """(path, where it came from), checked to exist."""
    path, source = args.haystack, "--haystack"
    from .env import haystack_path

    if path is None and haystack_path():
        path, source = haystack_path(), "UNIPREFILL_HAYSTACK"
    if path is not None and not os.path.isfile(path):
        raise UsageError(f"haystack file {path!r} (from {source}) does not exist")
    return path, source


def _device_and_dtype(args):
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available")
    from uniprefill.bench.models import DTYPES

    name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    return device, DTYPES[name]


def _check_model(spec: str, lengths: list[int]) -> None:
    from uniprefill.bench.models import check_lengths, local_config

    check_lengths(local_config(spec), lengths)


def _load(args, lengths: list[int], device, dtype, need_tokenizer: bool):
    from uniprefill.bench.models import check_lengths, load_model

    start = time.perf_counter()
    print(f"loading {args.model} on {device} (the default model is converted once, on first use) ...", file=sys.stderr)
    loaded = load_model(args.model, dtype=dtype, device=device, tokenizer=args.tokenizer,
                        num_layers=getattr(args, "num_layers", None))
    check_lengths(loaded.model.config, lengths)
    if need_tokenizer and loaded.tokenizer is None:
        raise UsageError(f"model {args.model!r} comes without a tokenizer: pass --tokenizer PATH")
    print(f"loaded {args.model} ({loaded.source}) on {device} in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return loaded


def _settings(args) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "handler"}


def _write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}", file=sys.stderr)


# ----------------------------------------------------------------------------- commands


def cmd_demo(args, checks) -> int:
    from uniprefill.bench.demo import DemoSettings, demo_sample, format_demo, run_demo
    from uniprefill.measure.environment import environment_info

    with checks():
        configs = _configs(args)
        if len(configs) != 1:
            raise UsageError("demo takes one --p, --policy, --selection and --window-positions")
        config = configs[0]
        settings = DemoSettings(length=parse_length(args.length), seed=args.seed,
                                warmup=args.warmup, repeats=args.repeats)
        haystack, source = _haystack(args)
        _check_model(args.model, [settings.length])
        device, dtype = _device_and_dtype(args)
        print(f"haystack: essay file {haystack} (from {source})" if haystack else
              "haystack: built-in noise text (no --haystack given, UNIPREFILL_HAYSTACK unset)")
        loaded = _load(args, [settings.length], device, dtype, need_tokenizer=True)
        sample = demo_sample(loaded.tokenizer, settings, haystack)
    records = run_demo(loaded.model, loaded.tokenizer, config, sample, settings)
    print(format_demo(sample, records))
    if args.json:
        _write_json(args.json, {"command": "demo", "settings": _settings(args),
                                "config": config.to_dict(), "sample": sample.to_dict(),
                                "environment": environment_info(device), "results": records})
    return 0


def cmd_bench(args, checks) -> int:
    from uniprefill.measure.environment import environment_info
    from uniprefill.bench.ttft import SweepPlan, format_results, plot_sweep, sweep

    with checks():
        lengths = [parse_length(x) for x in _split(args.lengths)]
        configs = _configs(args)
        if args.keep_ratio:
            ratios = _floats(args.keep_ratio, "--keep-ratio")
            configs = list({dataclasses.replace(c, p=1.0, keep_ratio=r, selection="paper"): None
                            for c in configs for r in ratios})  # --p plays no part then
        batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
        if args.measured_ideal and (set(batch_sizes) != {1} or any(c.policy != "cumulative" for c in configs)):
            raise UsageError("--measured-ideal models batch 1 under the cumulative policy: "
                             "use --batch-sizes 1 --policy cumulative")
        if args.warmup < 0 or args.repeats < 1:
            raise UsageError("--warmup must be >= 0 and --repeats >= 1")
        if args.warmup == 0:
            print("warning: --warmup 0: the first timed prefill of every system includes its compile time "
                  "(torch.compile, Triton), so TTFT and speedups are not steady-state", file=sys.stderr)
        haystack, _ = _haystack(args)
        _check_model(args.model, lengths)
        device, dtype = _device_and_dtype(args)
        loaded = _load(args, lengths, device, dtype, need_tokenizer=args.inputs == "niah")
        inputs = args.inputs
        if inputs == "auto":
            inputs = "niah" if loaded.tokenizer is not None else "random"
        plan = SweepPlan(
            lengths=tuple(lengths), batch_sizes=tuple(batch_sizes),
            configs=() if args.baseline_only else tuple(configs), baseline=args.baseline,
            warmup=args.warmup, repeats=args.repeats, inputs=inputs, seed=args.seed)
    ideal_fn = _measured_ideal_fn(device, args.warmup, args.repeats) if args.measured_ideal else None
    results = sweep(loaded.model, plan, model_name=args.model, tokenizer=loaded.tokenizer,
                    haystack=haystack, ideal_fn=ideal_fn, compile_backend=args.compile_backend,
                    progress=not args.quiet)
    print(format_results(results))
    payload = {"command": "bench", "settings": _settings(args), "plan": plan.as_dict(),
               "environment": environment_info(device), "results": results}
    _write_json(args.out, payload)
    if args.plot:
        plot_sweep(results, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _measured_ideal_fn(device, warmup: int, repeats: int):
    """`sweep`'s ideal_fn: the plain model timed on each drop segment's kept token count
    (`uniprefill.eval.ideal`); times are shared by every point of the sweep (keyed by count)."""
    from uniprefill.eval.ideal import measured_ideal_of_report

    times: dict[int, float] = {}

    def ideal_seconds(model, ids, mask, report) -> float:
        return measured_ideal_of_report(model, ids, mask, report, device, warmup=warmup, repeats=repeats,
                                        times=times)["ideal_s"]

    return ideal_seconds


def cmd_eval(args, checks) -> int:
    from uniprefill.eval.runner import EvalPlan, parse_shard, read_records, run_eval
    from uniprefill.eval.summary import format_table, plot_pareto, summarize
    from uniprefill.eval.systems import baseline_spec, uniprefill_spec
    from uniprefill.eval.tasks import TASK_NAMES, check_task, make_sample, needs_essay

    summary_path = args.summary or f"{os.path.splitext(args.out)[0]}.summary.json"
    if args.summary_only:
        with checks():
            if not os.path.exists(args.out):
                raise UsageError(f"--summary-only: results file {args.out!r} does not exist")
    else:
        with checks():
            if args.tasks == "default":  # every task if an essay haystack is at hand, else those that need none
                tasks = list(TASK_NAMES) if _haystack(args)[0] else [t for t in TASK_NAMES if not needs_essay(t)]
                if len(tasks) < len(TASK_NAMES):
                    print(f"tasks: {', '.join(tasks)} (the essay tasks need an essay haystack: a JSON or text file "
                          "of essays, e.g. RULER's Paul Graham essays, passed with --haystack PATH or "
                          "UNIPREFILL_HAYSTACK)", file=sys.stderr)
            else:
                tasks = list(TASK_NAMES) if args.tasks == "all" else _split(args.tasks)
            for task in tasks:
                check_task(task)
            lengths = [parse_length(x) for x in _split(args.lengths)]
            systems = [baseline_spec(compiled=args.baseline == "compiled")]
            if not args.baseline_only:
                systems += [uniprefill_spec(c) for c in _configs(args)]
            shard = parse_shard(args.shard)
            for path in args.also_done:
                if not os.path.isfile(path):
                    raise UsageError(f"--also-done file {path!r} does not exist")
            if args.timed_samples is not None and args.timed_samples < 0:
                raise UsageError(f"--timed-samples {args.timed_samples} must be >= 0")
            if args.no_generate and (args.part == "untimed" or args.timed_samples is not None):
                raise UsageError("--no-generate times prefills only: it cannot be combined "
                                 "with untimed prompts (--timed-samples / --part untimed)")
            haystack, _ = _haystack(args)
            essay_tasks = [t for t in tasks if needs_essay(t)]
            if essay_tasks and haystack is None:
                raise UsageError(f"tasks {essay_tasks} need an essay haystack: pass --haystack "
                                 "PATH or set UNIPREFILL_HAYSTACK")
            plan = EvalPlan(tuple(tasks), tuple(lengths), args.samples, args.seed, haystack,
                            args.max_new_tokens)
            _check_model(args.model, lengths)
            device, dtype = _device_and_dtype(args)
            loaded = _load(args, lengths, device, dtype, need_tokenizer=True)
            for task in tasks:  # fail now, not hours in, if a prompt cannot fit a length
                for length in lengths:
                    make_sample(task, loaded.tokenizer, length, 0, seed=args.seed,
                                haystack=haystack, max_new_tokens=args.max_new_tokens)
        run_eval(loaded.model, loaded.tokenizer, systems, plan, args.out,
                 model_name=args.model, shard=shard, warmup=args.warmup, repeats=args.repeats,
                 generate=not args.no_generate, progress=not args.quiet,
                 compile_backend=args.compile_backend, settings=_settings(args),
                 timed_samples=args.timed_samples, part=args.part,
                 stop_when_answered=not args.full_answers, decode_sdpa=args.decode_sdpa,
                 done_elsewhere=args.also_done, measured_ideal=args.measured_ideal)
    records = read_records(args.out)
    rows = summarize(records, n_boot=args.n_boot, seed=args.seed)
    print(format_table(rows))
    envs = list({json.dumps(r.get("env", {}), sort_keys=True) for r in records})
    _write_json(summary_path, {"command": "eval", "settings": _settings(args),
                               "results_file": os.path.abspath(args.out),
                               "environments": [json.loads(e) for e in envs], "rows": rows})
    if args.plot:
        plot_pareto(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- parser


def _common(p: argparse.ArgumentParser, *, model_default: str) -> None:
    p.add_argument("--model", default=model_default,
                   help="gemma-3-270m (default model), a preset name, or a local model folder")
    p.add_argument("--tokenizer", help="local tokenizer folder (for presets/random models)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=_TYPES, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--haystack",
                   help="essay haystack file (default: $UNIPREFILL_HAYSTACK, else noise text)")


def _method(p: argparse.ArgumentParser, *, p_default: str, many: bool) -> None:
    s = "(comma-separated list)" if many else ""
    p.add_argument("--p", default=p_default, help=f"kept attention share in (0, 1] {s}")
    p.add_argument("--policy", default="cumulative", help=f"cumulative or suspend {s}")
    p.add_argument("--selection", default="paper",
                   help=f"whose score p is a share of: paper (all blocks) or content (blocks outside the sink and window) {s}")
    p.add_argument("--drop-layers", default="auto", help="auto, all or indices like 7,11,15; several sets separated by ';'")
    p.add_argument("--window-positions", default="original",
                   help=f"sliding windows after a drop over original positions or compacted indices {s}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uniprefill", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="one needle-in-a-haystack prompt: baseline vs uniprefill")
    _common(demo, model_default="gemma-3-270m")
    _method(demo, p_default="0.95", many=False)
    demo.add_argument("--length", default="3000", help="prompt length in tokens")
    demo.add_argument("--warmup", type=int, default=1)
    demo.add_argument("--repeats", type=int, default=2)
    demo.add_argument("--json", help="write the results as JSON to this file")
    demo.set_defaults(handler=cmd_demo)

    bench = sub.add_parser("bench", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="TTFT sweep over lengths, batch sizes, p and policy")
    _common(bench, model_default="gemma-3-270m")
    _method(bench, p_default="0.95", many=True)
    bench.add_argument("--lengths", default="4k,8k,16k,32k")
    bench.add_argument("--batch-sizes", default="1")
    bench.add_argument("--baseline", choices=("eager", "compiled", "both"), default="both",
                       help="speedups are against the faster baseline measured")
    bench.add_argument("--baseline-only", action="store_true")
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--inputs", choices=("auto", "random", "niah"), default="auto",
                       help="auto: niah prompts when the model has a tokenizer, else random ids")
    bench.add_argument("--keep-ratio", help="forced retention instead of top-p: keep this share of the "
                       "tokens at every drop point (comma-separated list; --p is then ignored)")
    bench.add_argument("--measured-ideal", action="store_true",
                       help="also time the plain model on each drop segment's kept token count "
                            "(the measured ideal; batch 1, cumulative policy)")
    bench.add_argument("--num-layers", type=int, help="truncate a preset to this many layers")
    bench.add_argument("--compile-backend", default="inductor",
                       help="torch.compile backend of the compiled baseline")
    bench.add_argument("--out", default="bench.json")
    bench.add_argument("--plot", help="write TTFT and speedup vs length to this PNG")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(handler=cmd_bench)

    ev = sub.add_parser("eval", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="RULER-style accuracy: tasks x lengths x systems")
    _common(ev, model_default="gemma-3-270m")
    _method(ev, p_default="0.95", many=True)
    ev.add_argument("--tasks", default="default", help="comma-separated task names, all, or default (all "
                    "when an essay haystack is given, else the tasks that need none)")
    ev.add_argument("--lengths", default="4k")
    ev.add_argument("--samples", type=int, default=20, help="samples per task and length")
    ev.add_argument("--max-new-tokens", type=int, help="answer budget (default: per task)")
    ev.add_argument("--baseline", choices=("eager", "compiled"), default="eager")
    ev.add_argument("--baseline-only", action="store_true")
    ev.add_argument("--no-generate", action="store_true", help="time prefills only")
    ev.add_argument("--warmup", type=int, default=1, help="untimed prefills per prompt")
    ev.add_argument("--repeats", type=int, default=1, help="timed prefills per prompt")
    ev.add_argument("--timed-samples", type=int,
                    help="time only the first K samples of each task and length (default: all)")
    ev.add_argument("--part", choices=("all", "timed", "untimed"), default="all",
                    help="run only the timed or only the untimed prompts now")
    ev.add_argument("--full-answers", action="store_true",
                    help="generate the whole budget even after every reference is found")
    ev.add_argument("--decode-sdpa", choices=("default", "no-cudnn"), default="default",
                    help="SDPA kernels of decode steps (prefills keep the default)")
    ev.add_argument("--measured-ideal", action="store_true",
                    help="also time the plain model on each timed method prompt's kept token counts "
                         "(the measured ideal speedup, beside the FLOP-model one)")
    ev.add_argument("--also-done", action="append", default=[], metavar="FILE",
                    help="a results file whose records count as done (repeatable)")
    ev.add_argument("--compile-backend", default="inductor")
    ev.add_argument("--out", default="results.jsonl", help="JSON lines, appended and resumed")
    ev.add_argument("--shard", default="0/1", help="i/k: run every k-th prompt from the i-th")
    ev.add_argument("--summary-only", action="store_true",
                    help="only summarise --out (e.g. after merging shards)")
    ev.add_argument("--summary", help="summary JSON (default: <out>.summary.json)")
    ev.add_argument("--n-boot", type=int, default=10000)
    ev.add_argument("--plot", help="write the accuracy vs speedup Pareto plot to this PNG")
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    ev.set_defaults(handler=cmd_eval)

    fz = sub.add_parser("fuzz", help="differential fuzzer: random calls vs the plain model and the eager reference",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fz.add_argument("--cases", type=int, default=200, help="random cases to run")
    fz.add_argument("--seed", type=int, default=0, help="the run's seed (a case is reproduced by seed and index)")
    fz.add_argument("--archs", default="all", help="comma-separated architectures, or all")
    fz.add_argument("--fresh-every", type=int, default=25,
                    help="empty the pool of compiled models (and reset dynamo) every this many cases")
    fz.add_argument("--seconds", type=float, help="stop starting new cases after this many seconds")
    fz.add_argument("--out", help="write the summary and every failing case as JSON to this file (rewritten "
                                  "after every case, so an interrupted run keeps what it ran)")
    fz.add_argument("--quiet", action="store_true", help="no progress line")
    fz.set_defaults(handler=cmd_fuzz)
    cs = sub.add_parser("census", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                        help="every causal-LM type of the installed transformers: accelerated, refused with a "
                             "reason, or a finding")
    cs.add_argument("--types", default="all", help="comma-separated model types, or all")
    cs.add_argument("--out", default="census.jsonl", help="one JSON line per model type, appended and resumed")
    cs.add_argument("--table", help="write the Markdown table of every line of --out to this file")
    cs.set_defaults(handler=cmd_census)
    for command in sub.choices.values():  # --help shows every default, also of arguments without a help text
        for action in command._actions:  # noqa: SLF001
            if action.help is None and action.default not in (None, argparse.SUPPRESS) and action.option_strings:
                action.help = action.dest.replace("_", " ")
    return parser


def cmd_census(args, checks) -> int:
    import transformers
    import torch

    from .testing.census import as_dict, causal_lm_types, census_one, table, CensusRow

    with checks():
        known = causal_lm_types()
        types = known if args.types == "all" else _split(args.types)
        unknown = sorted(set(types) - set(known))
        if unknown:
            raise UsageError(f"model types {unknown} have no causal-LM class in transformers {transformers.__version__}")
    done = {}
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as fh:
            done = {r["model_type"]: r for r in map(json.loads, fh) if r.get("model_type")}
    todo = [t for t in types if t not in done]
    for i, model_type in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {model_type} ...", file=sys.stderr, flush=True)
        row = census_one(model_type)
        print(f"    {row.status} {row.reason[:150]} ({row.seconds} s)", file=sys.stderr, flush=True)
        done[model_type] = as_dict(row)
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(as_dict(row)) + "\n")
    rows = [CensusRow(**{k: v for k, v in done[t].items()}) for t in sorted(done)]
    versions = f"transformers {transformers.__version__}, torch {torch.__version__}"
    text = table(rows, versions)
    if args.table:
        with open(args.table, "w", encoding="utf-8") as fh:
            fh.write(text)
    print(text.split("\n")[4])
    return 1 if any(r.status in ("mismatch", "error") for r in rows if r.model_type in types) else 0


def cmd_fuzz(args, checks) -> int:
    import json
    import os
    import sys

    from .testing.fuzz import ARCHS, run_fuzz

    with checks():
        archs = ARCHS if args.archs == "all" else tuple(a.strip() for a in args.archs.split(","))
        unknown = sorted(set(archs) - set(ARCHS))
        if unknown:
            raise ValueError(f"unknown architectures {unknown}; choose from {', '.join(ARCHS)}")
        if args.cases < 1 or args.fresh_every < 1 or (args.seconds is not None and args.seconds <= 0):
            raise ValueError("--cases, --fresh-every and --seconds must be positive")

    def write(summary):
        if args.out:
            with open(args.out + ".part", "w") as fh:
                json.dump(summary.as_json(args.seed, archs), fh, indent=1)
            os.replace(args.out + ".part", args.out)

    def progress(done, summary):
        write(summary)
        if not args.quiet:
            print(f"\r{done}/{args.cases} cases, {summary.seconds:.0f} s: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(summary.by_status.items())), end="", file=sys.stderr)

    summary = run_fuzz(args.cases, args.seed, archs, args.fresh_every, progress, args.seconds)
    if not args.quiet:
        print(file=sys.stderr)
    print(summary)
    write(summary)
    return 1 if summary.mismatches else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # noqa: SLF001

    @contextlib.contextmanager
    def checks():
        """Turn a ValueError of the checks (not of the run) into a usage error."""
        try:
            yield
        except ValueError as err:
            sub.error(str(err))

    return args.handler(args, checks)
