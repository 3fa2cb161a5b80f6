"""The Triton kernels of a step's row layout, and their launchers (imported only when they run: importing this
module imports triton).

- `layout_rows_kernel`: one program per BLOCK_T rows of a layout. Each row finds its request by a binary search
  over `query_start_loc`, its logical KV index (`kv_base[r] + t - qsl[r]`), up to `MAX_TABLES` KV-cache groups'
  slots through their block tables, and, as asked, its position and source row (gathered through `kept`, or the
  logical index and the row itself for vLLM's own batch). One launch replaces the ~25 torch ops (each a launch or
  a host op on a host-bound step) of `reference.layout_rows_torch`.
- `window_counts_kernel`: one program per BLOCK_T rows: each row of a dropping request finds the first row of its
  request within the window by a binary search over the (increasing) positions of the request's rows.

One compiled variant each: every argument but the tile size is left unspecialised (`do_not_specialize`: the row
count, a search's steps, the tables' row strides, how many tables and which rows to write are run-time values, and
no pointer's 16-byte alignment is assumed: the outputs are views into one buffer). Only the pointers' dtypes
select a variant: vLLM's are int32 `query_start_loc` and block tables, int64 rows and positions.
`warm_up_layout_rows` compiles them before a server's first request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

MAX_TABLES = 8  # block tables one launch reads; more groups take more launches
_BLOCK_T = 256


@triton.jit
def _request_of(QSL, t, num_reqs, steps):
    """Largest r in [0, num_reqs) with qsl[r] <= t (the request owning row t; empty requests skipped)."""
    lo = tl.zeros_like(t)
    hi = tl.zeros_like(t) + num_reqs
    for _ in range(steps):  # hi - lo halves each step; once it is 1, mid = lo and nothing changes
        mid = (lo + hi) // 2
        below = tl.load(QSL + mid) <= t
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _store_slot(TABLE, SLOTS, st_r, request, logical, t, ok, block_size):
    block = tl.load(TABLE + request * st_r + logical // block_size, mask=ok, other=0).to(tl.int64)
    tl.store(SLOTS + t, block * block_size + logical % block_size, mask=ok)


_POINTERS = ["QSL", "KV_BASE", "KEPT", "POS_IN", "SRC_IN", "POS_OUT", "SRC_OUT", "REQ_OUT", "LOGICAL_OUT", "SLOTS",
             "T0", "T1", "T2", "T3", "T4", "T5", "T6", "T7"]


@triton.jit(do_not_specialize=_POINTERS + ["st0", "st1", "st2", "st3", "st4", "st5", "st6", "st7", "tokens",
                                           "num_reqs", "steps", "block_size", "num_tables", "rows"])
def layout_rows_kernel(
    QSL, KV_BASE, KEPT, POS_IN, SRC_IN, POS_OUT, SRC_OUT, REQ_OUT, LOGICAL_OUT, SLOTS,
    T0, T1, T2, T3, T4, T5, T6, T7, st0, st1, st2, st3, st4, st5, st6, st7,
    tokens, num_reqs, steps, block_size, num_tables, rows, BLOCK_T: tl.constexpr,
):
    """rows: 0 no positions / sources, 1 gathered through KEPT, 2 vLLM's own batch (position = logical index).
    SLOTS: num_tables rows of `tokens` slots, table g's at SLOTS + g * tokens."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < tokens
    t = tl.where(ok, t, 0)
    request = _request_of(QSL, t, num_reqs, steps).to(tl.int64)
    start = tl.load(QSL + request).to(tl.int64)
    logical = tl.load(KV_BASE + request).to(tl.int64) + t - start
    tl.store(REQ_OUT + t, request, mask=ok)
    tl.store(LOGICAL_OUT + t, logical, mask=ok)
    if rows == 1:
        row = tl.load(KEPT + t, mask=ok, other=0).to(tl.int64)
        tl.store(POS_OUT + t, tl.load(POS_IN + row, mask=ok, other=0).to(tl.int64), mask=ok)
        tl.store(SRC_OUT + t, tl.load(SRC_IN + row, mask=ok, other=0).to(tl.int64), mask=ok)
    if rows == 2:
        tl.store(POS_OUT + t, logical, mask=ok)
        tl.store(SRC_OUT + t, t, mask=ok)
    if num_tables > 0:
        _store_slot(T0, SLOTS, st0, request, logical, t, ok, block_size)
    if num_tables > 1:
        _store_slot(T1, SLOTS + tokens, st1, request, logical, t, ok, block_size)
    if num_tables > 2:
        _store_slot(T2, SLOTS + 2 * tokens, st2, request, logical, t, ok, block_size)
    if num_tables > 3:
        _store_slot(T3, SLOTS + 3 * tokens, st3, request, logical, t, ok, block_size)
    if num_tables > 4:
        _store_slot(T4, SLOTS + 4 * tokens, st4, request, logical, t, ok, block_size)
    if num_tables > 5:
        _store_slot(T5, SLOTS + 5 * tokens, st5, request, logical, t, ok, block_size)
    if num_tables > 6:
        _store_slot(T6, SLOTS + 6 * tokens, st6, request, logical, t, ok, block_size)
    if num_tables > 7:
        _store_slot(T7, SLOTS + 7 * tokens, st7, request, logical, t, ok, block_size)


@triton.jit(do_not_specialize=["POS", "REQ", "QSL", "CTX", "DROPPING", "COUNTS", "tokens", "steps", "window"])
def window_counts_kernel(POS, REQ, QSL, CTX, DROPPING, COUNTS, tokens, steps, window, BLOCK_T: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < tokens
    t = tl.where(ok, t, 0)
    pos = tl.load(POS + t, mask=ok, other=0).to(tl.int64)
    request = tl.load(REQ + t, mask=ok, other=0).to(tl.int64)
    low = pos - window + 1  # visible: position >= low
    dropping = tl.load(DROPPING + request, mask=ok, other=0) != 0
    lo = tl.load(QSL + request, mask=ok, other=0).to(tl.int64)
    hi = t
    for _ in range(steps):  # the first row of the request at or above `low` lies in [lo, hi] (row t itself is)
        mid = (lo + hi) // 2
        above = tl.load(POS + mid, mask=ok & dropping, other=0) >= low
        lo = tl.where(above, lo, mid + 1)
        hi = tl.where(above, mid, hi)
    context = tl.load(CTX + request, mask=ok, other=0).to(tl.int64)
    in_context = tl.maximum(context - tl.maximum(low, 0), 0)
    count = tl.where(dropping, t - lo + 1 + in_context, tl.minimum(pos + 1, window))
    tl.store(COUNTS + t, count, mask=ok)


def layout_rows_triton(query_start_loc: torch.Tensor, kv_base: torch.Tensor, tables: Sequence[torch.Tensor],
                       block_size: int, tokens: int, *, kept: torch.Tensor | None = None,
                       positions: torch.Tensor | None = None, source: torch.Tensor | None = None):
    """(positions, source, request, logical, slots): one int64 buffer, its views; one launch per MAX_TABLES tables."""
    device = query_start_loc.device
    num_reqs = query_start_loc.numel() - 1
    rows = 1 if kept is not None else (2 if positions is None else 0)
    per_row = 2 + (2 if rows else 0) + len(tables)
    buffer = torch.empty(per_row * tokens, dtype=torch.int64, device=device)
    request, logical = buffer[:tokens], buffer[tokens:2 * tokens]
    out_pos, out_src = (buffer[2 * tokens:3 * tokens], buffer[3 * tokens:4 * tokens]) if rows else (None, None)
    slots_at = (4 if rows else 2) * tokens
    slots = tuple(buffer[slots_at + g * tokens:slots_at + (g + 1) * tokens] for g in range(len(tables)))
    if tokens == 0:
        return out_pos, out_src, request, logical, slots
    steps = max(num_reqs, 1).bit_length()
    grid = (triton.cdiv(tokens, _BLOCK_T),)
    dummy = request  # never read where num_tables / rows say so
    for first in range(0, max(len(tables), 1), MAX_TABLES):
        chunk = list(tables[first:first + MAX_TABLES])
        # unused table pointers: a table's dtype (vLLM's int32; a pointer's dtype selects the compiled variant)
        padded = chunk + [chunk[0] if chunk else query_start_loc.view(1, -1)] * (MAX_TABLES - len(chunk))
        strides = [t.stride(0) for t in padded]
        layout_rows_kernel[grid](
            query_start_loc, kv_base, kept if kept is not None else dummy, positions if rows == 1 else dummy,
            source if rows == 1 else dummy, out_pos if rows else dummy, out_src if rows else dummy, request, logical,
            buffer[slots_at + first * tokens:] if chunk else dummy, *padded, *strides, tokens, num_reqs, steps,
            block_size, len(chunk), rows if first == 0 else 0, BLOCK_T=_BLOCK_T,
        )
    return out_pos, out_src, request, logical, slots


def window_counts_triton(positions: torch.Tensor, request: torch.Tensor, query_start_loc: torch.Tensor,
                         context: torch.Tensor, dropping: torch.Tensor, window: int,
                         max_query_len: int) -> torch.Tensor:
    tokens = positions.numel()
    counts = torch.empty(tokens, dtype=torch.int64, device=positions.device)
    if tokens:
        steps = max(max_query_len, 1).bit_length()
        window_counts_kernel[(triton.cdiv(tokens, _BLOCK_T),)](
            positions, request, query_start_loc, context, dropping.view(torch.int8) if dropping.dtype == torch.bool
            else dropping, counts, tokens, steps, window, BLOCK_T=_BLOCK_T)
    return counts


def warm_up_layout_rows(device: torch.device, index_dtype: torch.dtype = torch.int32) -> int:
    """Run both kernels once on a tiny layout with vLLM's dtypes (`index_dtype`: `query_start_loc` and the block
    tables), so that Triton compiles them here and not in a first request's step; returns the launches run."""
    qsl = torch.tensor([0, 2, 3], dtype=index_dtype, device=device)
    table = torch.arange(8, dtype=index_dtype, device=device).view(2, 4)
    kept = torch.tensor([0, 2, 3], device=device)
    positions = torch.arange(4, device=device)
    _, _, request, _, _ = layout_rows_triton(qsl, qsl[:2], [table], 16, 3, kept=kept, positions=positions,
                                             source=positions)
    window_counts_triton(positions[:3], request, qsl, torch.zeros(2, dtype=torch.int64, device=device),
                         torch.ones(2, dtype=torch.int64, device=device), 4, 2)
    return 2
