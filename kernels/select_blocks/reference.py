"""PyTorch reference of block selection (top-p or keep-ratio per sequence): readable, not fast.

It follows the rules of `uniprefill.kernels.api.select_blocks` literally, one sequence at a time
with host loops; the Triton kernel (`kernel.py`) is tested against it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..rule import SelectionRule
from ..score_blocks.reference import block_token_counts


def forced_blocks(n_tokens: int, block_size: int, sink: int, last_q: int, device) -> torch.Tensor:
    """Blocks touching the first `sink` tokens or the last `last_q` tokens of one sequence."""
    starts = torch.arange(0, n_tokens, block_size, device=device)
    return (starts < sink) | (starts + block_size > n_tokens - last_q)


def select_blocks_reference(
    block_scores: torch.Tensor,
    cu_blocks: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    rule: SelectionRule,
) -> torch.Tensor:
    """Block keep flags, bool [total_blocks]; see `api.select_blocks` for the rules (rule.p and
    rule.sink: one number each, or a host tensor with one per sequence)."""
    keep = torch.zeros_like(block_scores, dtype=torch.bool)
    blocks, tokens = cu_blocks.tolist(), cu_seqlens_k.tolist()
    ps = rule.p.tolist() if rule.per_sequence_p else [rule.p] * (len(blocks) - 1)  # one p per sequence
    sinks = rule.sinks(len(blocks) - 1)
    for b in range(len(blocks) - 1):
        n_tokens = tokens[b + 1] - tokens[b]
        scores = block_scores[blocks[b] : blocks[b + 1]]
        if n_tokens < rule.sequence_min_tokens(sinks[b]) or (rule.keep_ratio is None and ps[b] >= 1.0):
            keep[blocks[b] : blocks[b + 1]] = True
            continue
        per_sequence = rule.per_sequence_p or rule.per_sequence_sink
        own = dataclasses.replace(rule, p=ps[b], sink=sinks[b]) if per_sequence else rule
        keep[blocks[b] : blocks[b + 1]] = select_one(scores, n_tokens, own)
    return keep


def select_one(scores: torch.Tensor, n_tokens: int, rule: SelectionRule) -> torch.Tensor:
    """One sequence's keep flags from its block scores (`api.select_blocks` defines the rules),
    under `rule` with one number as p and as sink; `rule.min_tokens` is not read (the caller decides
    whether the sequence is selected from at all).

    selection "paper": the forced blocks' scores count toward p * (all blocks' score);
    "content": p * (the free blocks' score) must be reached by free blocks alone.
    """
    block_size, keep_ratio = rule.block_size, rule.keep_ratio
    forced = forced_blocks(n_tokens, block_size, rule.sink, rule.last_q, scores.device)
    # Forced blocks first, then by descending score, ties to the lower block index: two
    # stable sorts, the secondary key first.
    order = torch.sort(scores, descending=True, stable=True).indices
    order = order[torch.sort(forced[order].to(torch.int8), descending=True, stable=True).indices]
    if keep_ratio is None:
        counted = scores if rule.selection == "paper" else scores.masked_fill(forced, 0.0)
        prefix = torch.cumsum(counted[order], dim=0)  # float32
        target = counted.sum() * rule.p
    else:
        prefix = torch.cumsum(block_token_counts(n_tokens, block_size, scores.device)[order], dim=0)
        target = math.ceil(keep_ratio * n_tokens)
    # Keep the shortest prefix whose sum reaches the target: every position whose sum
    # before it (the previous inclusive sum) is still short of it.
    n_keep = min(scores.shape[0], int((prefix < target).sum()) + 1)
    keep = forced.clone()
    keep[order[:n_keep]] = True
    return keep
