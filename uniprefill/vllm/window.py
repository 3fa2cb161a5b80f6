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

A request whose prompt starts in the cache (a prefix-cache hit, the last chunk of a chunked prefill) holds its
context at natural indices `0 .. ctx - 1`, and right alignment leaves a gap of `qlen - K` unwritten entries
between the context and its kept rows. Its queries also see the context keys within the window, so the run
would break at the gap. `copy_context_tail` closes it: in each sliding layer, after that layer's KV update (a
context block may be written in the same forward: a prefix-cache hit on blocks another request of the step
publishes when it is scheduled), it copies the context's last `min(W - 1, ctx)` entries (every context key a
kept or a later decode query can see) into the top of the gap, so the run stays contiguous, and entry e still
holds a position <= e. The drop keeps such a request whole where the gap is shorter than that for the engine's
largest window (`context_tail_fits`): the copy never writes below `ctx`, into blocks the prefix cache may share.
The drop history's window tables list the context positions within the window before the kept ones
(`DropHistoryStore.add`), so decode counts them as it counts kept prompt keys.
`window_counts` computes count_q for every row of a step (vectorised, no loop over
requests); `paged_window_attention` (`uniprefill.kernels.paged_window`: a Triton kernel on
CUDA, beside its PyTorch reference) reads those entries from vLLM's paged cache and attends.
"""

from __future__ import annotations

import numpy as np
import torch

from uniprefill.kernels._common import to_device
from uniprefill.kernels.layout_rows import window_counts as row_window_counts

from .graph_decode import _capturing_full_graph, keeps_vllm_rows
from .host_arrays import _ranges, _to_device, ranges_np
from .layout import TokenLayout
from .metadata import DropHistoryStore


def window_counts(layout: TokenLayout, window: int, dropping_cpu: torch.Tensor,
                  store: DropHistoryStore | None = None, history_rows_cpu: torch.Tensor | None = None,
                  layer: int | None = None) -> torch.Tensor:
    """Device [T]: how many cache entries each row's query sees under a window over positions.

    layout: the rows after a drop point (positions ORIGINAL, requests' rows in order).
    dropping_cpu: host bool [R], requests that drop in this step: their visible keys are the kept rows of
        this step within the window, plus the context keys within it (copied below them by
        `copy_context_tail`); one kernel (`kernels.layout_rows.window_counts`).
    store / history_rows_cpu / layer: requests with a drop history (decode after a dropped
        prefill) count their kept prompt keys through `store.window_first_visible`; without a
        history a request holds one entry per position, so its count is min(W, pos + 1).
    """
    if window < 1:
        raise ValueError(f"window={window}: expected >= 1")
    device = layout.positions.device
    dropping = dropping_cpu.to(torch.bool)
    if bool(dropping.any()):
        context, dropping_d = _to_device([layout.num_computed_tokens_cpu.numpy(), dropping.numpy()],
                                         [torch.int64, torch.int64], device)
        counts = row_window_counts(layout.positions, layout.row_request, layout.query_start_loc, context, dropping_d,
                                   window, max_query_len=layout.max_query_len, impl=layout.impl)
    else:
        counts = torch.clamp(layout.positions.long() + 1, max=window)  # one entry per position
    if store is not None and history_rows_cpu is not None:
        has = store.has_history(history_rows_cpu) & ~dropping
        if bool(has.any()):
            if layer is None:
                raise ValueError("layer: needed to count the keys of requests with a drop history")
            requests = torch.nonzero(has).flatten()
            qsl, qlen = layout.query_start_loc_cpu, layout.query_lens_cpu
            lens = qlen[requests]
            rows = _ranges(qsl[:-1][requests], lens)
            pos = _ranges(layout.num_computed_tokens_cpu[requests], lens)  # not dropping now: ctx + i
            store_rows = torch.repeat_interleave(history_rows_cpu.long()[requests], lens)
            _, count = store.window_first_visible(store_rows, pos, layer, window)
            counts = counts.index_copy(0, to_device(rows, device), to_device(count, device))
    return counts


def context_tail(ctx: int, window: int) -> int:
    """How many of a request's `ctx` context entries its kept and decode queries can see under `window`: the last
    window - 1."""
    return min(max(window - 1, 0), int(ctx))


def context_tail_fits(layout: TokenLayout, counts_cpu: torch.Tensor, max_window: int) -> torch.Tensor:
    """Host bool [R]: whether each request's gap after a drop to `counts_cpu` rows holds its context tail."""
    ctx = layout.num_computed_tokens_cpu
    tail = torch.clamp(ctx, max=max(max_window - 1, 0))
    return (layout.query_lens_cpu - counts_cpu) >= tail


def keep_whole_where_the_tail_does_not_fit(layout: TokenLayout, kept: torch.Tensor, counts_cpu: torch.Tensor,
                                           dropping_cpu: torch.Tensor, max_window: int):
    """(kept, counts, refused) after the first drop point: a dropping request whose gap cannot hold its context
    tail (`context_tail_fits`) keeps every row instead (always sound); `refused` (host bool [R]) names them."""
    refused = dropping_cpu & ~context_tail_fits(layout, counts_cpu, max_window)
    if not bool(refused.any()):
        return kept, counts_cpu, refused
    mask = torch.zeros(layout.num_actual_tokens, dtype=torch.bool, device=kept.device)
    mask[kept] = True
    whole = _ranges(layout.query_start_loc_cpu[:-1][refused], layout.query_lens_cpu[refused])
    mask[to_device(whole, kept.device)] = True
    return torch.nonzero(mask).flatten(), torch.where(refused, layout.query_lens_cpu, counts_cpu), refused


def copy_context_tail(right: TokenLayout, group: int, requests: list[int], window: int, cache,
                      plans: dict | None = None) -> None:
    """Copy, for each request in `requests` (dropping, with context), its last `context_tail(ctx, window)` context
    entries into the top of the gap below its right-aligned kept rows, in one sliding layer's paged cache
    (`cache`: a `drop_records.WindowLayer`; its window `window`, its KV-cache group `group` of `right`). Run after
    the layer's KV update (a context entry may be written in the same forward). The gap must hold them
    (`context_tail_fits`, checked with the engine's largest window): the copy never writes below `ctx`, where
    the context's blocks may be shared with other requests through the prefix cache. `plans` (one drop point's:
    one layout) keeps, for its later sliding layers, the copy's positions per window (the same in every KV-cache
    group: built once) and its slots per (group, window): a layer whose group and window met a plan before costs
    two gathers and two scatters (Gemma-3's sliding layers are each in another group than the one before)."""
    plans = {} if plans is None else plans
    if (group, window) not in plans:
        if ("positions", window) not in plans:
            plans["positions", window] = context_tail_positions(right, requests, window, cache.key_cache.device)
        positions = plans["positions", window]
        plans[group, window] = None if positions is None else _tail_slots(right, group, *positions)
    plan = plans[group, window]
    if plan is None:
        return
    src_blocks, src_offsets, dst_blocks, dst_offsets = plan
    for c in (cache.key_cache, cache.value_cache):
        c[dst_blocks, dst_offsets] = c[src_blocks, src_offsets]


def context_tail_positions(right: TokenLayout, requests: list[int], window: int, device):
    """(request, source entry, destination entry) per copied entry of `copy_context_tail` under `window`, device
    int64 (one copy), or None when no request has a context tail to copy. Built on the host without a loop over
    requests; a request whose gap cannot hold its tail raises."""
    r = np.asarray(requests, dtype=np.int64)
    ctx = right.num_computed_tokens_cpu.numpy()[r].astype(np.int64)
    n = np.minimum(max(window - 1, 0), ctx)  # `context_tail`
    base = right.kv_base_cpu.numpy()[r].astype(np.int64)  # the first kept entry
    short = (n > 0) & (base - n < ctx)
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise RuntimeError(f"request {int(r[i])}: a gap of {int(base[i] - ctx[i])} entries cannot hold its context "
                           f"tail of {int(n[i])}")
    if not (n > 0).any():
        return None
    rows = np.repeat(r, n)
    return _to_device([rows, ranges_np(ctx - n, n), ranges_np(base - n, n)], [torch.int64] * 3, device)


def _tail_slots(right: TokenLayout, group: int, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor):
    """(source blocks, source offsets, destination blocks, destination offsets) of the copied entries in KV-cache
    group `group` (its block table and block size)."""
    table, block = right.block_tables[group], right.block_sizes[group]
    return table[rows, src // block].long(), src % block, table[rows, dst // block].long(), dst % block


def window_attention_step(runtime, args: tuple, kwargs: dict, layer: int) -> None:
    """What `VllmDropRuntime.window_attention` (`runtime`) runs instead of vLLM's attention op (`vllm_attention[layer]`,
    args: query, key, value, output, layer name, ...) for a sliding layer after a drop
    point: the window over original positions, from the paged cache (which the layer's KV
    update has just written, at the right-aligned slots). Writes the output argument.
    A forward that dropped nothing because it had no requests (vLLM's profiling and warm-up
    runs) runs vLLM's own op on vLLM's own metadata, and compiles the window kernel for the
    layer once (`warm_up_window_layer`: never inside a CUDA-graph capture)."""
    query, output = args[0], args[3]
    name = runtime.layer_names[layer]
    if runtime.step.profiling:
        runtime.vllm_attention[layer](*args, **kwargs)
        if name not in runtime.windows_warmed:
            context = runtime.context_fn()
            skip = runtime.graph_decode is not None and keeps_vllm_rows(runtime.config)  # decode graphs' variants
            if not _capturing_full_graph(context) and warm_up_window_layer(
                    context, name, query, runtime.window_layer_fn, runtime.windows[name], runtime.config.impl, skip):
                runtime.windows_warmed.add(name)
        return
    if name in runtime.step.vllm_windows:
        runtime.vllm_attention[layer](*args, **kwargs)
        return
    rows = runtime.step.window_rows.get(name)
    if rows is None:
        raise RuntimeError(f"{name}: no window rows for this step (is it after a drop point?)")
    cache = runtime.window_layer_fn(name)
    if cache is None:
        raise RuntimeError(f"{name}: the sliding layer has no KV cache (vLLM has not allocated it)")
    if cache.window is not None and cache.window != runtime.windows[name]:
        raise RuntimeError(f"{name}: the layer's sliding window is {cache.window}, the rewrite assumed "
                           f"{runtime.windows[name]}")
    pending = runtime.step.pending_copies.pop(name, None)
    if pending is not None:  # this layer's KV update has run: every context entry of the step is current
        right, group, requests, plans = pending
        copy_context_tail(right, group, requests, runtime.windows[name], cache, plans)
    if rows.vllm_rows is None:
        paged_window_step(query, output, rows, cache, runtime.windows[name], runtime.config.impl)
        return
    # a decode graph of an engine at p = 1 (a graph cannot branch per request): vLLM's attention for every row, then
    # the window kernel over the rows of the requests that removed KV entries; it reads nothing for the others
    runtime.vllm_attention[layer](*args, **kwargs)
    paged_window_step(query, output, rows, cache, runtime.windows[name], runtime.config.impl, skip=rows.vllm_rows)


TILED_MIN_ROWS = 16  # a request with fewer rows in a step runs on the per-row kernel (one program per row)


def kernel_plan(layout: TokenLayout) -> tuple[str, torch.Tensor | None, torch.Tensor | None]:
    """Which window kernel runs which rows of `layout` (a step after a drop; `drop_records.WindowRows.kernel`):
    requests of at least TILED_MIN_ROWS rows on the tiled kernel, which reads each key once per tile of rows but
    walks the requests of a tile one after another (a tile of decode rows of 32 requests would be 32 windows in one
    program), the others (decode rows, short prompts) on the per-row kernel. The row indices of a "mixed" step are
    built on the host (a request's rows are one run) and copied without a sync."""
    lens = layout.query_lens_cpu
    long = lens >= TILED_MIN_ROWS
    if not bool(long.any()):
        return "per_row", None, None
    if bool(long.all()):
        return "tiled", None, None
    starts = layout.query_start_loc_cpu[:-1].long()
    device = layout.query_start_loc.device
    return "mixed", *(to_device(_ranges(starts[m], lens[m]), device) for m in (long, ~long))


def paged_window_step(query: torch.Tensor, output: torch.Tensor, rows, cache, window: int, impl: str,
                      skip: torch.Tensor | None = None) -> None:
    """One sliding layer's attention after a drop: the window over original positions, read from
    the paged cache (`rows`: a `drop_records.WindowRows`, `cache`: a `drop_records.WindowLayer`);
    writes the first rows of `output`, as vLLM's attention op would. The rows run on the kernels
    `rows.kernel` names (the A/B aid `UNIPREFILL_DEBUG_PER_ROW_WINDOW` puts them all on the per-row one). `skip`
    (device bool [rows], per-row rows only): rows whose output is left as it is."""
    from uniprefill import env
    from uniprefill.kernels.paged_window import paged_window_attention

    tokens = rows.request.numel()
    dim = cache.key_cache.shape[-1]
    q = query[:tokens].reshape(tokens, -1, dim)
    out = output[:tokens].view(q.shape)
    kernel = "per_row" if env.debug_per_row_window() else rows.kernel
    if skip is not None and kernel != "per_row":
        raise ValueError(f"skip: for rows on the per-row kernel only, not {kernel!r}")

    def run(which: torch.Tensor | None, tiled: bool) -> None:
        """The rows `which` (None: all) on one kernel, straight into vLLM's output buffer."""
        n = tokens if which is None else which.numel()
        splits = 1 if tiled or env.debug_unsplit_window() else split_count(n * cache.key_cache.shape[2], window)
        paged_window_attention(q, cache.key_cache, cache.value_cache, rows.block_table, rows.request, rows.logical,
                               rows.count, window=window, scale=cache.scale, softcap=cache.softcap, impl=impl,
                               tiled=tiled, splits=splits, out=out, skip=skip, rows=which)

    if kernel == "mixed":  # each kernel reads and writes its own rows in place
        run(rows.tiled_rows, True)
        run(rows.per_row_rows, False)
    else:
        run(None, kernel == "tiled")


def split_count(programs: int, window: int) -> int:
    """Programs per row of the per-row window kernel (split-KV) for a step of `programs` rows x KV heads: up to 8,
    one per 64 entries of the window, where the step has fewer than 64 (a decode step of a few requests: one
    program per row and KV head leaves the GPU idle). Measured in Gemma-3-270M's decode on vLLM (H200, 2026-12-05,
    `docs/results/vllm-gemma-profile-h200-2026-12-05`): 16 tokens after a 32K prefill at batch 1 spent 3.89 ms of
    device time in the window kernel on one program a row (1 program reading 512 entries a sliding layer), 1.46 ms
    split 8 ways (the combine included); the decode's device time 18.74 -> 16.25 ms (standard vLLM 15.35). The A/B
    aid `UNIPREFILL_DEBUG_UNSPLIT_WINDOW` keeps one program a row."""
    if programs >= 64:
        return 1
    return 1 << (min(8, max(1, window // 64)).bit_length() - 1)  # a power of two


def warm_up_window_layer(context, name: str, query: torch.Tensor, window_layer_fn, window: int, impl: str,
                         skip: bool = False) -> bool:
    """Run the window kernels once for sliding layer `name` in one of vLLM's dummy forwards, so that Triton
    compiles them there and not at a first launch inside a CUDA-graph capture (vLLM captures its decode graphs
    after dummy forwards that run vLLM's own attention: a kernel's first launch would otherwise be captured) or
    in a first request's prefill. Every variant a step may pick: the per-row kernel on one row, on one program
    and split over programs (`split_count`: both counts a step may get, unless the A/B aid keeps one), and the
    tiled kernel on 16 and 17 rows (Triton specialises on a row count divisible by 16), each also on rows named by
    `rows=` (a mixed step's, `kernel_plan`: another compiled variant), all request 0 at entry 0, with the layer's
    query, cache and block table (the strides Triton specialises on are the real ones); only scratch outputs are
    written. `skip`: also the per-row variants that skip rows (the decode graphs of an engine at p = 1,
    `graph_decode.keeps_vllm_rows`). False when the forward has no metadata or the layer no cache yet (vLLM's
    profiling run, before it allocates the KV cache): try again."""
    from uniprefill import env
    from uniprefill.kernels.paged_window import paged_window_attention

    metadata = getattr(context, "attn_metadata", None)
    if not isinstance(metadata, dict) or name not in metadata or query.shape[0] == 0:
        return False
    cache = window_layer_fn(name)
    if cache is None or cache.key_cache.numel() == 0:
        return False
    block_table = metadata[name].block_table
    dim = cache.key_cache.shape[-1]
    q = query[:1].reshape(1, -1, dim)
    variants = [(1, False, 1)]
    if not env.debug_unsplit_window() and split_count(1, window) > 1:
        variants.append((1, False, split_count(1, window)))  # a decode step of few rows x KV heads
    variants = [(*v, False) for v in variants] + ([(*v, True) for v in variants] if skip else [])
    variants += [(16, True, 1, False), (17, True, 1, False)]
    variants = [(*v, False) for v in variants] + [(*v, True) for v in variants if not v[3]]  # mixed: never skips
    for rows, tiled, splits, skips, taken in variants:
        zero = torch.zeros(rows, dtype=torch.long, device=query.device)
        out = torch.empty(rows, q.shape[1] * dim, dtype=q.dtype, device=q.device).view(rows, -1, dim)  # as vLLM's
        paged_window_attention(q.expand(rows, -1, -1).contiguous(), cache.key_cache, cache.value_cache, block_table[:1],
                               zero, zero, zero + 1, window=window, scale=cache.scale, softcap=cache.softcap, impl=impl,
                               tiled=tiled, splits=splits, out=out, skip=zero.bool() if skips else None,
                               rows=torch.arange(rows, device=query.device) if taken else None)
    return True
