"""The task builders of `uniprefill.eval.tasks`: each returns a `Draft` (a prompt renderer over a
haystack size, the reference answers and the needle depth) that `tasks.make_sample` fits to a
target token count.

NIAH variants place needles ("One of the special magic numbers for X is: V.") in noise text,
essays, distractor needles or word lists; VT chains variable assignments; CWE and FWE count
common or frequent words. All randomness comes from the `random.Random` passed in.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .haystack import EssayHaystack, needle_keys, noise_units, word_pool

NEEDLE = "One of the special magic {type} for {key} is: {value}."


@dataclass(frozen=True)
class Draft:
    render: Callable[[int], str]
    answers: tuple[str, ...]
    max_units: int
    min_units: int = 0
    depth: float | None = None


# ----------------------------------------------------------------------------- NIAH


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


def _build_niah(rng, essay, depth, haystack, length, *, key_kind, value_kind, num_keys,
                num_values, num_queries) -> Draft:
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
    return Draft(lambda n: head + body(n) + tail, answers, max_units, depth=depth)


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


def _build_vt(rng, essay, depth, haystack, length, *, num_hops: int = 4) -> Draft:
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
    return Draft(lambda n: head + body(n) + tail, tuple(names), 10**9)


def _build_cwe(rng, essay, depth, haystack, length, *, num_common: int = 10) -> Draft:
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

    return Draft(render, tuple(common), len(uncommon))


def _build_fwe(rng, essay, depth, haystack, length, *, alpha: float = 2.0,
               vocab: int = 1000) -> Draft:
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

    return Draft(render, tuple(coded[:3]), 10**9, min_units=100)
