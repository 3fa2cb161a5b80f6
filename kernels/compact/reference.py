"""PyTorch reference of compaction (block keep flags -> packed indices of the kept tokens).

The Triton kernels (`kernel.py`) are tested against it.
"""

from __future__ import annotations

import torch


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
