"""Sliding-window attention over ORIGINAL positions for vLLM layers after a drop point.

After a drop, a sliding-window layer holds only the kept tokens, so FlashAttention's uniform
window (the last W cache entries) would reach back over about W / retention positions: the
released code does that and loses needles (docs/benchmarks.md, "Sliding windows after a
drop": -42.5 points at p = 0.9 on Gemma-3-270M). The model's rule is over positions: a query
at position p sees the keys at positions p - W < pos_k <= p.

Storage (`compact(..., align="right")`): a sliding layer after a drop writes request r's K
kept tokens RIGHT-aligned, at logical KV indices `ctx + qlen - K ... ctx + qlen - 1`, so that
decode tokens land at their natural index with no shift, and vLLM's sliding-window manager,
which frees blocks behind `num_computed_tokens - W`, never frees an entry a later query can
see (entry e holds a position <= e, and a visible entry has a position > p - W).

Visibility is then a contiguous run of cache entries ending at the query's own entry:
`[e_q - count_q + 1, e_q]`, with count_q <= W (kept positions are distinct and increasing).
`window_counts` computes count_q for every row of a step; `paged_window_attention` gathers
those entries from vLLM's paged cache and attends. Both are plain PyTorch and vectorised over
rows (row chunks bound the memory; no loop over requests): the reference implementation
a fused kernel would be tested against, and fast enough for stage 2 on the GPU.
"""

from __future__ import annotations

import torch

from .vllm_metadata import DropHistoryStore, TokenLayout, _request_of_rows

_SPAN = 1 << 40  # (request, position) keys: request * _SPAN + position (no host sync for a bound)


def row_logical(layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Device ([T], [T]): request and logical KV index of every row of `layout`."""
    device = layout.query_start_loc.device
    counts = layout.query_lens_cpu
    tokens = layout.num_actual_tokens
    request = _request_of_rows(counts, tokens, device)
    base = layout.kv_base_cpu.to(device, non_blocking=True)
    logical = base[request] + (torch.arange(tokens, device=device) - layout.query_start_loc.long()[request])
    return request, logical


def window_counts(layout: TokenLayout, window: int, dropping_cpu: torch.Tensor,
                  store: DropHistoryStore | None = None, history_rows_cpu: torch.Tensor | None = None,
                  layer: int | None = None) -> torch.Tensor:
    """Device [T]: how many cache entries each row's query sees under a window over positions.

    layout: the rows after a drop point (positions ORIGINAL, requests' rows in order).
    dropping_cpu: host bool [R], requests that drop in this step (no cached context: their
        visible keys are all rows of this step).
    store / history_rows_cpu / layer: requests with a drop history (decode after a dropped
        prefill) count their kept prompt keys through `store.window_first_visible`; without a
        history a request holds one entry per position, so its count is min(W, pos + 1).
    """
    if window < 1:
        raise ValueError(f"window={window}: expected >= 1")
    device = layout.positions.device
    positions = layout.positions.long()
    counts = torch.clamp(positions + 1, max=window)  # one entry per position
    dropping = dropping_cpu.to(torch.bool)
    if bool(dropping.any()):
        request, _ = row_logical(layout)
        # rows of one request are contiguous with increasing positions: the first visible row of
        # each query is a binary search over (request, position) keys
        keys = request * _SPAN + positions
        first = torch.searchsorted(keys, keys - window + 1)
        in_step = torch.arange(keys.numel(), device=device) - first + 1
        counts = torch.where(dropping.to(device, non_blocking=True)[request], in_step, counts)
    if store is not None and history_rows_cpu is not None:
        has = store.has_history(history_rows_cpu) & ~dropping
        if bool(has.any()):
            if layer is None:
                raise ValueError("layer: needed to count the keys of requests with a drop history")
            requests = torch.nonzero(has).flatten()
            qsl, qlen = layout.query_start_loc_cpu, layout.query_lens_cpu
            lens = qlen[requests]
            rows = torch.repeat_interleave(qsl[:-1][requests] - _offsets(lens)[:-1], lens) + torch.arange(int(lens.sum()))
            # these requests do not drop now: their positions are ctx + i, known on the host
            pos = torch.repeat_interleave(layout.num_computed_tokens_cpu[requests] - _offsets(lens)[:-1], lens) \
                + torch.arange(int(lens.sum()))
            store_rows = torch.repeat_interleave(history_rows_cpu.long()[requests], lens)
            _, count = store.window_first_visible(store_rows, pos, layer, window)
            counts = counts.index_copy(0, rows.to(device, non_blocking=True), count.to(device, non_blocking=True))
    return counts


def paged_window_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, row_request: torch.Tensor, row_logical: torch.Tensor,
                           row_count: torch.Tensor, *, window: int, scale: float,
                           softcap: float | None = None, max_elements: int = 1 << 26) -> torch.Tensor:
    """Attention of each query row over its `row_count` cache entries ending at `row_logical`.

    query: [T, Hq, D]; key_cache, value_cache: [num_blocks, B, Hk, D] (vLLM's FlashAttention
    cache views); block_table: [R, max_blocks]; row_request, row_logical, row_count: [T] (the
    row's request, its own logical KV index, how many entries it sees, 1..window).
    Returns [T, Hq, D] in the query's dtype; softmax in float32. Rows are processed in chunks
    of at most `max_elements` gathered key elements.
    """
    tokens, heads, dim = query.shape
    block = key_cache.shape[1]
    kv_heads = key_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of the cache's KV heads {kv_heads}")
    out = torch.empty_like(query)
    if tokens == 0:
        return out
    group = heads // kv_heads
    offsets = torch.arange(window, device=query.device) - (window - 1)  # [W]: -W+1 .. 0
    chunk = max(1, max_elements // (window * kv_heads * dim))
    for start in range(0, tokens, chunk):
        rows = slice(start, min(start + chunk, tokens))
        logical = row_logical[rows, None].long() + offsets  # [t, W]
        visible = offsets >= (1 - row_count[rows, None].long())
        # entries outside the window are never read (their blocks may be freed and reused):
        # the query's own entry stands in for them, and their scores are masked
        logical = torch.where(visible, logical, row_logical[rows, None].long())
        blocks = block_table[row_request[rows, None].long(), logical // block].long()
        k = key_cache[blocks, logical % block].float()  # [t, W, Hk, D]
        v = value_cache[blocks, logical % block].float()
        q = query[rows].float().view(-1, kv_heads, group, dim)  # [t, Hk, G, D]
        scores = torch.einsum("tkgd,twkd->tkgw", q, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1)
        out[rows] = torch.einsum("tkgw,twkd->tkgd", probs, v).reshape(-1, heads, dim).to(query.dtype)
    return out


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.long)
    torch.cumsum(lens, 0, out=out[1:])
    return out
