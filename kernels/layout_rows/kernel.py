"""The Triton kernels of a step's row layout, and their launchers (imported only when they run: importing this
module imports triton).

- `layout_rows_kernel`: one program per BLOCK_T rows of a layout. Each row finds its request by a binary search
  over `query_start_loc`, its logical KV index (`kv_base[r] + t - qsl[r]`), up to `MAX_TABLES` KV-cache groups'
  slots through their block tables, and, as asked, its position and source row (gathered through `kept`, or the
  logical index and the row itself for vLLM's own batch). One launch replaces the ~25 torch ops (each a launch or
  a host op on a host-bound step) of `reference.layout_rows_torch`.
- `window_counts_kernel`: one program per BLOCK_T rows: each row of a dropping request finds the first row of its
  request within the window by a binary search over the (increasing) positions of the request's rows.
- `decode_segment_kernel` / `decode_window_kernel`: what a decode step's CUDA graph computes for the layers after a
  drop (`vllm.graph_decode`): one launch each where the torch compositions were about ten and fifteen small kernels
  (on the H200 those kernels took 1.5 ms of a 16-token decode's 16.25 ms of device time,
  docs/results/vllm-gemma-profile-h200-2026-12-05).

One compiled variant each (two for `decode_window_kernel`: with and without `vllm_rows`): every argument but the
tile sizes is left unspecialised (`do_not_specialize`: the row count, a search's steps, the tables' row strides,
how many tables and which rows to write are run-time values, and no pointer's 16-byte alignment is assumed: the
outputs are views into one buffer). Only the pointers' dtypes select a variant: vLLM's are int32
`query_start_loc`, `seq_lens` and block tables, int64 rows, positions and slots. `warm_up_layout_rows` compiles
every kernel here before a server's first request, and so before vLLM captures its graphs (a compile must not
happen inside a capture).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

MAX_TABLES = 8  # block tables one launch reads; more groups take more launches
_BLOCK_T = 256


def _segment(n: int) -> int:
    """Elements between the int64 views of one output buffer: `n` rounded up to an even count, so that every view
    starts on 16 bytes. The window kernels (`kernels.paged_window`) read some of these views and, like every plain
    `triton.jit` kernel, compile a variant per pointer alignment: an odd row count would otherwise compile a new one
    in a request's step, or inside a decode graph's capture, where the warm-up's aligned tensors compiled the other."""
    return n + (n & 1)


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
                                           "seg", "num_reqs", "steps", "block_size", "num_tables", "rows"])
def layout_rows_kernel(
    QSL, KV_BASE, KEPT, POS_IN, SRC_IN, POS_OUT, SRC_OUT, REQ_OUT, LOGICAL_OUT, SLOTS,
    T0, T1, T2, T3, T4, T5, T6, T7, st0, st1, st2, st3, st4, st5, st6, st7,
    tokens, seg, num_reqs, steps, block_size, num_tables, rows, BLOCK_T: tl.constexpr,
):
    """rows: 0 no positions / sources, 1 gathered through KEPT, 2 vLLM's own batch (position = logical index).
    SLOTS: num_tables rows of `tokens` slots, table g's at SLOTS + g * seg."""
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
        _store_slot(T1, SLOTS + seg, st1, request, logical, t, ok, block_size)
    if num_tables > 2:
        _store_slot(T2, SLOTS + 2 * seg, st2, request, logical, t, ok, block_size)
    if num_tables > 3:
        _store_slot(T3, SLOTS + 3 * seg, st3, request, logical, t, ok, block_size)
    if num_tables > 4:
        _store_slot(T4, SLOTS + 4 * seg, st4, request, logical, t, ok, block_size)
    if num_tables > 5:
        _store_slot(T5, SLOTS + 5 * seg, st5, request, logical, t, ok, block_size)
    if num_tables > 6:
        _store_slot(T6, SLOTS + 6 * seg, st6, request, logical, t, ok, block_size)
    if num_tables > 7:
        _store_slot(T7, SLOTS + 7 * seg, st7, request, logical, t, ok, block_size)


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
    seg = _segment(tokens)
    buffer = torch.empty(per_row * seg, dtype=torch.int64, device=device)
    views = [buffer[i * seg:i * seg + tokens] for i in range(per_row)]
    request, logical = views[0], views[1]
    out_pos, out_src = (views[2], views[3]) if rows else (None, None)
    slots = tuple(views[per_row - len(tables):])
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
            slots[first] if chunk else dummy, *padded, *strides, tokens, seg, num_reqs, steps,
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
    """Run every kernel here once on a small step with vLLM's dtypes (`index_dtype`: `query_start_loc`, `seq_lens` and
    the block tables), so that Triton compiles them now and not in a first request's step or inside a graph capture,
    and check each result against its PyTorch reference on the same device: a kernel that disagrees raises here,
    at the engine's start, instead of serving wrong layouts. Returns the launches run."""
    from . import reference

    def on(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    qsl = on([0, 5, 5, 12], index_dtype)  # three requests, the second empty
    kv_base = on([1, 0, 3], index_dtype)
    tables = [on([[7, 2, 9, 4, 0], [5, 1, 8, 3, 0], [6, 0, 2, 11, 0]], index_dtype)[:, :4] for _ in range(2)]
    tables[1] = tables[1] + 20
    kept = on([0, 2, 3, 5, 6, 9, 11, 12, 13, 15, 16, 17])
    positions = on(list(range(0, 40, 2)))
    source = on(list(range(100, 120)))
    checks = []
    for rows in ({"kept": kept, "positions": positions, "source": source}, {}, {"positions": positions}):
        checks.append(("layout_rows", layout_rows_triton(qsl, kv_base, tables, 4, 12, **rows),
                       reference.layout_rows_torch(qsl, kv_base, tables, 4, 12, **rows)))
    pos, request = checks[0][2][0], checks[0][2][2]
    context, dropping = on([4, 0, 9]), on([1, 0, 1])
    checks.append(("window_counts", window_counts_triton(pos, request, qsl, context, dropping, 7, 7),
                   reference.window_counts_torch(pos, request, qsl, context, dropping, 7)))
    # the decode graphs' kernels, with vLLM's and `vllm.graph_decode.DecodeTables`' dtypes, launched at capture
    seq_lens = on([9, 0, 13], index_dtype)
    removed = on([3, 0, 0, 0], torch.int32)
    slots = on([40, -1, 17, -1])
    checks.append(("decode_segment", decode_segment_triton(seq_lens, tables[0], slots, removed, 4),
                   reference.decode_segment_torch(seq_lens, tables[0], slots, removed, 4)))
    tail = on([[2, 5, 8, -(2 ** 40)], [-(2 ** 40)] * 4, [1, 9, 11, 12], [0] * 4])
    prompt_end, has = on([9, 0, 12, 0]), on([1, 0, 1, 0], torch.bool)
    for flags in (None, removed):
        checks.append(("decode_window", decode_window_triton(seq_lens, tail, prompt_end, has, 6, flags),
                       reference.decode_window_torch(seq_lens, tail, prompt_end, has, 6, flags)))
    for name, got, want in checks:
        flat_got, flat_want = _flatten(got), _flatten(want)
        if len(flat_got) != len(flat_want) or not all(
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for a, b in zip(flat_got, flat_want)):
            raise RuntimeError(f"uniprefill: the Triton kernel {name} disagrees with its PyTorch reference on {device} "
                               f"(got {flat_got}, expected {flat_want}); refusing to run with it: report this, and set "
                               "the option \"impl\": \"torch\" meanwhile")
    return len(checks)


def _flatten(result) -> list:
    out = []
    for item in result if isinstance(result, tuple) else (result,):
        out.extend(_flatten(item) if isinstance(item, tuple) else [item])
    return out


@triton.jit(do_not_specialize=["SEQ_LENS", "TABLE", "SLOTS_IN", "REMOVED", "LENS", "SLOTS", "num_reqs", "st_r",
                               "block_size"])
def decode_segment_kernel(SEQ_LENS, TABLE, SLOTS_IN, REMOVED, LENS, SLOTS, num_reqs, st_r, block_size,
                          BLOCK_R: tl.constexpr):
    """A decode step's rows (one per request) at a full-attention layer after a drop: the KV length without the
    removed entries, and the new token's slot at its shorter logical index (padding rows keep vLLM's -1)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < num_reqs
    seq = tl.load(SEQ_LENS + r, mask=ok, other=0)
    lens = seq - tl.load(REMOVED + r, mask=ok, other=0).to(seq.dtype)
    logical = tl.maximum(lens.to(tl.int64) - 1, 0)
    block = tl.load(TABLE + r * st_r + logical // block_size, mask=ok, other=0).to(tl.int64)
    base = tl.load(SLOTS_IN + r, mask=ok, other=0).to(tl.int64)
    tl.store(LENS + r, lens, mask=ok)
    tl.store(SLOTS + r, tl.where(base < 0, base, block * block_size + logical % block_size), mask=ok)


@triton.jit(do_not_specialize=["SEQ_LENS", "TAIL", "PROMPT_END", "HAS", "REMOVED", "ROWS", "VLLM_ROWS", "seg",
                               "st_tail", "max_window", "window"])
def decode_window_kernel(SEQ_LENS, TAIL, PROMPT_END, HAS, REMOVED, ROWS, VLLM_ROWS, seg, st_tail, max_window, window,
                         HAS_REMOVED: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program r: a decode row of a sliding layer after a drop: its request, logical index (its position) and the
    cache entries it sees under the window over positions (`decode_window_torch`); ROWS holds request, logical and
    count, `seg` apart."""
    r = tl.program_id(0).to(tl.int64)
    pos = tl.load(SEQ_LENS + r).to(tl.int64) - 1
    low = pos - window  # visible: position > low
    in_prompt = tl.zeros([], tl.int64)
    for w0 in range(0, max_window, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        kept = tl.load(TAIL + r * st_tail + w, mask=w < max_window, other=-(2 ** 62))
        in_prompt += tl.sum((kept > low).to(tl.int64), 0)
    decoded = tl.maximum(tl.minimum(pos - tl.load(PROMPT_END + r) + 1, window), 0)
    count = tl.where(tl.load(HAS + r) != 0, in_prompt + decoded, tl.minimum(pos + 1, window))
    logical = tl.maximum(pos, 0)
    count = tl.minimum(tl.minimum(tl.maximum(count, 1), window), logical + 1)
    tl.store(ROWS + r, r)
    tl.store(ROWS + seg + r, logical)
    tl.store(ROWS + 2 * seg + r, count)
    if HAS_REMOVED:
        tl.store(VLLM_ROWS + r, (tl.load(REMOVED + r) == 0).to(tl.uint8))


def decode_segment_triton(seq_lens: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                          removed: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_reqs = seq_lens.shape[0]
    lens = torch.empty_like(seq_lens)
    slots = torch.empty(num_reqs, dtype=torch.int64, device=seq_lens.device)
    if num_reqs:
        decode_segment_kernel[(triton.cdiv(num_reqs, 128),)](
            seq_lens, block_table, slot_mapping, removed, lens, slots, num_reqs, block_table.stride(0), block_size,
            BLOCK_R=128)
    return lens, slots


def decode_window_triton(seq_lens: torch.Tensor, tail: torch.Tensor, prompt_end: torch.Tensor, has: torch.Tensor,
                         window: int, removed: torch.Tensor | None = None):
    num_reqs = seq_lens.shape[0]
    seg = _segment(num_reqs)
    rows = torch.empty(3 * seg, dtype=torch.int64, device=seq_lens.device)
    vllm_rows = torch.empty(num_reqs, dtype=torch.uint8, device=seq_lens.device) if removed is not None else None
    if num_reqs:
        decode_window_kernel[(num_reqs,)](
            seq_lens, tail, prompt_end, has.view(torch.uint8) if has.dtype == torch.bool else has,
            removed if removed is not None else seq_lens, rows, vllm_rows if vllm_rows is not None else rows,
            seg, tail.stride(0), tail.shape[1], window, HAS_REMOVED=removed is not None, BLOCK_W=128)
    request, logical, count = (rows[i * seg:i * seg + num_reqs] for i in range(3))
    return request, logical, count, None if vllm_rows is None else vllm_rows.view(torch.bool)
