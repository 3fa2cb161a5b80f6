"""Quick checks that a loaded real model is sane: a greedy completion and one needle.

These are smoke checks for a freshly converted checkpoint (a wrong GGUF load answers
garbage), not an evaluation; `uniprefill.eval` holds the real harness. The needle prompt is
completion style, since the embedded models are base models:
"<haystack with the needle inside> ... What is the special magic number for Zurich?
The special magic number for Zurich is:".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

__all__ = ["NeedleResult", "greedy_complete", "needle_check", "needle_prompt", "read_haystack"]

NEEDLE = "The special magic number for Zurich is: 4817293."
QUESTION = "What is the special magic number for Zurich? The special magic number for Zurich is:"
ANSWER = "4817293"


@dataclasses.dataclass(frozen=True)
class NeedleResult:
    """Outcome of one needle-in-a-haystack prompt.

    Attributes:
        n_tokens: prompt length in tokens, special tokens included.
        depth: where the needle sits, as a share of the haystack (0 = start, 1 = end).
        answer: the greedy continuation, decoded.
        found: whether `answer` contains the needle's number.
    """

    n_tokens: int
    depth: float
    answer: str
    found: bool


def read_haystack(path: str | Path) -> str:
    """The text of a haystack file: plain text, or JSON `{"text": ...}` (PaulGrahamEssays.json)."""
    raw = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix == ".json":
        return json.loads(raw)["text"]
    return raw


@torch.no_grad()
def greedy_complete(model, tokenizer, prompt: str, max_new_tokens: int = 16) -> str:
    """Greedy continuation of `prompt` (the continuation only, decoded)."""
    device = next(model.parameters()).device
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def needle_prompt(tokenizer, haystack: str, n_tokens: int, depth: float = 0.5) -> str:
    """A prompt of about `n_tokens` tokens: haystack, `NEEDLE` at `depth`, then `QUESTION`."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    overhead = len(tokenizer(f" {NEEDLE} \n\n{QUESTION}").input_ids) + 1
    budget = n_tokens - overhead
    hay_ids = tokenizer(haystack, add_special_tokens=False).input_ids
    if budget <= 0 or budget > len(hay_ids):
        raise ValueError(
            f"n_tokens={n_tokens} needs a haystack of {budget} tokens; it has {len(hay_ids)}"
        )
    cut = int(budget * depth)
    before = tokenizer.decode(hay_ids[:cut])
    after = tokenizer.decode(hay_ids[cut:budget])
    return f"{before} {NEEDLE} {after}\n\n{QUESTION}"


def needle_check(
    model, tokenizer, haystack: str, n_tokens: int, depth: float = 0.5, max_new_tokens: int = 10
) -> NeedleResult:
    """Ask for the needle in a prompt of about `n_tokens` tokens; greedy decoding."""
    prompt = needle_prompt(tokenizer, haystack, n_tokens, depth)
    answer = greedy_complete(model, tokenizer, prompt, max_new_tokens)
    length = len(tokenizer(prompt).input_ids)
    return NeedleResult(n_tokens=length, depth=depth, answer=answer, found=ANSWER in answer)
