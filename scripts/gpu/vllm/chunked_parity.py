"""Which prompts two `defaults_engine.py` runs prefill differently, beside which prompts vLLM chunked.

    python3 scripts/gpu/vllm/chunked_parity.py RUN_A.json RUN_B.json [--budget 16384] [--pass sequential_after]

Where both runs recorded their first pass's steps (`defaults_engine.py --record-steps`), it also prints the prompts
whose prefill steps (token counts, and which prompts shared them) differ between the runs, beside those that part.
`--pass sequential_after` compares the runs' one-at-a-time pass instead (each prompt alone in its steps: chunked
where it is longer than the budget). RUN_*.json: parity runs of the same prompts (gzipped ones are read as they are). A prompt "parts" where its first
generated token's logprob differs (the prefill's last row; with no logprobs recorded, where the token ids differ).
The parity prompts are submitted at once in order, so vLLM's scheduler packs them first come, first served into
steps of `--budget` tokens (`max_num_batched_tokens`): a prompt that does not fit the rest of a step is split, its
later chunks prefilled over the cached start (the path uniprefill's `vllm_context_drops` takes). The packing here
ignores the decode tokens that share later steps, so it can be a prompt off near the end. Prints both sets and how
they overlap: Gemma-3-270M at p = 1 in Inductor's deterministic mode parted on exactly the chunked prompts (H100,
2026-12-06, docs/results/vllm-h100-2026-12-06).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def load_parity(path: Path, which: str = "first") -> dict:
    """The parity record of a run: its first (batched) pass, or `which` = "sequential_after" (the prompts again,
    one at a time, on an empty prefix cache) with the prompt lengths of the first."""
    raw = path.read_bytes()
    parity = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)["parity"]
    if which == "first":
        return parity
    if which not in parity:
        raise ValueError(f"{path} has no {which!r} pass (defaults_engine.py --parity-sequential-after)")
    return {"prompt_lengths": parity["prompt_lengths"], **parity[which]}


def chunked_prompts(lengths: list[int], budget: int, alone: bool = False) -> set[int]:
    """Indices of the prompts a first-come-first-served packing into `budget`-token steps splits (`alone`: each
    prompt in steps of its own, as a sequential pass runs them)."""
    if budget < 1:
        raise ValueError(f"budget={budget}: expected >= 1")
    if alone:
        return {index for index, length in enumerate(lengths) if length > budget}
    room, split = budget, set()
    for index, length in enumerate(lengths):
        left = length
        while left > 0:
            take = min(left, room)
            left, room = left - take, room - take
            if left > 0:
                split.add(index)
            if room == 0:
                room = budget
    return split


def parted_prompts(a: dict, b: dict) -> tuple[set[int], str]:
    """Indices of the prompts whose first-token logprob (else whose tokens) differ, and which was compared."""
    if a["prompt_lengths"] != b["prompt_lengths"]:
        raise ValueError("the two runs have other prompts")
    if a.get("output_logprobs") and b.get("output_logprobs"):
        return {i for i, (x, y) in enumerate(zip(a["output_logprobs"], b["output_logprobs"])) if x[0] != y[0]}, \
            "first-token logprob"
    return {i for i, (x, y) in enumerate(zip(a["output_token_ids"], b["output_token_ids"])) if x != y}, "tokens"


def schedules(steps: list) -> dict[int, list[tuple[int, int, tuple]]]:
    """Prompt index -> its prefill steps as (tokens, computed before, the step's other prompts and their token
    counts): what decides the prompt's arithmetic in a kernel that is not batch-invariant."""
    out: dict[int, list] = {}
    for step in steps:
        for index, tokens, computed in step:
            others = tuple((i, n) for i, n, _ in step if i != index)
            out.setdefault(index, []).append((tokens, computed, others))
    return out


def scheduled_apart(a: dict, b: dict) -> set[int] | None:
    """Prompts whose steps differ between two first passes recorded with `--record-steps` (None without records):
    up to and including the step that gives the first generated token (tokens + computed reaching the prompt)."""
    if not (a.get("steps") and b.get("steps")):
        return None
    lengths = a["prompt_lengths"]

    def prefill(sched: dict, i: int):
        steps = sched.get(i, [])
        end = next((k for k, (n, c, _) in enumerate(steps) if c is not None and n + c >= lengths[i]), len(steps) - 1)
        return steps[:end + 1]

    sa, sb = schedules(a["steps"]), schedules(b["steps"])
    return {i for i in range(len(lengths)) if prefill(sa, i) != prefill(sb, i)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--pass", dest="which", choices=("first", "sequential_after"), default="first",
                        help="which pass of the two runs: the batched first one, or the one-at-a-time one after it")
    args = parser.parse_args(argv)
    a, b = load_parity(args.a, args.which), load_parity(args.b, args.which)
    lengths = a["prompt_lengths"]
    parted, compared = parted_prompts(a, b)
    split = chunked_prompts(lengths, args.budget, alone=args.which == "sequential_after")
    print(f"{len(lengths)} prompts, {args.which} pass; compared: {compared}; budget {args.budget}")
    print(f"parted ({len(parted)}): {sorted(parted)}")
    print(f"chunked ({len(split)}): {sorted(split)}")
    print(f"parted and chunked: {len(parted & split)}; parted, one step: {sorted(parted - split)} "
          f"(lengths {[lengths[i] for i in sorted(parted - split)]}); chunked, equal: {sorted(split - parted)}")
    apart = scheduled_apart(a, b)
    if apart is not None:
        print(f"scheduled apart, recorded ({len(apart)}): {sorted(apart)}; parted and scheduled alike: "
              f"{sorted(parted - apart)}; scheduled apart, equal: {sorted(apart - parted)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
