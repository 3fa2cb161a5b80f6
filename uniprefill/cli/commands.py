"""The `demo`, `bench` and `eval` subcommands.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from .arguments import UsageError, parse_length, _split, _floats, _ints, _configs, _peers, _haystack, _device_and_dtype, _check_model, _load, _settings, _write_json

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
            peers=() if args.baseline_only else tuple(_peers(args)),
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
    from uniprefill.eval.systems import baseline_spec, peer_spec, uniprefill_spec
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
                systems += [peer_spec(p) for p in _peers(args)]
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
