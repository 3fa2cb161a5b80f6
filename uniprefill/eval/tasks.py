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
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .haystack import (
    EssayHaystack,
    load_essay_haystack,
    needle_keys,
    noise_units,
    word_pool,
)

NEEDLE = "One of the special magic {type} for {key} is: {value}."
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
class _Draft:
    render: Callable[[int], str]
    answers: tuple[str, ...]
    max_units: int
    min_units: int = 0
    depth: float | None = None


@dataclass(frozen=True)
class _TaskSpec:
    build: Callable[..., _Draft]
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


def _fit(draft: _Draft, count, lower: int, upper: int, task: str, length: int):
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


# ----------------------------------------------------------------------------- NIAH


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


def _build_niah(rng, essay, depth, haystack, length, *, key_kind, value_kind, num_keys,
                num_values, num_queries) -> _Draft:
    type_ = "numbers" if value_kind == "number" else "uuids"
    if key_kind == "word":
        keys = needle_keys()
        rng.shuffle(keys)
    else:
        keys = [_random_value(rng, "uuid") for _ in range(num_keys)]
    targets, spare_keys = keys[:num_keys], keys[num_keys:]
    needles = [(k, _random_value(rng, value_kind)) for k in targets for _ in range(num_values)]
    depths = [depth] + [rng.random() for _ in needles[1:]]
    placed = sorted(
        zip(depths, (NEEDLE.format(type=type_, key=k, value=v) for k, v in needles)),
        key=lambda item: item[0],
    )
    queried = targets[:num_queries]
    answers = tuple(v for k, v in needles if k in queried)
    key_text = _join_keys(queried)
    head = (f"The text below hides some special magic {type_}. Read it carefully and "
            f"remember them: you will be asked about the {type_} afterwards.\n")
    tail = (f"\nWhat are all the special magic {type_} for {key_text} mentioned in the "
            f"provided text? The special magic {type_} for {key_text} mentioned in the "
            f"provided text are")
    if haystack == "essay":
        start = essay.sentence_start(rng.randrange(len(essay.words)))
        body, max_units = _essay_body(essay, start, placed), 10**9
    elif haystack == "noise":
        body, max_units = _noise_body(placed), 10**9
    else:
        sub_rng = random.Random(rng.getrandbits(64))
        if key_kind == "word":
            fresh = iter(spare_keys).__next__
            max_units = len(spare_keys)
        else:
            fresh = lambda: _random_value(sub_rng, "uuid")  # noqa: E731
            max_units = 10**9
        line = lambda: NEEDLE.format(  # noqa: E731
            type=type_, key=fresh(), value=_random_value(sub_rng, value_kind))
        body = _lines_body(_Growing(line), placed)
    return _Draft(lambda n: head + body(n) + tail, answers, max_units, depth=depth)


def _insert(units: list[str], placed, positions: Sequence[int], sep: str) -> str:
    """Join `units` with the placed texts inserted before the given unit positions."""
    out: list[str] = []
    prev = 0
    for (_, text), pos in zip(placed, positions):
        out.extend(units[prev:pos])
        out.append(text)
        prev = pos
    out.extend(units[prev:])
    return sep.join(out)


def _noise_body(placed):
    sentences = noise_units()

    def render(n: int) -> str:
        units = [sentences[i % len(sentences)] for i in range(n)]
        return _insert(units, placed, [round(d * n) for d, _ in placed], " ")

    return render


def _essay_body(essay: EssayHaystack, start: int, placed):
    size = len(essay.words)

    def render(n: int) -> str:
        words = essay.take(start, n)
        positions = []
        for d, _ in placed:  # move each needle back to the start of its sentence
            j = round(d * n)
            g = (start + j) % size
            back = j - (g - essay.sentence_start(g))
            positions.append(max(back, positions[-1] if positions else 0, 0))
        return _insert(words, placed, positions, " ")

    return render


class _Growing:
    """A list drawn from `make()` on demand; its prefixes never change."""

    def __init__(self, make: Callable[[], str]):
        self._make, self._items = make, []

    def __getitem__(self, count: int) -> list[str]:
        while len(self._items) < count:
            self._items.append(self._make())
        return self._items[:count]


def _lines_body(lines: _Growing, placed):
    def render(n: int) -> str:
        return _insert(lines[n], placed, [round(d * n) for d, _ in placed], "\n")

    return render


# ----------------------------------------------------------------------------- VT / CWE / FWE


def _build_vt(rng, essay, depth, haystack, length, *, num_hops: int = 4) -> _Draft:
    """Variable tracking: one chain `VAR A = 12345. VAR B = VAR A. ...` in noise text."""
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}."]
    chain += [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    placed = list(zip(sorted(rng.random() for _ in chain), chain))
    body = _noise_body(placed)
    head = "Memorize and track the chain of variable assignments hidden in the following text.\n"
    tail = (f"\nQuestion: Find all variables that are assigned the value {value} in the text "
            f"above. Answer: According to the chain of variable assignments in the text above, "
            f"{len(names)} variables are assigned the value {value}, they are:")
    return _Draft(lambda n: head + body(n) + tail, tuple(names), 10**9)


def _build_cwe(rng, essay, depth, haystack, length, *, num_common: int = 10) -> _Draft:
    """Common words: `num_common` words repeated often among words repeated 3 times."""
    pool = word_pool(30_000)
    rng.shuffle(pool)
    common, uncommon = pool[:num_common], pool[num_common:]
    # 30 repeats as RULER, fewer at short lengths so the common words leave room for the rest.
    repeats = min(30, max(6, length // 160))
    order_seed = rng.getrandbits(64)
    head = ("Below is a numbered list of words. Some words appear many times in the list; "
            "find the ones that appear most often.\n")
    tail = (f"\nQuestion: What are the {num_common} most common words in the list above? "
            f"Answer: The {num_common} words that appear most often in the list are:")

    def render(n: int) -> str:
        words = common * repeats + uncommon[:n] * 3
        random.Random(f"{order_seed}:{n}").shuffle(words)
        return head + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words)) + tail

    return _Draft(render, tuple(common), len(uncommon))


def _build_fwe(rng, essay, depth, haystack, length, *, alpha: float = 2.0,
               vocab: int = 1000) -> _Draft:
    """Frequent words: coded words with Zipf(alpha) counts; the answer is the top three."""
    coded: list[str] = []
    while len(coded) < vocab:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
        if word not in coded:
            coded.append(word)
    weights = [r ** -alpha for r in range(1, vocab + 1)]
    total = sum(weights)
    shares = [w / total for w in weights]
    order_seed = rng.getrandbits(64)
    head = ("Read the coded text below and keep track of how often each coded word appears. "
            "Find the three coded words that appear most often.\n")
    tail = ("\nQuestion: What are the three most frequently appearing coded words in the text "
            "above? Answer: According to the coded text above, the three most frequently "
            "appearing words are:")

    def render(n: int) -> str:
        # Counts are floor(n * share): the top four stay strictly ordered for n >= 100.
        words = [w for w, s in zip(coded, shares) for _ in range(int(n * s))]
        random.Random(f"{order_seed}:{n}").shuffle(words)
        return head + " ".join(words) + tail

    return _Draft(render, tuple(coded[:3]), 10**9, min_units=100)


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
