"""The Triton kernels of paged sliding-window attention and their launcher (imported only when it runs:
importing it imports triton).

- `paged_window_kernel`: one program per (row, KV head), an online-softmax loop over the row's entries in tiles
  of BLOCK_N, the GQA query heads of that KV head together. Each key is read once per row: W keys per row.
- `paged_window_tiled_kernel`: one program per (BLOCK_M consecutive rows, KV head). Per request among its rows,
  one loop over the union of those rows' runs of entries, each row masked to its own run: a key is read once per
  tile of rows. For requests with many rows in a step (prefill): the runtime runs it there, the per-row kernel for
  decode rows and short prompts (`uniprefill.vllm.window.kernel_plan`). On the H200 (2026-12-04, Gemma-3-270M's sliding layers, 32K rows of one
  request): 0.61 ms against the per-row kernel's 3.52 (128 query rows x heads per program, 8 warps; 64 rows:
  0.75-0.93 ms); in a 32K prefill on vLLM it cut the window kernels' device time from 17.5 to 4.7 ms
  (docs/results/vllm-gemma-profile-h200-2026-12-04).

Both read only entries inside some row's run (blocks behind every window may have been freed and reused)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import interpret_enabled, next_power_of_2


@triton.jit
def _online_softmax_step(q, k, v, visible, m, denom, acc, scale, softcap, USE_SOFTCAP: tl.constexpr,
                         FP32_DOT: tl.constexpr):
    """One tile of keys k / values v ([BLOCK_N, BLOCK_D]) into the running max m, denominator and accumulator of
    the query rows q, each row seeing the columns `visible` marks. A row that has seen nothing yet stays empty."""
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    if USE_SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: no NaN
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    denom = denom * alpha + tl.sum(p, 1)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc


@triton.jit
def paged_window_kernel(
    Q, K, V, O, TABLE, REQ, LOGICAL, COUNT, SKIP, ROWS, PART_M, PART_L, PART_ACC,
    sq_t, sq_h, sq_d, sk_b, sk_n, sk_h, sk_d, sv_b, sv_n, sv_h, sv_d, so_t, so_h, so_d, st_r, st_b,
    scale, softcap,
    CACHE_BLOCK: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, FP32_DOT: tl.constexpr,
    SPLITS: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    """Program (t, h, s): query row t, KV head h and its GROUP query heads; online softmax over
    the entries [logical[t] - count[t] + 1, logical[t]] of request req[t], BLOCK_N at a time. With SPLITS > 1
    program s takes the s-th of SPLITS runs of whole BLOCK_N tiles of those entries and writes its running max,
    denominator and unnormalised accumulator to PART_M / PART_L [T, Hk, SPLITS, BLOCK_G] and PART_ACC [T, Hk,
    SPLITS, BLOCK_G, BLOCK_D] (fp32, contiguous) for `paged_window_combine_kernel`. With HAS_SKIP, a row whose SKIP
    flag is set reads no entry and writes nothing: its output row keeps what is there (vLLM's result). With
    HAS_ROWS, program p takes row ROWS[p] of the step (its query, output and per-row entries; PART_* stay per
    program)."""
    prog = tl.program_id(0).to(tl.int64)
    t = prog
    if HAS_ROWS:
        t = tl.load(ROWS + prog).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    req = tl.load(REQ + t).to(tl.int64)
    own = tl.load(LOGICAL + t).to(tl.int64)
    count = tl.load(COUNT + t).to(tl.int64)
    first = own - count + 1
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(Q + t * sq_t + (h * GROUP + g)[:, None] * sq_h + d[None, :] * sq_d,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    chunk = tl.cdiv(tl.cdiv(count, SPLITS), BLOCK_N) * BLOCK_N  # this program's entries: [lo, hi) of the run
    lo = split * chunk
    hi = tl.minimum(count, lo + chunk)
    if HAS_SKIP:
        hi = tl.where(tl.load(SKIP + t) == 0, hi, lo)  # a skipped row: no entry read
    for start in range(lo, hi, BLOCK_N):
        idx = first + start + tl.arange(0, BLOCK_N)
        n_ok = start + tl.arange(0, BLOCK_N) < hi
        idx = tl.where(n_ok, idx, own)  # never read outside the window (freed blocks)
        blk = tl.load(TABLE + req * st_r + (idx // CACHE_BLOCK) * st_b).to(tl.int64)
        off = idx % CACHE_BLOCK
        k = tl.load(K + blk[:, None] * sk_b + off[:, None] * sk_n + h * sk_h + d[None, :] * sk_d,
                    mask=d_ok[None, :], other=0.0)
        v = tl.load(V + blk[:, None] * sv_b + off[:, None] * sv_n + h * sv_h + d[None, :] * sv_d,
                    mask=d_ok[None, :], other=0.0)
        m, denom, acc = _online_softmax_step(q, k, v, n_ok[None, :], m, denom, acc, scale, softcap, USE_SOFTCAP,
                                             FP32_DOT)
    if SPLITS == 1:
        out = acc / denom[:, None]
        mask = g_ok[:, None] & d_ok[None, :]
        if HAS_SKIP:  # the flag loaded per head of the group: a 2-D mask & a scalar fails in Triton's interpreter
            mask = mask & (tl.load(SKIP + t + g * 0) == 0)[:, None]
        tl.store(O + t * so_t + (h * GROUP + g)[:, None] * so_h + d[None, :] * so_d, out.to(O.dtype.element_ty),
                 mask=mask)
    else:
        part = (prog * tl.num_programs(1) + h) * SPLITS + split
        tl.store(PART_M + part * BLOCK_G + g, m)
        tl.store(PART_L + part * BLOCK_G + g, denom)
        tl.store(PART_ACC + (part * BLOCK_G + g)[:, None] * BLOCK_D + d[None, :], acc)


@triton.jit
def paged_window_combine_kernel(PART_M, PART_L, PART_ACC, O, SKIP, ROWS, so_t, so_h, so_d, GROUP: tl.constexpr,
                                BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                SPLITS: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Program (p, h): merge the SPLITS partial softmaxes `paged_window_kernel`'s program p wrote for its row t
    (p, or ROWS[p]), KV head h (a split that saw no entry holds max -inf, denominator 0 and adds nothing); a skipped
    row writes nothing."""
    prog = tl.program_id(0).to(tl.int64)
    t = prog
    if HAS_ROWS:
        t = tl.load(ROWS + prog).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    base = (prog * tl.num_programs(1) + h) * SPLITS
    m_all = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for s in range(SPLITS):
        m_all = tl.maximum(m_all, tl.load(PART_M + (base + s) * BLOCK_G + g))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    denom = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for s in range(SPLITS):
        w = tl.exp(tl.load(PART_M + (base + s) * BLOCK_G + g) - m_safe)
        denom += w * tl.load(PART_L + (base + s) * BLOCK_G + g)
        acc += w[:, None] * tl.load(PART_ACC + ((base + s) * BLOCK_G + g)[:, None] * BLOCK_D + d[None, :])
    out = acc / denom[:, None]
    mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    if HAS_SKIP:
        mask = mask & (tl.load(SKIP + t + g * 0) == 0)[:, None]
    tl.store(O + t * so_t + (h * GROUP + g)[:, None] * so_h + d[None, :] * so_d, out.to(O.dtype.element_ty),
             mask=mask)


@triton.jit
def paged_window_tiled_kernel(
    Q, K, V, O, TABLE, REQ, LOGICAL, COUNT, ROWS, tokens,
    sq_t, sq_h, sq_d, sk_b, sk_n, sk_h, sk_d, sv_b, sv_n, sv_h, sv_d, so_t, so_h, so_d, st_r, st_b,
    scale, softcap,
    CACHE_BLOCK: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    FP32_DOT: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    """Program (c, h): rows [c * BLOCK_M, (c + 1) * BLOCK_M), KV head h and its GROUP query heads, as BLOCK_M x
    BLOCK_G query rows. While rows are left: take the smallest request id r among them, run one online softmax
    over the entries from the smallest first to the largest own entry of r's rows (entry columns no row of r
    sees are neither read nor counted), and mark r's rows done. With HAS_ROWS the tile's rows are ROWS[c * BLOCK_M]
    onwards (`tokens` of them in all): the step's rows those entries name."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK_M * BLOCK_G)
    g = i % BLOCK_G
    t = c * BLOCK_M + i // BLOCK_G
    t_ok = t < tokens
    row_ok = t_ok & (g < GROUP)
    t = tl.where(t_ok, t, 0)
    if HAS_ROWS:
        t = tl.load(ROWS + t, mask=t_ok, other=0).to(tl.int64)
    req = tl.load(REQ + t).to(tl.int64)
    own = tl.load(LOGICAL + t).to(tl.int64)
    first = own - tl.load(COUNT + t).to(tl.int64) + 1
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + t[:, None] * sq_t + (h * GROUP + g)[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_M * BLOCK_G,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_M * BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_M * BLOCK_G, BLOCK_D), tl.float32)
    big = 1 << 62
    todo = row_ok
    while tl.max(todo.to(tl.int32), 0) > 0:
        r = tl.min(tl.where(todo, req, big), 0)
        seg = todo & (req == r)
        lo = tl.min(tl.where(seg, first, big), 0)
        hi = tl.max(tl.where(seg, own, -1), 0)
        for start in range(lo, hi + 1, BLOCK_N):
            idx = start + tl.arange(0, BLOCK_N)
            visible = seg[:, None] & (idx[None, :] >= first[:, None]) & (idx[None, :] <= own[:, None])
            seen = tl.max(visible.to(tl.int32), 0) > 0  # a column some row of r sees
            idx_read = tl.where(seen, idx, hi)  # never read an entry outside every window (freed blocks)
            blk = tl.load(TABLE + r * st_r + (idx_read // CACHE_BLOCK) * st_b).to(tl.int64)
            off = idx_read % CACHE_BLOCK
            k = tl.load(K + blk[:, None] * sk_b + off[:, None] * sk_n + h * sk_h + d[None, :] * sk_d,
                        mask=d_ok[None, :], other=0.0)
            v = tl.load(V + blk[:, None] * sv_b + off[:, None] * sv_n + h * sv_h + d[None, :] * sv_d,
                        mask=seen[:, None] & d_ok[None, :], other=0.0)
            m, denom, acc = _online_softmax_step(q, k, v, visible, m, denom, acc, scale, softcap, USE_SOFTCAP,
                                                 FP32_DOT)
        todo = todo & (req != r)
    out = acc / tl.where(row_ok, denom, 1.0)[:, None]
    tl.store(O + t[:, None] * so_t + (h * GROUP + g)[:, None] * so_h + d[None, :] * so_d,
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _check_dot_sides(rows: int, entries: int, rows_name: str, entries_name: str) -> None:
    """Triton's dot takes sides of at least 16 on a GPU (the interpreter takes any): a clear error here instead of a
    compiler failure at the launch."""
    if interpret_enabled() or (rows >= 16 and entries >= 16):
        return
    raise ValueError(f"{entries_name}={entries}" + (f", {rows_name} giving {rows} query rows a program" if rows_name
                     else "") + ": at least 16 of each on a GPU (Triton's dot); smaller tiles run only in Triton's "
                     "CPU interpreter")


def paged_window_attention_triton(query, key_cache, value_cache, block_table, row_request, row_logical, row_count,
                                  *, window: int, scale: float, softcap: float | None = None,
                                  block_n: int = 64, tiled: bool = False, tile_rows: int | None = None,
                                  tile_block_n: int | None = None, num_warps: int | None = None,
                                  num_stages: int | None = None, splits: int = 1,
                                  out: torch.Tensor | None = None, skip: torch.Tensor | None = None,
                                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernels (see the module docstring); same contract as the reference. `tiled`: the tiled kernel
    instead of the per-row one; `tile_rows` (query rows x heads per program), `tile_block_n` (entries per loop
    step), `num_warps` and `num_stages` are its tuning knobs (benchmarks/bench_paged_window.py compares them).
    Their defaults: 128, 32, 8 and Triton's at head sizes of 256 (the fastest of four row / warp pairs on the H200
    at Gemma-3's shapes; the entries per step and the stages not timed), 64, `block_n`, 4 below (not timed).
    `splits` (a power of two; per-row kernel): each row's entries over that many programs, merged by
    `paged_window_combine_kernel` (split-KV, for steps of few rows: a decode step at batch 1 is otherwise one
    program per KV head). `out`: written in place of a new tensor (its own strides). `skip` (per-row kernel, with
    `out`): rows left as `out` holds them. `rows` (with `out`): only those rows of the step, each read and written
    in place (no gather of the query, no copy of the output)."""
    tokens, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(query) if out is None else out  # `out`, `rows`: checked by `paged_window_attention`
    row_ids = out if rows is None else rows  # a placeholder pointer where there are none
    tokens = tokens if rows is None else rows.numel()  # programs are per row taken
    if tokens == 0:
        return out
    fp32_dot = query.dtype == torch.float32 or interpret_enabled()  # the interpreter's bf16 dot is wrong
    if skip is not None and tiled:
        raise ValueError("skip: the per-row kernel's (the tiled one writes every row)")
    skip_flags = out if skip is None else skip.view(torch.uint8) if skip.dtype == torch.bool else skip
    if tiled:
        block_g = next_power_of_2(group)
        block_d = max(16, next_power_of_2(dim))
        tile_rows = tile_rows or (128 if block_d >= 256 else 64)
        block_m = max(1, tile_rows // block_g)  # 128 query rows per program: 32 rows x 4 heads for Gemma-3-270M
        entries = tile_block_n or (32 if block_d >= 256 else block_n)
        _check_dot_sides(block_m * block_g, entries, "tile_rows", "tile_block_n")
        paged_window_tiled_kernel[(triton.cdiv(tokens, block_m), kv_heads)](
            query, key_cache, value_cache, out, block_table, row_request, row_logical, row_count, row_ids, tokens,
            *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(), *block_table.stride(),
            float(scale), float(softcap or 0.0),
            CACHE_BLOCK=key_cache.shape[1], GROUP=group, BLOCK_G=block_g, BLOCK_M=block_m, HEAD_DIM=dim,
            BLOCK_D=block_d, BLOCK_N=tile_block_n or (32 if block_d >= 256 else block_n), USE_SOFTCAP=bool(softcap),
            FP32_DOT=fp32_dot, HAS_ROWS=rows is not None, num_warps=num_warps or (8 if block_d >= 256 else 4),
            **({"num_stages": num_stages} if num_stages else {}),
        )
        return out
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits={splits}: expected a power of two")
    _check_dot_sides(16, block_n, "", "block_n")  # the per-row kernel's query side is padded to 16
    block_g, block_d = max(16, next_power_of_2(group)), max(16, next_power_of_2(dim))
    part_m = part_l = part_acc = out  # unused with one split
    if splits > 1:
        part_m = torch.empty(tokens, kv_heads, splits, block_g, device=query.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(tokens, kv_heads, splits, block_g, block_d, device=query.device, dtype=torch.float32)
    paged_window_kernel[(tokens, kv_heads, splits)](
        query, key_cache, value_cache, out, block_table, row_request, row_logical, row_count, skip_flags, row_ids,
        part_m, part_l, part_acc, *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
        *block_table.stride(), float(scale), float(softcap or 0.0),
        CACHE_BLOCK=key_cache.shape[1], GROUP=group, BLOCK_G=block_g, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_N=block_n,
        USE_SOFTCAP=bool(softcap), FP32_DOT=fp32_dot, SPLITS=splits, HAS_SKIP=skip is not None,
        HAS_ROWS=rows is not None,
    )
    if splits > 1:
        paged_window_combine_kernel[(tokens, kv_heads)](
            part_m, part_l, part_acc, out, skip_flags, row_ids, *out.stride(), GROUP=group, BLOCK_G=block_g,
            HEAD_DIM=dim, BLOCK_D=block_d, SPLITS=splits, HAS_SKIP=skip is not None, HAS_ROWS=rows is not None,
        )
    return out
