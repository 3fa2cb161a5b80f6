"""Triton block selection: top-p (or keep-ratio) over one sequence's blocks per program.

Each program loads its sequence's block scores and sorts them once with `tl.sort` on
int64 keys that carry everything the order needs:

    key = forced << 48 | phi(score) << 16 | (0xFFFF - block)

`phi` maps the float32 bit pattern to an unsigned integer of the same order (flip all
bits of negatives, the sign bit of the rest), so one descending sort puts forced blocks
(sink and window) first, then the others by descending score, ties to the lower block
index. The block index is decoded from the low bits; the score is gathered again by
index, so nothing is rounded (with selection "content" the forced blocks' scores are read
as 0, in the sum and in the target). The prefix sums are float32 `tl.cumsum`; a sorted position is
kept while the sum BEFORE it is short of the target, i.e. the shortest prefix that reaches
it. Keys are unique, so "kept" is "key >= the key at the last kept position", which gives
the flags back in block order without a scatter.

Limit: a sequence may have at most `MAX_BLOCKS_PER_SEQUENCE` blocks (one program sorts
them all in registers); above it the host wrapper raises and names impl="torch".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import next_power_of_2, to_device
from ..rule import SelectionRule

MAX_BLOCKS_PER_SEQUENCE = 8192  # 512K tokens at block_size 64; the key has room for 65536
_KEEP_EVERYTHING = 2**31 - 1  # as min_len: every sequence is shorter, so all is kept


@triton.jit
def _select_blocks_kernel(
    scores_ptr, cu_blocks_ptr, cu_k_ptr, target_tokens_ptr, keep_ptr, p_ptr, sink_ptr,
    p, block_size, sink, last_q, min_len,
    TOP_P: tl.constexpr, PER_SEQUENCE_P: tl.constexpr, PER_SEQUENCE_SINK: tl.constexpr, CONTENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    if PER_SEQUENCE_P:
        p = tl.load(p_ptr + seq)
    if PER_SEQUENCE_SINK:  # min_len is then the rule's min_tokens: each sequence raises it to its sink + last_q
        sink = tl.load(sink_ptr + seq)
        min_len = tl.maximum(min_len, sink + last_q)
    first = tl.load(cu_blocks_ptr + seq)
    n_blocks = tl.load(cu_blocks_ptr + seq + 1) - first
    n_k = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    if n_blocks == 0:
        return
    offs = tl.arange(0, BLOCK)
    valid = offs < n_blocks
    score = tl.load(scores_ptr + first + offs, mask=valid, other=0.0)
    starts = offs * block_size
    forced = valid & ((starts < sink) | (starts + block_size > n_k - last_q))

    bits = score.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    ordered = tl.where((bits & 0x80000000) != 0, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    key = tl.where(valid, (forced.to(tl.int64) << 48) | (ordered << 16) | (0xFFFF - offs), -1)
    key_sorted = tl.sort(key, descending=True)
    sorted_ok = key_sorted >= 0
    block = 0xFFFF - (key_sorted & 0xFFFF)

    if TOP_P:
        counted = sorted_ok
        if CONTENT:  # only the free blocks' scores count (forced keys sort first, bit 48 set)
            counted = counted & ((key_sorted >> 48) == 0)
            score = tl.where(forced, 0.0, score)
        sorted_score = tl.load(scores_ptr + first + block, mask=counted, other=0.0)
        prefix = tl.cumsum(sorted_score, 0)
        target = tl.sum(score, 0) * p
    else:
        tokens = tl.where(sorted_ok, tl.minimum(n_k - block * block_size, block_size), 0)
        prefix = tl.cumsum(tokens, 0)
        target = tl.load(target_tokens_ptr + seq)
    n_keep = tl.sum((sorted_ok & (prefix < target)).to(tl.int32), 0) + 1
    # The key at the last kept position; -1 (keep all) when n_keep runs past the blocks.
    threshold = tl.max(tl.where(offs == n_keep - 1, key_sorted, -1), 0)
    if PER_SEQUENCE_P:  # p >= 1 keeps every block (the host decides this for one shared p)
        threshold = tl.where(p >= 1.0, -1, threshold)
    keep = forced | (key >= threshold) | (n_k < min_len)
    tl.store(keep_ptr + first + offs, keep.to(tl.int8), mask=valid)


def select_blocks_fwd(
    block_scores: torch.Tensor,
    cu_blocks: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    rule: SelectionRule,
    *,
    max_blocks_per_sequence: int,
) -> torch.Tensor:
    """Host wrapper: one program per sequence; returns block_keep bool [total_blocks]."""
    p, keep_ratio, block_size = rule.p, rule.keep_ratio, rule.block_size
    if max_blocks_per_sequence > MAX_BLOCKS_PER_SEQUENCE:
        raise ValueError(
            f"the Triton selection sorts at most {MAX_BLOCKS_PER_SEQUENCE} blocks per sequence "
            f"in one program, got {max_blocks_per_sequence} (block_size={block_size}); use a "
            "larger block_size or impl='torch'"
        )
    batch = cu_blocks.shape[0] - 1
    keep = torch.empty(block_scores.shape[0], dtype=torch.int8, device=block_scores.device)
    if block_scores.shape[0] == 0:
        return keep.view(torch.bool)
    per_sequence, per_sequence_sink = rule.per_sequence_p, rule.per_sequence_sink
    min_len = rule.min_tokens if per_sequence_sink else rule.effective_min_tokens
    # the kernel reads element `seq` of each: contiguous copies (a host view may be strided)
    p_values = to_device(p.contiguous(), block_scores.device) if per_sequence else block_scores
    # a sink at least a sequence's length forces all of it: capped at 2**30, each fits int32 beside `last_q`
    sinks = (to_device(rule.sink.clamp(max=2**30).to(torch.int32).contiguous(), block_scores.device)
             if per_sequence_sink else block_scores)  # (unused if one p / one sink)
    if keep_ratio is None and not per_sequence and p >= 1.0:
        min_len = _KEEP_EVERYTHING
    if keep_ratio is None:
        target_tokens = cu_seqlens_k  # unused by the top-p variant
    else:
        # ceil(r * len) in float64, as the reference computes it with Python floats.
        lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.float64)
        target_tokens = torch.ceil(lengths * keep_ratio).to(torch.int32)
    # On the GPU, at least 256 lanes: fewer sizes to compile, at no cost. The CPU
    # interpreter runs each sorting stage in Python, so it gets the smallest block.
    block = max(256 if block_scores.is_cuda else 16, next_power_of_2(max_blocks_per_sequence))
    _select_blocks_kernel[(batch,)](
        block_scores, cu_blocks, cu_seqlens_k, target_tokens, keep, p_values, sinks,
        1.0 if per_sequence else float(p), block_size, 0 if per_sequence_sink else rule.sink, rule.last_q,
        min(min_len, _KEEP_EVERYTHING),
        TOP_P=keep_ratio is None, PER_SEQUENCE_P=per_sequence and keep_ratio is None,
        PER_SEQUENCE_SINK=per_sequence_sink,
        CONTENT=rule.selection == "content" and keep_ratio is None, BLOCK=block,
        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,
    )
    return keep.view(torch.bool)
