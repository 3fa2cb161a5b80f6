"""Where the last queries' attention goes at a full-attention layer: the measurement behind
`benchmarks/attention_mass.py` (its docstring says what the run does and how to run it).

- `ScoreProbe`: an attention function for transformers' `AttentionInterface` that returns SDPA's
  output unchanged and records, at every full-attention layer, the token scores the method uses
  (`kernels.score_blocks.reference.token_scores`).
- `needle_token_span`: the token ranges of the answers in a prompt.
- `layer_record`: one layer's shares (sink, window, needle, free blocks), the needle's rank
  among the free blocks, and what each selection rule (`RULES` x `PS`,
  `kernels.select_blocks.reference.select_one`) would keep if that layer were a drop point.
"""

from __future__ import annotations

import math

import torch

RULES = ("paper", "content")
PS = (0.9, 0.95, 0.99)


class ScoreProbe:
    """An attention function: SDPA's output, plus the token scores of each full layer."""

    def __init__(self, last_q: int):
        self.last_q = last_q
        self.scores: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        from uniprefill.kernels.score_blocks.reference import token_scores

        if kwargs.get("sliding_window") is None and query.shape[2] > 1:
            n = min(self.last_q, query.shape[2])
            q = query[0, :, -n:].transpose(0, 1).float()  # [n, H, d], scored in float32 as the method does
            k = key[0].transpose(0, 1).float()  # [N, Hk, d]
            scale = kwargs.get("scaling") or module.scaling
            self.scores[module.layer_idx] = token_scores(q, k, q.shape[1] // k.shape[1], scale).cpu()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def needle_token_span(tokenizer, prompt: str, answers) -> list[tuple[int, int]]:
    """Token index ranges [start, end) of each answer's first occurrence in the prompt."""
    enc = tokenizer(prompt, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    spans = []
    for answer in answers:
        at = prompt.find(str(answer))
        if at < 0:
            continue
        end = at + len(str(answer))
        toks = [i for i, (a, b) in enumerate(offsets) if b > at and a < end]
        if toks:
            spans.append((toks[0], toks[-1] + 1))
    return spans


def layer_record(scores, spans, *, block_size, sink, last_q) -> dict:
    from uniprefill.kernels.score_blocks.reference import block_means, block_token_counts
    from uniprefill.kernels.select_blocks.reference import forced_blocks, select_one
    from uniprefill.kernels.rule import SelectionRule

    n = scores.shape[0]
    blocks = block_means(scores, block_size)
    counts = block_token_counts(n, block_size, "cpu").float()
    mass = blocks * counts  # each block's share of the token scores (the sum is the head count)
    total = float(mass.sum())
    starts = torch.arange(0, n, block_size)
    sink_b = starts < sink
    window_b = (starts + block_size > n - last_q) & ~sink_b
    forced = forced_blocks(n, block_size, sink, last_q, "cpu")
    needle_b = torch.zeros_like(forced)
    for a, b in spans:
        needle_b[a // block_size : (b - 1) // block_size + 1] = True
    free = ~forced
    rec = {
        "tokens": n, "blocks": int(blocks.shape[0]),
        "sink_share": float(mass[sink_b].sum()) / total,
        "window_share": float(mass[window_b].sum()) / total,
        "needle_share": float(mass[needle_b & free].sum()) / total,
        "free_share": float(mass[free].sum()) / total,
        # by the block-mean score the selection sorts on; 0 = the top free block
        "needle_rank": _rank(blocks, free, needle_b),
        "free_blocks": int(free.sum()),
        **_free_shape(blocks, free),
    }
    for rule in RULES:
        for p in PS:
            keep = select_one(blocks, n, SelectionRule(block_size=block_size, sink=sink, last_q=last_q,
                                                       min_tokens=0, p=p, selection=rule))
            rec[f"{rule}@{p}_kept"] = float(counts[keep].sum()) / n
            rec[f"{rule}@{p}_needle"] = bool(keep[needle_b].all()) if needle_b.any() else None
    return rec


def _free_shape(blocks, free) -> dict:
    """Label-free properties of the free blocks' scores (candidates for choosing drop points)."""
    s = blocks[free].double()
    if s.numel() < 2 or float(s.sum()) <= 0:
        return {"free_peak": None, "free_entropy": None, "free_top8_share": None, "free_top": []}
    share = s / s.sum()
    entropy = float(-(share * share.clamp_min(1e-30).log()).sum()) / math.log(s.numel())
    top = torch.argsort(blocks.masked_fill(~free, float("-inf")), descending=True)[:16]
    return {
        "free_peak": float(s.max() / s.median().clamp_min(1e-30)),  # top block over the median one
        "free_entropy": entropy,  # 1 = uniform over the free blocks
        "free_top8_share": float(share.sort(descending=True).values[:8].sum()),
        "free_top": top.tolist(),  # the 16 best free blocks, for agreement between layers
    }


def _rank(blocks, free, needle_b) -> float | None:
    if not (needle_b & free).any():
        return None
    order = torch.argsort(blocks.masked_fill(~free, float("-inf")), descending=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.shape[0])
    return int(position[needle_b & free].max()) / max(1, int(free.sum()))
