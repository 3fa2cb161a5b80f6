"""Command line: `uniprefill demo | bench | eval | fuzz | census`.

Every argument is checked before a model is loaded (task names, lengths, shard, p and the
other `UniPrefillConfig` fields, paths); a bad one ends the command at once with a usage
error naming it. Results are written as JSON with every setting, package versions, device,
git commit and date, and printed as a table.

Environment: UNIPREFILL_HAYSTACK names the essay haystack file when --haystack is not given.
"""

from __future__ import annotations

import argparse
import contextlib

from .arguments import UsageError, _TYPES, _configs, parse_drop_layers, parse_length  # noqa: F401  (re-exported)
from .checks import cmd_census, cmd_fuzz
from .commands import cmd_bench, cmd_demo, cmd_eval

_PEER_HELP = ("also run a peer accelerator: flexprefill, xattention, minference (their defaults), or with "
              "settings like xattention:threshold=0.8; repeatable; needs uniprefill[peers] (docs/peers.md)")


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
    p.add_argument("--selection", default="content",
                   help=f"whose score p is a share of: content (blocks outside the sink and window) or paper (all blocks) {s}")
    p.add_argument("--drop-layers", default="auto", help="auto, all or indices like 7,11,15; several sets separated by ';'")
    p.add_argument("--early-sparse", default="off",
                   help="block-sparse attention in the full-attention layers before the first drop point: "
                        f"off, p=X (top-p of the last queries' attention) or keep=X (a forced block share) {s} "
                        "(docs/sparse-prefill.md)")
    p.add_argument("--early-sparse-window", type=int, default=1024, help="local band of the sparse layers, in tokens")
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
    bench.add_argument("--peer", action="append", default=[], metavar="SPEC", help=_PEER_HELP)
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
    ev.add_argument("--peer", action="append", default=[], metavar="SPEC", help=_PEER_HELP)
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
