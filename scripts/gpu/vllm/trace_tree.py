"""Print the nesting of a PyTorch profiler trace recorded with Python stacks (`profile_prefill.py --trace-stack`,
`TRACE=1 TRACE_STACK=1 ab_own_process.sh`): which Python function called which host op, and for how long.

    python3 scripts/gpu/vllm/trace_tree.py TRACE.pt.trace.json.gz --under "drop.py(175): _drop" --nth 3 --min-ms 0.12
    python3 scripts/gpu/vllm/trace_tree.py TRACE.pt.trace.json.gz --under execute_context_5 --min-ms 0.7

`--under` picks the events whose name contains the text (a step's annotation, a function's `file(line): name`) and
`--nth` one of them in time order; every Python function, host op and CUDA runtime call of the same thread lying
inside it and lasting at least `--min-ms` is printed, indented by its depth. It also prints the time of the kernels
that START within that host interval, on any stream (a rough busy share, not the kernels the step launched: those
may run later; a step whose kernels fill a small part of its host time is host-bound, and rows dropped there save no
wall). Host times under Python-stack tracing are inflated: read them as shares, never as walls.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

HOST_CATS = ("python_function", "user_annotation", "cpu_op", "cuda_runtime")
CALLERS_FIRST = {"user_annotation": 0, "python_function": 1, "cpu_op": 2, "cuda_runtime": 3}  # on equal spans
ROUNDING_US = 0.01  # the profiler's timestamps are rounded: a child may end this far past its parent


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def tree_lines(events: list[dict], under: str, nth: int, min_ms: float) -> list[str]:
    """The indented lines of the chosen event's subtree (durations in ms), the kernel time inside it first."""
    roots = sorted((e for e in events if e.get("cat") in HOST_CATS and under in e.get("name", "") and "dur" in e),
                   key=lambda e: e["ts"])
    if not roots:
        raise SystemExit(f"no host event's name contains {under!r}")
    if not 0 <= nth < len(roots):
        raise SystemExit(f"--nth {nth}: {len(roots)} events contain {under!r}")
    root = roots[nth]
    start, end = root["ts"], root["ts"] + root["dur"]
    kernel_us = sum(e["dur"] for e in events if e.get("cat") == "kernel" and start <= e["ts"] < end)
    lines = [f"{under!r} #{nth} of {len(roots)}: {root['dur'] / 1e3:.2f} ms on the host, kernels starting inside it "
             f"{kernel_us / 1e3:.2f} ms"]
    thread = (root.get("pid"), root.get("tid"))  # other threads (vLLM's output thread) overlap in time, not in calls
    inside = sorted((e for e in events if e.get("cat") in HOST_CATS and "dur" in e and e["dur"] >= min_ms * 1e3
                     and (e.get("pid"), e.get("tid")) == thread
                     and start <= e["ts"] and e["ts"] + e["dur"] <= end + ROUNDING_US),
                    key=lambda e: (e["ts"], -e["dur"], CALLERS_FIRST[e["cat"]]))
    open_ends: list[float] = []
    for e in inside:
        while open_ends and open_ends[-1] <= e["ts"] + ROUNDING_US:
            open_ends.pop()
        lines.append(f"{'  ' * len(open_ends)}{e['dur'] / 1e3:7.2f} {e['cat'][:3]} {e['name'][:120]}")
        open_ends.append(e["ts"] + e["dur"])
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--under", required=True, help="text in the name of the event to open")
    parser.add_argument("--nth", type=int, default=0, help="which of the matching events, in time order")
    parser.add_argument("--min-ms", type=float, default=0.5)
    args = parser.parse_args(argv)
    print("\n".join(tree_lines(load_events(args.trace), args.under, args.nth, args.min_ms)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
