"""The same prompts answered by two systems, scored and compared pair by pair.

`make_prompts` makes the `Sample`s `uniprefill eval` makes (same seed, lengths and tokenizer);
`score_records` scores one system's answers (RULER's metrics, `scoring.score`) as JSON-able
records; `compare` pairs two systems' records by (task, length, index, seed) and gives per
length the mean scores and the paired difference with its bootstrap 95% CI. Used by
scripts/gpu/vllm/needle_parity.py (standard vLLM against vLLM with uniprefill).
"""

from __future__ import annotations

from collections import defaultdict


def make_prompts(tokenizer, tasks: list[str], lengths: list[int], samples: int, haystack, seed: int = 0) -> list:
    """The `Sample`s of every (task, length, index), as `uniprefill eval` makes them."""
    from uniprefill.eval.tasks import make_sample

    return [make_sample(task, tokenizer, length, i, seed=seed, haystack=haystack)
            for length in lengths for task in tasks for i in range(samples)]


def score_records(samples: list, texts: list[str], system: str, extra: dict | None = None) -> list[dict]:
    """One JSON-able record per sample: its key, the prediction and its score."""
    from uniprefill.eval.scoring import score

    if len(samples) != len(texts):
        raise ValueError(f"{len(samples)} samples but {len(texts)} outputs")
    return [{"system": system, "task": s.task, "length": s.length, "index": s.index, "seed": s.seed,
             "num_tokens": s.num_tokens, "answers": list(s.answers), "prediction": text,
             "score": score(s.task, text, s.answers), **(extra or {})} for s, text in zip(samples, texts)]


def compare(base: list[dict], other: list[dict], n_boot: int = 10_000) -> list[dict]:
    """Per length (and overall): mean scores and the paired difference other - base with its
    bootstrap 95% CI, over the prompts both answered."""
    from uniprefill.eval.scoring import paired_bootstrap_ci

    def key(r):
        return r["task"], r["length"], r["index"], r["seed"]

    mine = {key(r): r for r in other}
    pairs = defaultdict(list)  # length -> [(base record, other record)]
    for r in base:
        if key(r) in mine:
            pairs[r["length"]].append((r, mine[key(r)]))
    rows = []
    for length in sorted(pairs) + ["all"]:
        both = pairs[length] if length != "all" else [p for v in pairs.values() for p in v]
        if not both:
            continue
        a, b = [x["score"] for x, _ in both], [y["score"] for _, y in both]
        delta, low, high = paired_bootstrap_ci(a, b, n_boot=n_boot)
        rows.append({"length": length, "n": len(both), "base": 100 * sum(a) / len(a), "other": 100 * sum(b) / len(b),
                     "delta": delta, "ci": [low, high],
                     "same_prediction": sum(1 for x, y in both if x["prediction"] == y["prediction"])})
    return rows
