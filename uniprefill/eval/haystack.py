"""Haystack material and vocabularies for the synthetic long-context tasks.

Two haystacks: the built-in *noise* text (five short sentences repeated) and an *essay*
text read from a file the caller names (the Paul Graham essays of RULER, or any text).
A haystack is handed to the task generators as a list of units (sentences or words) so
that a prompt can be grown or shrunk one unit at a time to meet a token budget.

The essay file is read where it lies, never copied: `.json` files may hold `{"text": str}`,
a list of strings, or a list of `{"text": str}` records; anything else is read as text.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import os
import random
from dataclasses import dataclass

NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

# Keys of the needles are "adjective-noun" pairs (e.g. "quiet-lantern"): 120 x 120 keys.
ADJECTIVES = tuple(
    """
    able acid angry ashen bitter black blank bold brave brief bright broad brown busy calm
    cheap chief clean clear close cold cool crisp curly damp dark deep dense dizzy dry dull
    eager early empty equal faint false fancy fast fierce firm flat fond fresh full fuzzy
    giant glad gold grand gray great green grim happy hard harsh heavy hidden high hollow
    huge humble icy idle jolly keen kind large late lazy light little live lone long loud
    lucky mild misty modern narrow neat new nice noble odd old open pale plain polite proud
    pure quick quiet rapid rare raw red rich rigid ripe rough round royal rusty sad safe
    salty sharp shiny short silent silly simple slim slow small smooth soft solid sour
    spare stale steep stiff still
    """.split()
)
NOUNS = tuple(
    """
    acorn anchor apple arrow badge bagel banjo barrel basket beacon bell bench blanket
    bottle bridge broom bucket button cabin camera candle canoe carpet castle cellar chair
    cherry circle clock cloud coconut comet compass cookie copper cradle crayon crown
    cup curtain daisy desk diamond dolphin donkey drawer drum eagle engine falcon feather
    fence fiddle flag flute forest fountain garden garlic glove goblet guitar hammer harbor
    helmet hinge honey island jacket jigsaw kettle kite ladder lantern lemon lizard locket
    magnet maple marble meadow mirror mitten needle nest noodle oyster paddle parrot pebble
    pencil pepper piano pillow planet pocket puzzle quilt rabbit ribbon river rocket saddle
    satchel scarf shovel sparrow spoon statue teapot thimble ticket tiger tractor trumpet
    tulip tunnel turnip umbrella valley violin wagon walnut whistle window
    """.split()
)
# Real words for the common/uncommon word lists of `cwe`; made-up words extend the pool.
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def noise_units() -> tuple[str, ...]:
    """The sentences of the noise haystack; a haystack of n units cycles through them."""
    return NOISE_SENTENCES


def needle_keys() -> list[str]:
    """Every distinct "adjective-noun" needle key, in a fixed order."""
    return [f"{a}-{n}" for a, n in itertools.product(ADJECTIVES, NOUNS)]


def word_pool(count: int) -> list[str]:
    """`count` distinct lowercase words: real words first, then pronounceable made-up ones."""
    return list(_word_pool(count))


@functools.lru_cache(maxsize=2)
def _word_pool(count: int) -> tuple[str, ...]:
    words = list(dict.fromkeys(ADJECTIVES + NOUNS))
    seen = set(words)
    rng = random.Random("uniprefill-word-pool")  # fixed: the pool never changes
    syllables = [c + v for c, v in itertools.product(_CONSONANTS, _VOWELS)]
    while len(words) < count:
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(2, 4)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return tuple(words[:count])


@dataclass(frozen=True)
class EssayHaystack:
    """Essay text as words, with the indices after which a sentence ends.

    Attributes:
        name: short label of the source (the file name), recorded with each sample.
        words: the whitespace-separated words of the text.
        sentence_ends: sorted indices i such that words[i] ends a sentence.
    """

    name: str
    words: tuple[str, ...]
    sentence_ends: tuple[int, ...]

    def take(self, start: int, count: int) -> list[str]:
        """`count` words from `start`, wrapping to the beginning as often as needed."""
        size = len(self.words)
        start %= size
        out: list[str] = []
        while len(out) < count:
            out.extend(self.words[start : start + count - len(out)])
            start = 0
        return out

    def sentence_start(self, index: int) -> int:
        """The first word of the sentence containing word `index` (the text wraps)."""
        pos = bisect.bisect_left(self.sentence_ends, index) - 1
        return self.sentence_ends[pos] + 1 if pos >= 0 else 0


def load_essay_haystack(path: str | os.PathLike) -> EssayHaystack:
    """Read an essay haystack file (cached per path and modification time)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"haystack file {path!r} does not exist")
    return _load_essay(os.path.abspath(path), os.path.getmtime(path))


@functools.lru_cache(maxsize=4)
def _load_essay(path: str, _mtime: float) -> EssayHaystack:
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    text = _text_of(raw) if path.endswith(".json") else raw
    words = tuple(text.split())
    if len(words) < 100:
        raise ValueError(f"haystack file {path!r} holds only {len(words)} words; need >= 100")
    ends = tuple(i for i, w in enumerate(words) if w.endswith((".", "?", "!")))
    return EssayHaystack(os.path.basename(path), words, ends or (len(words) - 1,))


def _text_of(raw: str) -> str:
    data = json.loads(raw)
    if isinstance(data, dict) and isinstance(data.get("text"), str):
        return data["text"]
    if isinstance(data, list):
        parts = [d["text"] if isinstance(d, dict) else d for d in data]
        if all(isinstance(p, str) for p in parts):
            return "\n".join(parts)
    raise ValueError(
        'a JSON haystack must be {"text": str}, a list of strings or a list of {"text": str}'
    )
