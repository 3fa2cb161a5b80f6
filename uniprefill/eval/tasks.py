"""RULER-style synthetic long-context tasks, generated deterministically from a seed.

Each task builds a *draft*: a function `render(n)` from a haystack size `n` (in units:
sentences, words or distractor lines) to the prompt text, plus the reference answers. The
fitter then picks `n` so that the prompt, tokenised with the caller's tokenizer (special
tokens included, as the runner encodes it), leaves room for the answer:

    num_tokens + max_new_tokens  in  [ceil(0.99 * length), length]

i.e. prompt plus answer budget is within 1% of the target and never above it. When no `n`
lands in that window (a unit of many tokens, e.g. a uuid line at 4K), the random filler is
redrawn, deterministically, a few times; if every draw misses, the largest prompt below the
upper bound is used and the sample says `within_tolerance=False`.

Prompts end with an answer prefix ("... The special magic numbers for X mentioned in the
provided text are") so that a base model completes them. Needle depth follows the van der
Corput sequence over sample indices (0, 1/2, 1/4, 3/4, ...): evenly spread for any number of
samples, and sample i is the same prompt whatever the number of samples asked for.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .haystack import EssayHaystack, load_essay_haystack
from .task_builders import NEEDLE, Draft, _build_cwe, _build_fwe, _build_niah, _build_vt  # noqa: F401  (NEEDLE re-exported)

_MAX_ATTEMPTS = 8


@dataclass(frozen=True)
class Sample:
    """One prompt of one task.

    Attributes:
        task: task name.
        length: target length in tokens (prompt plus answer budget).
        index: sample index within (task, length, seed).
        seed: the seed the sample was drawn from.
        prompt: the full prompt text, ending with the answer prefix.
        answers: reference answers; the metric of the task compares them to the output.
        num_tokens: tokens of `prompt` as the tokenizer encodes it (special tokens included).
        max_new_tokens: answer budget in tokens.
        stop_at_newline: whether generation stops at the first newline after some text.
        depth: relative position of the (first) needle in the haystack, or None.
        haystack: "noise", "needles", "words" or the essay file name.
        within_tolerance: whether `num_tokens` met the 1% window; False only when one
            haystack unit (e.g. a uuid line at a short length) is larger than the window
            in every draw, and the prompt is then the largest that fits.
    """

    task: str
    length: int
    index: int
    seed: int
    prompt: str
    answers: tuple[str, ...]
    num_tokens: int
    max_new_tokens: int
    stop_at_newline: bool
    depth: float | None
    haystack: str
    within_tolerance: bool = True

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["answers"] = list(self.answers)
        return out


@dataclass(frozen=True)
class _TaskSpec:
    build: Callable[..., Draft]
    max_new_tokens: int
    haystack: str  # "noise", "essay", "needles", "words"
    kwargs: tuple[tuple[str, Any], ...] = ()
    stop_at_newline: bool = True




def check_task(name: str) -> _TaskSpec:
    """The spec of task `name`; `ValueError` naming the valid tasks otherwise."""
    if name in TASKS:
        return TASKS[name]
    why = f" ({UNAVAILABLE_TASKS[name]})" if name in UNAVAILABLE_TASKS else ""
    raise ValueError(f"unknown task {name!r}{why}; the tasks are {', '.join(TASK_NAMES)}")


def needs_essay(task: str) -> bool:
    """Whether `task` draws its haystack from an essay file."""
    return check_task(task).haystack == "essay"


def max_new_tokens_of(task: str) -> int:
    return check_task(task).max_new_tokens


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` as the runner encodes it (special tokens included)."""
    return len(tokenizer(text)["input_ids"])


def needle_depth(index: int) -> float:
    """The van der Corput point of `index` in base 2: 0, .5, .25, .75, .125, ..."""
    depth, scale = 0.0, 0.5
    while index:
        depth += scale * (index & 1)
        index >>= 1
        scale /= 2
    return depth


def generate_samples(
    task: str,
    tokenizer,
    length: int,
    num_samples: int,
    *,
    seed: int = 0,
    haystack: str | EssayHaystack | None = None,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """`num_samples` prompts of `task` at `length` tokens (see `make_sample`)."""
    return [
        make_sample(task, tokenizer, length, i, seed=seed, haystack=haystack,
                    max_new_tokens=max_new_tokens)
        for i in range(num_samples)
    ]


def make_sample(
    task: str,
    tokenizer,
    length: int,
    index: int,
    *,
    seed: int = 0,
    haystack: str | EssayHaystack | None = None,
    max_new_tokens: int | None = None,
) -> Sample:
    """Sample `index` of `task` at `length` tokens, the same for the same arguments.

    Args:
        haystack: essay file path (or a loaded `EssayHaystack`); needed by the essay tasks
            and ignored by the others.
        max_new_tokens: answer budget; the task's default when None.
    """
    spec = check_task(task)
    budget = spec.max_new_tokens if max_new_tokens is None else max_new_tokens
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"length={length!r} must be a positive number of tokens")
    if budget < 0 or budget >= length:
        raise ValueError(f"max_new_tokens={budget} must be in [0, length={length})")
    essay = _essay_for(task, spec, haystack)
    upper = length - budget
    lower = math.ceil(0.99 * length) - budget

    def count(text: str) -> int:
        return count_tokens(tokenizer, text)

    depth = needle_depth(index)
    best = None
    for attempt in range(_MAX_ATTEMPTS):
        rng = random.Random(f"uniprefill:{task}:{length}:{seed}:{index}:{attempt}")
        draft = spec.build(rng, essay, depth, spec.haystack, length, **dict(spec.kwargs))
        prompt, num_tokens = _fit(draft, count, lower, upper, task, length)
        if best is None or num_tokens > best[2]:
            best = (draft, prompt, num_tokens)
        if num_tokens >= lower:
            break
    draft, prompt, num_tokens = best
    return Sample(
        task=task, length=length, index=index, seed=seed, prompt=prompt,
        answers=draft.answers, num_tokens=num_tokens, max_new_tokens=budget,
        stop_at_newline=spec.stop_at_newline, depth=draft.depth,
        haystack=essay.name if essay is not None else spec.haystack,
        within_tolerance=num_tokens >= lower,
    )


def _essay_for(task, spec, haystack) -> EssayHaystack | None:
    if spec.haystack != "essay":
        return None
    if haystack is None:
        raise ValueError(
            f"task {task} needs an essay haystack: pass a text or JSON file "
            "(e.g. PaulGrahamEssays.json)"
        )
    return haystack if isinstance(haystack, EssayHaystack) else load_essay_haystack(haystack)


def _fit(draft: Draft, count, lower: int, upper: int, task: str, length: int):
    """(prompt, tokens) with tokens in [lower, upper], else the largest haystack below upper.

    Token counts grow (nearly) monotonically with the haystack size, so a bracketed secant
    search needs a handful of tokenisations even at 128K tokens.
    """
    lo, lo_count = draft.min_units, count(draft.render(draft.min_units))
    base = lo_count
    if lo_count > upper:
        raise ValueError(
            f"length={length} is too short for {task}: the prompt without haystack already "
            f"takes {lo_count} tokens and at most {upper} fit"
        )
    if lo_count >= lower:
        return draft.render(lo), lo_count
    hi, hi_count = None, None
    target = (lower + upper) / 2
    guess = min(draft.max_units, lo + 64)  # a probe to learn the tokens per unit
    for _ in range(60):
        n = max(lo + 1, min(guess, draft.max_units if hi is None else hi - 1))
        text = draft.render(n)
        tokens = count(text)
        if lower <= tokens <= upper:
            return text, tokens
        if tokens < lower:
            if n >= draft.max_units:
                raise ValueError(
                    f"{task}: the haystack runs out at {tokens} tokens below length={length}"
                )
            lo, lo_count = n, tokens
        else:
            hi, hi_count = n, tokens
        if hi is not None and hi - lo <= 1:
            return draft.render(lo), lo_count
        if hi is None:
            per_unit = max((lo_count - base) / max(lo - draft.min_units, 1), 1e-3)
            guess = lo + math.ceil((target - lo_count) / per_unit)
        else:
            per_unit = max((hi_count - lo_count) / (hi - lo), 1e-3)
            step = round((target - lo_count) / per_unit)
            guess = lo + min(max(step, 1), hi - lo - 1)
            if guess in (n, lo):  # secant stalls: bisect
                guess = (lo + hi) // 2
    return draft.render(lo), lo_count


# ----------------------------------------------------------------------------- registry


def _niah_spec(haystack, key="word", value="number", keys=1, values=1, queries=1, tokens=32):
    kw = dict(key_kind=key, value_kind=value, num_keys=keys, num_values=values, num_queries=queries)
    return _TaskSpec(_build_niah, tokens, haystack, tuple(kw.items()))


TASKS: dict[str, _TaskSpec] = {
    "niah_single_1": _niah_spec("noise"),
    "niah_single_2": _niah_spec("essay"),
    "niah_single_3": _niah_spec("essay", value="uuid", tokens=64),
    "niah_multikey_1": _niah_spec("essay", keys=4),
    "niah_multikey_2": _niah_spec("needles"),
    "niah_multikey_3": _niah_spec("needles", key="uuid", value="uuid", tokens=64),
    "niah_multivalue": _niah_spec("essay", values=4, tokens=64),
    "niah_multiquery": _niah_spec("essay", keys=4, queries=4, tokens=64),
    "vt": _TaskSpec(_build_vt, 32, "noise"),
    # Lists are often written one item a line: cwe does not stop at a newline.
    "cwe": _TaskSpec(_build_cwe, 64, "words", stop_at_newline=False),
    "fwe": _TaskSpec(_build_fwe, 32, "words"),
}
UNAVAILABLE_TASKS = {
    "qa_1": "needs SQuAD, which is not available offline",
    "qa_2": "needs HotpotQA, which is not available offline",
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
