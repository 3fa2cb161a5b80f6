"""Triton compaction: block keep flags -> indices of the kept tokens, one host sync.

1. `_kept_offsets_kernel`, one program per sequence: each kept block's token count and,
   by a running cumsum in block order, its first slot among the sequence's kept tokens;
   the sequence's kept count.
2. A device cumsum of the counts gives `cu_seqlens_kept`.
3. `_expand_kept_kernel`, grid (split, sequence): every kept block writes the packed
   indices of its tokens to its slots, in original order.

All three are queued before the single device-to-host copy (the per-sequence counts), so
the GPU never waits for the host. The indices are written into a buffer sized for every
token of every block and returned as a view of its first T entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import next_power_of_2

_SPLITS = 32  # programs per sequence that write indices


@triton.jit
def _kept_offsets_kernel(keep_ptr, cu_blocks_ptr, cu_k_ptr, offset_ptr, count_ptr, block_size,
                         CHUNK: tl.constexpr):
    seq = tl.program_id(0)
    first = tl.load(cu_blocks_ptr + seq)
    n_blocks = tl.load(cu_blocks_ptr + seq + 1) - first
    n_k = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    kept_before = tl.full([], 0, tl.int64)
    for c0 in range(0, n_blocks, CHUNK):
        blocks = c0 + tl.arange(0, CHUNK)
        ok = blocks < n_blocks
        keep = (tl.load(keep_ptr + first + blocks, mask=ok, other=0) != 0) & ok
        tokens = tl.where(keep, tl.minimum(n_k - blocks * block_size, block_size), 0).to(tl.int64)
        tl.store(offset_ptr + first + blocks, kept_before + tl.cumsum(tokens, 0) - tokens, mask=ok)
        kept_before += tl.sum(tokens, 0)
    tl.store(count_ptr + seq, kept_before)


@triton.jit
def _expand_kept_kernel(keep_ptr, cu_blocks_ptr, cu_k_ptr, offset_ptr, cu_kept_ptr, out_ptr, block_size,
                        SPLITS: tl.constexpr, BLOCKS: tl.constexpr, TOKENS: tl.constexpr):
    split = tl.program_id(0)
    seq = tl.program_id(1)
    first = tl.load(cu_blocks_ptr + seq)
    n_blocks = tl.load(cu_blocks_ptr + seq + 1) - first
    k_start = tl.load(cu_k_ptr + seq).to(tl.int64)
    n_k = tl.load(cu_k_ptr + seq + 1) - k_start
    out_base = out_ptr + tl.load(cu_kept_ptr + seq)
    for c0 in range(split * BLOCKS, n_blocks, SPLITS * BLOCKS):
        blocks = c0 + tl.arange(0, BLOCKS)
        ok = blocks < n_blocks
        keep = (tl.load(keep_ptr + first + blocks, mask=ok, other=0) != 0) & ok
        slot = tl.load(offset_ptr + first + blocks, mask=ok, other=0)
        for t0 in range(0, block_size, TOKENS):
            j = t0 + tl.arange(0, TOKENS)
            local = blocks[:, None] * block_size + j[None, :]
            write = keep[:, None] & (j < block_size)[None, :] & (local < n_k)
            tl.store(out_base + slot[:, None] + j[None, :], k_start + local, mask=write)


def compact_tokens_fwd(
    block_keep: torch.Tensor, cu_blocks: torch.Tensor, cu_seqlens_k: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Host wrapper: two kernels and a cumsum, then the one host copy of the counts."""
    device = block_keep.device
    batch, n_blocks = cu_blocks.shape[0] - 1, block_keep.shape[0]
    keep = block_keep.contiguous().view(torch.int8)
    slots = torch.empty(n_blocks, dtype=torch.int64, device=device)
    counts = torch.empty(batch, dtype=torch.int64, device=device)
    _kept_offsets_kernel[(batch,)](keep, cu_blocks, cu_seqlens_k, slots, counts, block_size, CHUNK=1024)
    cu_kept = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    cu_kept[1:] = torch.cumsum(counts, dim=0)
    out = torch.empty(n_blocks * block_size, dtype=torch.int64, device=device)
    tokens = min(256, next_power_of_2(block_size))
    _expand_kept_kernel[(_SPLITS, batch)](
        keep, cu_blocks, cu_seqlens_k, slots, cu_kept, out, block_size,
        SPLITS=_SPLITS, BLOCKS=max(1, 1024 // tokens), TOKENS=tokens,
    )
    kept_counts = counts.tolist()  # the one device-to-host sync
    return out[: sum(kept_counts)], cu_kept.to(torch.int32), kept_counts
