"""PyTorch references of the layout-rows kernels (`kernel.py`): the definitions the Triton kernels must equal."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def row_requests_torch(query_start_loc: torch.Tensor, tokens: int) -> torch.Tensor:
    """int64 [tokens]: the request r of each row t, qsl[r] <= t < qsl[r + 1]."""
    lens = torch.diff(query_start_loc.long())
    return torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=tokens)


def layout_rows_torch(query_start_loc: torch.Tensor, kv_base: torch.Tensor, tables: Sequence[torch.Tensor],
                      block_size: int, tokens: int, *, kept: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None, source: torch.Tensor | None = None):
    """(positions, source, request, logical, slots): see `uniprefill.kernels.layout_rows.layout_rows`."""
    request = row_requests_torch(query_start_loc, tokens)
    t = torch.arange(tokens, device=request.device)
    logical = kv_base.long()[request] + (t - query_start_loc.long()[request])
    block, offset = logical // block_size, logical % block_size
    slots = tuple(table[request, block].long() * block_size + offset for table in tables)
    if kept is not None:
        positions, source = positions[kept.long()].long(), source[kept.long()].long()
    elif positions is None:  # the batch as vLLM built it: one row per position, in order
        positions, source = logical.clone(), t
    else:
        positions = source = None  # the caller keeps its own
    return positions, source, request, logical, slots


def window_counts_torch(positions: torch.Tensor, request: torch.Tensor, query_start_loc: torch.Tensor,
                        context: torch.Tensor, dropping: torch.Tensor, window: int) -> torch.Tensor:
    """int64 [T]: see `uniprefill.kernels.layout_rows.window_counts`."""
    positions, request = positions.long(), request.long()
    counts = torch.clamp(positions + 1, max=window)
    if positions.numel() == 0:
        return counts
    # rows of one request are contiguous with increasing positions: a binary search over (request, position) keys
    span = 1 << 40
    keys = request * span + positions
    first = torch.searchsorted(keys, keys - window + 1)
    in_step = torch.arange(keys.numel(), device=keys.device) - first + 1
    in_context = torch.clamp(context.long()[request] - torch.clamp(positions - window + 1, min=0), min=0)
    return torch.where(dropping.bool()[request], in_step + in_context, counts)


def decode_segment_torch(seq_lens: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                         removed: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_lens, slot_mapping): see `uniprefill.kernels.layout_rows.decode_segment`."""
    num_reqs = seq_lens.shape[0]
    lens = seq_lens - removed[:num_reqs].to(seq_lens.dtype)
    logical = (lens.long() - 1).clamp(min=0)
    blocks = block_table[:num_reqs].gather(1, (logical // block_size)[:, None]).squeeze(1).long()  # no table copy
    base = slot_mapping[:num_reqs].long()
    slots = torch.where(base < 0, base, blocks * block_size + logical % block_size)
    return lens, slots


def decode_window_torch(seq_lens: torch.Tensor, tail: torch.Tensor, prompt_end: torch.Tensor, has: torch.Tensor,
                        window: int, removed: torch.Tensor | None = None):
    """(request, logical, count, vllm_rows): see `uniprefill.kernels.layout_rows.decode_window`."""
    num_reqs = seq_lens.shape[0]
    pos = seq_lens.long() - 1
    in_prompt = (tail[:num_reqs] > (pos - window)[:, None]).sum(1)
    end = prompt_end[:num_reqs]
    decoded = torch.clamp(torch.clamp(pos - end + 1, max=window), min=0)
    count = torch.where(has[:num_reqs], in_prompt + decoded, torch.clamp(pos + 1, max=window))
    logical = pos.clamp(min=0)
    count = torch.minimum(count.clamp(1, window), logical + 1)  # the window kernel's contract, also for stale tables
    vllm_rows = None if removed is None else removed[:num_reqs] == 0
    return torch.arange(num_reqs, device=seq_lens.device), logical, count, vllm_rows
