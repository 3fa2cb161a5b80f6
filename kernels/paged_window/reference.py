"""The PyTorch reference of paged sliding-window attention (`paged_window/__init__.py` says what
it computes): gathers the W entries of each row, in row chunks that bound memory; entries outside a
row's window are never read (their blocks may have been freed and reused)."""

from __future__ import annotations

import torch


def paged_window_attention_torch(query, key_cache, value_cache, block_table, row_request, row_logical, row_count,
                                 *, window: int, scale: float, softcap: float | None = None,
                                 max_elements: int = 1 << 26) -> torch.Tensor:
    """The reference (see the module docstring); softmax in float32, output in query's dtype."""
    tokens, heads, dim = query.shape
    block, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(query)
    offsets = torch.arange(window, device=query.device) - (window - 1)  # -W+1 .. 0
    chunk = max(1, max_elements // (window * kv_heads * dim))
    for start in range(0, tokens, chunk):
        rows = slice(start, min(start + chunk, tokens))
        own = row_logical[rows, None].long()
        visible = offsets >= (1 - row_count[rows, None].long())
        logical = torch.where(visible, own + offsets, own)  # outside the window: the own entry, masked
        blocks = block_table[row_request[rows, None].long(), logical // block].long()
        k = key_cache[blocks, logical % block].float()  # [t, W, Hk, D]
        v = value_cache[blocks, logical % block].float()
        q = query[rows].float().view(-1, kv_heads, group, dim)
        scores = torch.einsum("tkgd,twkd->tkgw", q, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1)
        out[rows] = torch.einsum("tkgw,twkd->tkgd", probs, v).reshape(-1, heads, dim).to(query.dtype)
    return out
