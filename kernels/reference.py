"""PyTorch reference of block scoring, block selection and compaction: readable, not fast.

It follows the definitions in `uniprefill.kernels.api` literally, one sequence at a time,
and materialises each sequence's [heads, queries, keys] score matrix in float32, a few
heads at a time so that memory stays bounded (`_SCORE_ELEMENTS` floats per chunk). The
Triton kernels are tested against it; it runs on any device (host loops, host syncs).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._common import cdiv
from .rule import SelectionRule
from .validation import VarlenLayout

# Score-matrix elements materialised at once (256 MiB of float32).
_SCORE_ELEMENTS = 1 << 26


def score_blocks_reference(
    q: torch.Tensor, k: torch.Tensor, layout: VarlenLayout, *, block_size: int, scale: float
) -> torch.Tensor:
    """Block scores, float32 [total_blocks]; see `api.score_blocks` for the definition."""
    group = q.shape[1] // k.shape[1]
    out = []
    q_start = k_start = 0
    for n_q, n_k in zip(layout.seqlens_q, layout.seqlens_k):
        q_i = q[q_start : q_start + n_q].float()
        k_i = k[k_start : k_start + n_k].float()
        q_start, k_start = q_start + n_q, k_start + n_k
        if n_k == 0:
            continue
        token = _token_scores(q_i, k_i, group, scale)
        out.append(_block_means(token, block_size))
    if not out:
        return torch.zeros(0, dtype=torch.float32, device=q.device)
    return torch.cat(out)


def _token_scores(q_i: torch.Tensor, k_i: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """sum over heads of mean over queries of softmax(q k^T * scale), causal: [n_k]."""
    n_q, n_k = q_i.shape[0], k_i.shape[0]
    positions = torch.arange(n_k - n_q, n_k, device=q_i.device)
    hidden = torch.arange(n_k, device=q_i.device)[None, :] > positions[:, None]  # [n_q, n_k]
    heads_at_once = max(1, min(group, _SCORE_ELEMENTS // max(1, n_q * n_k)))
    token = torch.zeros(n_k, dtype=torch.float32, device=q_i.device)
    for kv_head in range(k_i.shape[1]):
        keys = k_i[:, kv_head]  # [n_k, d]
        for h0 in range(0, group, heads_at_once):
            heads = slice(kv_head * group + h0, kv_head * group + min(group, h0 + heads_at_once))
            scores = torch.einsum("qhd,kd->hqk", q_i[:, heads], keys) * scale
            scores.masked_fill_(hidden, float("-inf"))
            token += torch.softmax(scores, dim=-1).sum(dim=(0, 1)) / n_q
    return token


def _block_means(token: torch.Tensor, block_size: int) -> torch.Tensor:
    n_k = token.shape[0]
    n_blocks = cdiv(n_k, block_size)
    padded = torch.zeros(n_blocks * block_size, dtype=token.dtype, device=token.device)
    padded[:n_k] = token
    return padded.view(n_blocks, block_size).sum(1) / block_token_counts(n_k, block_size, token.device)


def block_offsets(cu_seqlens_k: torch.Tensor, block_size: int) -> torch.Tensor:
    """cu_blocks int32 [B+1] from cu_seqlens_k, on device, without a host sync."""
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    cu_blocks = torch.zeros(cu_seqlens_k.shape[0], dtype=torch.int32, device=cu_seqlens_k.device)
    cu_blocks[1:] = torch.cumsum((lengths + block_size - 1) // block_size, dim=0)
    return cu_blocks


def block_token_counts(n_tokens: int, block_size: int, device) -> torch.Tensor:
    """Real tokens in each block of one sequence (the last block may be partial)."""
    starts = torch.arange(0, n_tokens, block_size, device=device)
    return (n_tokens - starts).clamp(max=block_size)


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
    """Block keep flags, bool [total_blocks]; see `api.select_blocks` for the rules (rule.p:
    one number, or a host tensor with one per sequence)."""
    keep = torch.zeros_like(block_scores, dtype=torch.bool)
    blocks, tokens = cu_blocks.tolist(), cu_seqlens_k.tolist()
    ps = rule.p.tolist() if rule.per_sequence_p else [rule.p] * (len(blocks) - 1)  # one p per sequence
    for b in range(len(blocks) - 1):
        n_tokens = tokens[b + 1] - tokens[b]
        scores = block_scores[blocks[b] : blocks[b + 1]]
        if n_tokens < rule.effective_min_tokens or (rule.keep_ratio is None and ps[b] >= 1.0):
            keep[blocks[b] : blocks[b + 1]] = True
            continue
        own = dataclasses.replace(rule, p=ps[b]) if rule.per_sequence_p else rule
        keep[blocks[b] : blocks[b + 1]] = select_one(scores, n_tokens, own)
    return keep


def select_one(scores: torch.Tensor, n_tokens: int, rule: SelectionRule) -> torch.Tensor:
    """One sequence's keep flags from its block scores (`api.select_blocks` defines the rules),
    under `rule` with one number as p; `rule.min_tokens` is not read (the caller decides
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


def compact_tokens_reference(
    block_keep: torch.Tensor, cu_blocks: torch.Tensor, cu_seqlens_k: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Token indices, kept lengths and host counts, with PyTorch ops and one host copy.

    Works on blocks until the very end: per block its first packed token and its kept
    token count; an inclusive cumsum of the counts, read at `cu_blocks`, gives each
    sequence's kept count (copied to the host once, to size the output), and each output
    slot finds its block with `searchsorted` over the cumsum. No torch.nonzero.
    """
    device = block_keep.device
    cu_blocks = cu_blocks.to(torch.int64)
    cu_seqlens_k = cu_seqlens_k.to(torch.int64)
    block = torch.arange(block_keep.shape[0], device=device)
    seq = torch.searchsorted(cu_blocks[1:], block, right=True)  # the sequence of each block
    start = cu_seqlens_k[seq] + (block - cu_blocks[seq]) * block_size
    end = torch.minimum(start + block_size, cu_seqlens_k[seq + 1])
    kept = torch.where(block_keep, end - start, 0)
    kept_before_next = torch.cumsum(kept, dim=0)  # inclusive

    cu_kept = torch.zeros_like(cu_seqlens_k)
    if block_keep.shape[0]:
        cu_kept[1:] = torch.cat([kept_before_next.new_zeros(1), kept_before_next])[cu_blocks[1:]]
    kept_counts = (cu_kept[1:] - cu_kept[:-1]).tolist()  # the one device-to-host sync
    total = sum(kept_counts)

    slot = torch.arange(total, device=device)
    owner = torch.searchsorted(kept_before_next, slot, right=True)  # the kept block of each slot
    kept_idx = start[owner] + slot - (kept_before_next[owner] - kept[owner])
    return kept_idx, cu_kept.to(torch.int32), kept_counts
