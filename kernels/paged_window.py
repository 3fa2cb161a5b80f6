"""Paged sliding-window attention with a per-row window: the kernel behind vLLM sliding layers
after a drop point (`uniprefill.vllm.window`).

Each query row t of request r sees the `count[t]` cache entries that end at its own entry,
logical KV indices `[logical[t] - count[t] + 1, logical[t]]`, read from vLLM's paged cache
through the request's block table. FlashAttention's window is the same for every row; here
each row has its own (after a drop, how many kept entries lie within W positions varies).

- `paged_window_attention_torch`: the PyTorch reference (gathers W entries per row, in row
  chunks that bound memory; entries outside the window are never read: their blocks may have
  been freed and reused).
- `paged_window_attention_triton`: one program per (row, KV head), an online-softmax loop
  over the row's entries in tiles of BLOCK_N, the GQA query heads of that KV head together.
- `paged_window_attention(..., impl="auto")`: Triton on CUDA, the reference elsewhere (or
  Triton's CPU interpreter with TRITON_INTERPRET=1), as `kernels.api` chooses.
"""

from __future__ import annotations

import torch

from ._common import interpret_enabled, next_power_of_2
from .validation import resolve_impl


def _check(query, key_cache, value_cache, block_table, row_request, row_logical, row_count, window) -> None:
    if query.dim() != 3 or key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"query must be [T, Hq, D] and the caches [blocks, B, Hk, D] alike; got "
                         f"{tuple(query.shape)}, {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    if query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"head size {query.shape[2]} of the query != {key_cache.shape[3]} of the cache")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"query heads {query.shape[1]} are not a multiple of the cache's KV heads {key_cache.shape[2]}")
    rows = query.shape[0]
    for name, t in (("row_request", row_request), ("row_logical", row_logical), ("row_count", row_count)):
        if t.shape != (rows,):
            raise ValueError(f"{name} must have shape ({rows},), got {tuple(t.shape)}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, max_blocks], got {tuple(block_table.shape)}")
    if window < 1:
        raise ValueError(f"window={window}: expected >= 1")


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


def paged_window_attention_triton(query, key_cache, value_cache, block_table, row_request, row_logical, row_count,
                                  *, window: int, scale: float, softcap: float | None = None,
                                  block_n: int = 64) -> torch.Tensor:
    """The Triton kernel (see the module docstring); same contract as the reference."""
    from ._paged_window_triton import paged_window_kernel

    tokens, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(query)
    if tokens == 0:
        return out
    fp32_dot = query.dtype == torch.float32 or interpret_enabled()  # the interpreter's bf16 dot is wrong
    paged_window_kernel[(tokens, kv_heads)](
        query, key_cache, value_cache, out, block_table, row_request, row_logical, row_count,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(), *block_table.stride(),
        float(scale), float(softcap or 0.0),
        CACHE_BLOCK=key_cache.shape[1], GROUP=group, BLOCK_G=max(16, next_power_of_2(group)),
        HEAD_DIM=dim, BLOCK_D=max(16, next_power_of_2(dim)), BLOCK_N=block_n,
        USE_SOFTCAP=bool(softcap), FP32_DOT=fp32_dot,
    )
    return out


def paged_window_attention(query, key_cache, value_cache, block_table, row_request, row_logical, row_count,
                           *, window: int, scale: float, softcap: float | None = None,
                           impl: str = "auto") -> torch.Tensor:
    """[T, Hq, D]: each row's attention over its own run of paged cache entries (module docstring).

    query [T, Hq, D]; key_cache, value_cache [num_blocks, B, Hk, D] (any strides: vLLM's
    FlashAttention cache views); block_table [R, max_blocks]; row_request, row_logical,
    row_count [T] ints (1 <= count <= window, count <= logical + 1)."""
    _check(query, key_cache, value_cache, block_table, row_request, row_logical, row_count, window)
    if resolve_impl(impl, query.device) == "triton":
        return paged_window_attention_triton(query, key_cache, value_cache, block_table, row_request, row_logical,
                                             row_count, window=window, scale=scale, softcap=softcap)
    return paged_window_attention_torch(query, key_cache, value_cache, block_table, row_request, row_logical,
                                        row_count, window=window, scale=scale, softcap=softcap)
