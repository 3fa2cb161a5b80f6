"""Public score-and-select API: score token blocks, choose the blocks to keep, compact.

Packed variable-length batches throughout (`cu_seqlens`, as in flash-attention varlen).
`impl` picks the implementation explicitly and never falls back silently:

- "torch": the PyTorch references (`<op>/reference.py`), any device;
- "triton": the Triton kernels (`<op>/kernel.py` of `score_blocks/`, `select_blocks/`,
  `compact/`); CUDA tensors, or any tensors when TRITON_INTERPRET=1 (Triton's CPU
  interpreter, for tests);
- "auto": "triton" on CUDA tensors, "torch" elsewhere.

Host syncs: `score_blocks` reads `cu_seqlens_q`/`cu_seqlens_k` to the host once (to check
them and size its output) unless the caller passes them as `host_cu_seqlens`;
`select_blocks` needs none when told `max_seqlen_k` (or when B == 1); `compact_tokens`
makes exactly one (the kept counts). `score_and_select` given `host_cu_seqlens` therefore
syncs once per call. Triton is imported only when a Triton implementation runs.

The selection settings travel as one `SelectionRule` (`rule.py`, re-exported here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .compact.reference import compact_tokens_reference
from .score_blocks.reference import block_offsets, score_blocks_reference
from .select_blocks.reference import select_blocks_reference
from ._common import cdiv
from .rule import SelectionRule  # re-exported: `api.SelectionRule`
from .validation import (
    check_compact_inputs,
    check_int,
    check_rule,
    check_score_inputs,
    check_select_inputs,
    read_layout,
    resolve_impl,
)

HostCuSeqlens = tuple[Sequence[int], Sequence[int]]


def score_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int,
    *,
    block_size: int,
    scale: float,
    impl: str = "auto",
    host_cu_seqlens: HostCuSeqlens | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention-weighted importance of each block of keys.

    Args:
        q: [total_q, Hq, d], the LAST min(last_q, len_i) queries of each sequence i, packed
            by `cu_seqlens_q`; any strides; bf16, fp16 or fp32.
        k: [total_k, Hk, d], all keys, packed by `cu_seqlens_k` (len_i is the difference of
            consecutive entries); any strides; q's dtype. Hq % Hk == 0 (GQA: q head h uses
            kv head h // (Hq // Hk)).
        cu_seqlens_q, cu_seqlens_k: int32 or int64 [B+1], from 0 to total_q / total_k.
        max_seqlen_k: at least the longest len_i (it sizes the grids).
        block_size: G, keys per block.
        scale: the softmax scale (usually d ** -0.5).
        impl: "auto", "triton" or "torch" (see the module docstring).
        host_cu_seqlens: optional (cu_seqlens_q, cu_seqlens_k) as host ints, when the caller
            has them; saves the one device-to-host copy. They must equal the tensors.

    Query j of sequence i sits at position len_i - q_len_i + j and sees key t iff t is at
    or before that position (causal). The softmax runs over ALL visible keys of each query
    in float32; the probabilities are averaged over the sequence's queries, summed over the
    Hq heads (so a sequence's token scores sum to Hq), and averaged over each block of
    `block_size` keys (the last, partial block over its real keys).

    Returns:
        (block_scores float32 [total_blocks], cu_blocks int32 [B+1]), with
        blocks_i = ceil(len_i / block_size).
    """
    check_score_inputs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, block_size, scale)
    impl = resolve_impl(impl, q.device)
    layout = read_layout(
        cu_seqlens_q, cu_seqlens_k, total_q=q.shape[0], total_k=k.shape[0],
        max_seqlen_k=max_seqlen_k, host_cu_seqlens=host_cu_seqlens,
    )
    if impl == "torch":
        scores = score_blocks_reference(q, k, layout, block_size=block_size, scale=scale)
        return scores, block_offsets(cu_seqlens_k, block_size)
    from .score_blocks.kernel import score_blocks_fwd

    return score_blocks_fwd(q, k, cu_seqlens_q, cu_seqlens_k, layout, block_size=block_size, scale=scale)


def select_blocks(
    block_scores: torch.Tensor,
    cu_blocks: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    rule: SelectionRule,
    *,
    impl: str = "auto",
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Which blocks to keep: bool [total_blocks], under `rule` (whose fields are named below).

    Forced blocks are every block touching the first `sink` tokens or the last `last_q`
    tokens of its sequence; they are always kept, and they COUNT TOWARD p. `sink` is one
    number, or a host int tensor [B] with each sequence's own (a serving engine's step that
    mixes whole prompts with last chunks whose context holds their sink tokens).

    - Top-p (`keep_ratio` None): keep the smallest set of blocks that contains the forced
      blocks and whose score sum is >= p * (the sum of all the sequence's block scores).
      Blocks are taken in the order: forced first, then the others by descending score,
      ties to the lower block index; the prefix sums are float32, and a block is kept
      while the sum before it is below the target. p >= 1 keeps every block. `p` is one
      number, or a host float32 tensor [B] with each sequence's own p (checked on the host,
      copied to the device without a sync; a serving engine's per-request p).
      `selection="content"` changes whose score p is a share of: the free (not forced)
      blocks, taken in the same order after the forced blocks, must sum to
      >= p * (the sum of the free blocks' scores); the forced blocks' scores count for
      nothing. ("paper", the default, is the rule above.)
    - Keep ratio r: keep the forced blocks, then the highest-scoring blocks (same order)
      until the kept TOKEN count is >= ceil(r * len_i).

    A sequence with len_i < max(min_tokens, sink_i + last_q) keeps every block.
    `max_seqlen_k` (the longest len_i, or a bound) sizes the Triton sort without a host
    sync; left None with B > 1, the Triton path reads `cu_blocks` to the host once.
    The Triton path handles at most `select_blocks.MAX_BLOCKS_PER_SEQUENCE` blocks per
    sequence and raises `ValueError` above it (impl="torch" has no limit).
    """
    check_select_inputs(block_scores, cu_blocks, cu_seqlens_k, rule)
    impl = resolve_impl(impl, block_scores.device)
    if impl == "torch":
        return select_blocks_reference(block_scores, cu_blocks, cu_seqlens_k, rule)
    from .select_blocks.kernel import select_blocks_fwd

    if max_seqlen_k is not None:
        check_int("max_seqlen_k", max_seqlen_k, low=0)
        most_blocks = cdiv(max_seqlen_k, rule.block_size)
    elif cu_blocks.shape[0] == 2:
        most_blocks = block_scores.shape[0]
    else:
        most_blocks = int((cu_blocks[1:] - cu_blocks[:-1]).max())  # a host sync
    return select_blocks_fwd(block_scores, cu_blocks, cu_seqlens_k, rule, max_blocks_per_sequence=most_blocks)


def compact_tokens(
    block_keep: torch.Tensor,
    cu_blocks: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_size: int,
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The kept tokens, from the kept blocks.

    Returns:
        kept_idx: int64 [T], indices into the packed token axis, in original order (the
            Triton path returns a view of a buffer sized for all tokens).
        cu_seqlens_kept: int32 [B+1], on block_keep's device.
        kept_counts: list[int] on the host, the kept tokens of each sequence (T in all).

    Makes exactly one device-to-host copy (the per-sequence counts); no torch.nonzero.
    Both implementations give identical results.
    """
    check_compact_inputs(block_keep, cu_blocks, cu_seqlens_k, block_size)
    if resolve_impl(impl, block_keep.device) == "torch":
        return compact_tokens_reference(block_keep, cu_blocks, cu_seqlens_k, block_size)
    from .compact.kernel import compact_tokens_fwd

    return compact_tokens_fwd(block_keep, cu_blocks, cu_seqlens_k, block_size)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Everything `score_and_select` computed, for the runtime and for inspection."""

    kept_idx: torch.Tensor  # int64 [T], packed token indices of the kept tokens, in order
    cu_seqlens_kept: torch.Tensor  # int32 [B+1], on device
    kept_counts: list[int]  # kept tokens per sequence, on the host
    block_scores: torch.Tensor  # float32 [total_blocks]
    cu_blocks: torch.Tensor  # int32 [B+1]
    block_keep: torch.Tensor  # bool [total_blocks]


def score_and_select(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int,
    rule: SelectionRule,
    *,
    scale: float,
    impl: str = "auto",
    host_cu_seqlens: HostCuSeqlens | None = None,
    group=None,
) -> Selection:
    """`score_blocks`, then `select_blocks`, then `compact_tokens` (see each), with the block
    size and the selection of `rule`.

    `group`: a `torch.distributed` process group over which the heads are split (tensor
    parallelism: each rank passes its own q / k heads). The block scores, sums over heads,
    are then summed across the group (`reduce_block_scores`) before selection, so every rank
    keeps the same blocks, the ones a single process holding every head would keep.
    """
    check_rule(rule)  # before scoring, which reads its block size
    block_scores, cu_blocks = score_blocks(
        q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, block_size=rule.block_size, scale=scale,
        impl=impl, host_cu_seqlens=host_cu_seqlens,
    )
    if group is not None:
        block_scores = reduce_block_scores(block_scores, group)
    block_keep = select_blocks(block_scores, cu_blocks, cu_seqlens_k, rule, impl=impl, max_seqlen_k=max_seqlen_k)
    kept_idx, cu_seqlens_kept, kept_counts = compact_tokens(
        block_keep, cu_blocks, cu_seqlens_k, rule.block_size, impl=impl
    )
    return Selection(kept_idx, cu_seqlens_kept, kept_counts, block_scores, cu_blocks, block_keep)


def reduce_block_scores(block_scores: torch.Tensor, group) -> torch.Tensor:
    """Sum head-sharded float32 block scores across a tensor-parallel group, in place.

    An all-reduce leaves equal sums on every rank with NCCL's and gloo's algorithms, but its
    contract does not promise bit-equal results; a rank whose scores differed in the last bit
    could cut top-p at another block and compute a different layout from its peers (the
    released code's garbage output under TP > 1). So the sums are then broadcast from the
    group's first rank: one more collective of `total_blocks` floats (8 KiB at 128K tokens).
    """
    import torch.distributed as dist

    if block_scores.dtype != torch.float32:
        raise ValueError(f"block scores must be float32 to be summed across ranks, got {block_scores.dtype}")
    dist.all_reduce(block_scores, op=dist.ReduceOp.SUM, group=group)
    dist.broadcast(block_scores, src=dist.get_global_rank(group, 0), group=group)
    return block_scores
