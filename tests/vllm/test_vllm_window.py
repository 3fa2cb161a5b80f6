"""Sliding windows over ORIGINAL positions after a drop, in vLLM's paged layout (CPU):
right-aligned storage (`compact(..., align="right")`), the visible-entry counts and the
paged attention, each against a brute force written from the rule 0 <= pos_q - pos_k < W."""

from __future__ import annotations

import types

import pytest
import torch

from test_vllm_metadata import make_batch, random_drop  # tests/vllm is on the path (pyproject.toml)
from uniprefill.vllm.metadata import DropHistoryStore, DropRecord, RequestDropHistory, compact
from uniprefill.kernels.paged_window import paged_window_attention
from uniprefill.vllm.window import window_counts

ON_CPU = pytest.mark.interpreter  # a case that runs Triton on CPU tensors (tests/conftest.py)

DROPS, LAYERS = (1, 3), 6


def test_right_aligned_rows_end_where_the_prompt_ends_and_compose():
    # request 0 drops (no context), request 1 is a decode token, request 2 a short prefill that keeps everything
    batch = make_batch([200, 1, 30], [0, 57, 0], block_sizes=(16, 32))
    layout = batch.layout()
    kept, counts = random_drop(batch, droppers={0}, seed=1)
    right = compact(layout, torch.tensor(kept), torch.tensor(counts), align="right", validate="full")
    logical = right.row_logical
    k0 = counts[0]
    assert logical[:k0].tolist() == list(range(200 - k0, 200))  # right-aligned: the last kept row stays at 199
    assert logical[k0:].tolist() == [57] + list(range(30))  # the others are where vLLM put them
    assert right.positions.tolist() == layout.positions[torch.tensor(kept)].tolist()
    for g, (table, block) in enumerate(zip(right.block_tables, right.block_sizes)):
        req = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
        expected = table[req, logical // block].long() * block + logical % block
        assert torch.equal(right.slot_mappings[g], expected)
    assert right.seq_lens_cpu.tolist() == [200, 58, 30]  # vLLM's own counts: blocks stay allocated
    # a second drop point composes: still ending at the prompt's end
    sub = list(range(0, k0, 2))
    if sub[-1] != k0 - 1:
        sub.append(k0 - 1)
    again = compact(right, torch.tensor(sub + list(range(k0, right.num_actual_tokens))),
                    torch.tensor([len(sub), 1, 30]), align="right")
    logical2 = again.row_logical
    assert logical2[:len(sub)].tolist() == list(range(200 - len(sub), 200))
    with pytest.raises(ValueError, match="kv_removed_cpu"):
        compact(layout, torch.tensor(kept), torch.tensor(counts), align="right", kv_removed_cpu=torch.zeros(3))
    with pytest.raises(ValueError, match="align"):
        compact(layout, torch.tensor(kept), torch.tensor(counts), align="middle")


def _history(request_id, prompt_len, seed):
    gen = torch.Generator().manual_seed(seed)
    drops, pool = [], torch.arange(prompt_len)
    for layer in DROPS:
        body = pool[:-1][torch.randperm(pool.numel() - 1, generator=gen)[: pool.numel() // 3]].sort().values
        pool = torch.cat([body, pool[-1:]])
        drops.append(DropRecord(layer, pool.numel(), pool.clone()))
    return RequestDropHistory(request_id, 0, prompt_len, tuple(drops))


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=ON_CPU)])  # `kernels.layout_rows.window_counts`
@pytest.mark.parametrize("window", [1, 8, 40])
def test_window_counts_match_the_position_rule(window, impl):
    """A step mixing a dropping prefill, a decode with a drop history, a decode without one and
    a chunked prefill with context: each row's count = keys of its layer within the window."""
    store = DropHistoryStore(DROPS, LAYERS, max_window=64)
    hist = _history("h", 150, seed=3)
    row_h = store.add(hist)
    query_lens, ctx = [120, 1, 1, 20], [0, 150 + 4, 90, 64]  # "h" decodes its 5th token
    batch = make_batch(query_lens, ctx)
    kept, counts = random_drop(batch, droppers={0}, seed=5, keep=0.3)
    right = compact(batch.layout(impl=impl), torch.tensor(kept), torch.tensor(counts), align="right")
    dropping = torch.tensor([True, False, False, False])
    history_rows = torch.tensor([0, row_h, 0, 0])
    layer = 2  # holds drop 0's kept tokens
    got = window_counts(right, window, dropping, store, history_rows, layer).tolist()
    positions = right.positions.tolist()
    qsl = right.query_start_loc_cpu.tolist()
    expected = []
    for r in range(4):
        rows = positions[qsl[r]:qsl[r + 1]]
        for i, p in enumerate(rows):
            if r == 0:
                keys = rows[: i + 1]  # the kept rows of this step
            elif r == 1:
                keys = hist.key_positions(layer, 5).tolist()
            else:
                keys = list(range(p + 1))  # one entry per position
            expected.append(sum(1 for k in keys if 0 <= p - k < window))
    assert got == expected
    assert max(got) <= window


@pytest.mark.parametrize("impl", ["torch", "triton-per-row", "triton-tiled", "triton-tiled-128", "triton-tiled-n16",
                                  "triton-split",  # tiles of 4 entries: below a GPU dot's 16, the interpreter only
                                  pytest.param("triton-split-tiles", marks=ON_CPU)])
def test_paged_window_attention_matches_a_dense_reference(impl):
    """The reference (one chunk and chunks of 3 rows) and both Triton kernels (CPU interpreter
    here) against a per-row loop; softcap on and off; strided caches as vLLM's views are. Rows of
    three requests in random order, so a tile of the tiled kernel (64 or 128 query rows x heads, the latter
    its default at head size 256; and with loop steps of 16 entries, several a window) holds several requests and
    gaps between its rows' runs; the per-row kernel
    also split over 4 programs a row (tiles of 16 entries: two splits see entries, two none) and over 2 (tiles of 4
    entries: up to 3 tiles a split); every cache entry outside all runs is NaN (freed blocks hold anything):
    reading one would show."""
    from uniprefill.kernels.paged_window import paged_window_attention_torch, paged_window_attention_triton

    torch.manual_seed(0)
    heads, kv_heads, dim, block, num_blocks, window = 4, 2, 8, 16, 40, 24
    packed = torch.randn(num_blocks, kv_heads, block, 2 * dim)  # vLLM's FlashAttention layout
    key_cache, value_cache = packed.transpose(1, 2).split(dim, dim=-1)
    table = torch.randperm(num_blocks - 1)[:30].view(3, 10).int() + 1
    rows = 50
    request = torch.randint(0, 3, (rows,))
    logical = torch.randint(0, 160, (rows,))
    count = torch.minimum(torch.randint(1, window + 1, (rows,)), logical + 1)
    query = torch.randn(rows, heads, dim)
    live = torch.zeros(num_blocks, block, dtype=torch.bool)
    for t in range(rows):
        idx = torch.arange(int(logical[t]) - int(count[t]) + 1, int(logical[t]) + 1)
        live[table[request[t], idx // block].long(), idx % block] = True
    packed.masked_fill_(~live[:, None, :, None], float("nan"))
    scale, softcap = dim ** -0.5, 5.0
    for cap in (None, softcap):
        budgets = (1 << 26, 3 * window * kv_heads * dim) if impl == "torch" else (None,)
        for budget in budgets:  # one chunk, and chunks of 3 rows
            if impl == "torch":
                out = paged_window_attention_torch(query, key_cache, value_cache, table, request, logical, count,
                                                   window=window, scale=scale, softcap=cap, max_elements=budget)
            else:  # the CPU interpreter here, the GPU where there is one (fp32 either way)
                dev = "cuda" if torch.cuda.is_available() else "cpu"
                moved = [t.to(dev) for t in (query, key_cache, value_cache, table, request, logical, count)]
                split = {"triton-split": {"splits": 4, "block_n": 16},  # two of four splits see entries
                         "triton-split-tiles": {"splits": 2, "block_n": 4}}.get(impl, {})  # several tiles a split
                out = paged_window_attention_triton(*moved, window=window, scale=scale, softcap=cap,
                                                    tiled=impl.startswith("triton-tiled"),
                                                    tile_rows=128 if impl == "triton-tiled-128" else None,
                                                    tile_block_n=16 if impl == "triton-tiled-n16" else None,
                                                    **split).cpu()
            for t in range(rows):
                idx = torch.arange(int(logical[t]) - int(count[t]) + 1, int(logical[t]) + 1)
                blocks = table[request[t], idx // block].long()
                k, v = key_cache[blocks, idx % block], value_cache[blocks, idx % block]  # [n, Hk, D]
                k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
                s = torch.einsum("hd,nhd->hn", query[t], k) * scale
                if cap:
                    s = cap * torch.tanh(s / cap)
                ref = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
                torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple"):
        paged_window_attention(torch.randn(2, 3, dim), key_cache, value_cache, table, request[:2], logical[:2],
                               count[:2], window=window, scale=scale)
    with pytest.raises(ValueError, match="row_count"):
        paged_window_attention(query, key_cache, value_cache, table, request, logical, count[:3],
                               window=window, scale=scale)


def _two_request_step(seed: int, rows: int, heads: int = 4, kv_heads: int = 2, dim: int = 8, window: int = 24):
    """(query, key_cache, value_cache, table, request, logical, count) of a random step: `rows` rows of two requests
    in random order over 8 cache blocks of 16 entries each, in vLLM's FlashAttention layout."""
    torch.manual_seed(seed)
    packed = torch.randn(20, kv_heads, 16, 2 * dim)
    key_cache, value_cache = packed.transpose(1, 2).split(dim, dim=-1)
    table = torch.randperm(19)[:16].view(2, 8).int() + 1
    request = torch.randint(0, 2, (rows,))
    logical = torch.randint(0, 120, (rows,))
    count = torch.minimum(torch.randint(1, window + 1, (rows,)), logical + 1)
    return torch.randn(rows, heads, dim), key_cache, value_cache, table, request, logical, count


@pytest.mark.parametrize("impl,tiled,splits", [("torch", False, 1)] + [
    pytest.param("triton", *case, marks=ON_CPU) for case in ((False, 1), (True, 1), (False, 2))])
def test_the_window_kernels_write_into_a_given_output_as_they_return_one(impl, tiled, splits):
    """`out=`: a sliding layer's step writes vLLM's output buffer directly (no copy after the kernel). The rows of
    a view into a wider buffer (other strides than the query's) get bit for bit what the returned tensor holds, the
    rest of the buffer stays untouched; an output of another shape or one sharing the query's memory is refused."""
    heads, dim, window, rows = 4, 8, 24, 37
    args = _two_request_step(1, rows, heads=heads, dim=dim, window=window)
    query = args[0]
    kw = dict(window=window, scale=dim ** -0.5, impl=impl, tiled=tiled, splits=splits)
    expected = paged_window_attention(*args, **kw)
    buffer = torch.full((rows, heads * dim + 8), float("nan"))
    out = buffer[:, 8:].view(rows, heads, dim)  # row stride 40, not the query's 32
    assert paged_window_attention(*args, **kw, out=out) is out
    assert torch.equal(out, expected) and torch.isnan(buffer[:, :8]).all()
    with pytest.raises(ValueError, match="out: expected"):
        paged_window_attention(*args, **kw, out=torch.empty(rows - 1, heads, dim))
    with pytest.raises(ValueError, match="shares the query's memory"):
        paged_window_attention(*args, **kw, out=query)


@pytest.mark.parametrize("impl,tiled,splits", [("torch", False, 1)] + [
    pytest.param("triton", *case, marks=ON_CPU) for case in ((False, 1), (True, 1), (False, 4))])
def test_the_window_kernels_take_only_the_rows_given_in_place(impl, tiled, splits):
    """`rows=` (a step whose requests run on two kernels): the rows named, in any order, get bit for bit what the
    kernel gives them gathered into a query of their own (the path `rows` replaced: gather, run, copy back), written
    to their own rows of `out` (a view with other strides), and match the reference, `rows` given as int64, int32 or
    a strided view; every other row of `out` stays as it was (NaN here). An empty `rows` writes nothing; `rows`
    without `out`, of a float dtype or 2-D, is refused."""
    heads, dim, window, n = 4, 8, 24, 45
    args = _two_request_step(3, n, heads=heads, dim=dim, window=window)
    query, key_cache, value_cache, table, request, logical, count = args
    kw = dict(window=window, scale=dim ** -0.5, impl=impl, tiled=tiled, splits=splits)
    taken = torch.randperm(n)[:29]
    gathered = paged_window_attention(query[taken], key_cache, value_cache, table, request[taken], logical[taken],
                                      count[taken], **kw)
    reference = paged_window_attention(*args, **{**kw, "impl": "torch"})
    torch.testing.assert_close(gathered, reference[taken], atol=1e-5, rtol=1e-5)
    expected = torch.full_like(query, float("nan"))
    expected[taken] = gathered
    others = torch.ones(n, dtype=torch.bool)
    others[taken] = False
    strided = torch.stack([taken, torch.zeros_like(taken)], 1)[:, 0]  # stride 2: the kernels read at stride 1
    for ids in (taken, taken.int(), strided):
        buffer = torch.full((n, heads * dim + 8), float("nan"))
        out = buffer[:, 8:].view(n, heads, dim)
        assert paged_window_attention(*args, **kw, out=out, rows=ids) is out
        assert torch.equal(out[taken], expected[taken]) and torch.isnan(out[others]).all()
        assert torch.isnan(buffer[:, :8]).all()
    out = torch.full_like(query, float("nan"))
    paged_window_attention(*args, **kw, out=out, rows=taken[:0])
    assert torch.isnan(out).all()
    for bad, extra in ((taken, {}), (taken.float(), {"out": out}), (taken.view(1, -1), {"out": out})):
        with pytest.raises(ValueError, match="rows: expected"):
            paged_window_attention(*args, **kw, rows=bad, **extra)


@pytest.mark.parametrize("impl,splits", [("torch", 1)] + [pytest.param("triton", s, marks=ON_CPU) for s in (1, 2, 8)])
def test_skipped_rows_keep_what_the_output_holds_and_the_others_get_the_window(impl, splits):
    """`skip` (the decode graphs of an engine at p = 1: rows of requests that removed no KV entry keep vLLM's
    result, written first): those output rows stay bit for bit, the others equal the kernel without `skip`; the
    skipped rows' entries are NaN here, so a skipped row that read one would show in no row but its own, which must
    not change. Only the per-row kernel skips; the tiled one and a skip without `out` are refused."""
    torch.manual_seed(2)
    heads, kv_heads, dim, block, window, rows = 4, 2, 8, 16, 40, 29
    packed = torch.randn(40, kv_heads, block, 2 * dim)
    key_cache, value_cache = packed.transpose(1, 2).split(dim, dim=-1)
    table = torch.randperm(39)[:rows].view(rows, 1).int() + 1  # one block per request: rows own disjoint entries
    request = torch.arange(rows)
    logical = torch.randint(0, block, (rows,))
    count = torch.minimum(torch.randint(1, window + 1, (rows,)), logical + 1)
    skip = torch.rand(rows) < 0.5
    packed[table[skip, 0].long()] = float("nan")  # a skipped row's entries: never read
    query = torch.randn(rows, heads, dim)
    args = (query, key_cache, value_cache, table, request, logical, count)
    kw = dict(window=window, scale=dim ** -0.5, impl=impl, splits=splits)
    expected = paged_window_attention(*args, **kw)
    theirs = torch.randn(rows, heads, dim)  # what vLLM's attention wrote
    out = theirs.clone()
    paged_window_attention(*args, **kw, out=out, skip=skip)
    assert torch.equal(out[skip], theirs[skip])
    assert torch.equal(out[~skip], expected[~skip]) and not torch.isnan(out).any()
    if impl == "triton":  # a skipped row reads nothing: a block-table row far out of range (a read would fault)
        far = request.clone()
        far[skip] = 10 ** 6
        out = theirs.clone()
        paged_window_attention(query, key_cache, value_cache, table, far, logical, count, **kw, out=out, skip=skip)
        assert torch.equal(out[skip], theirs[skip]) and torch.equal(out[~skip], expected[~skip])
    with pytest.raises(ValueError, match="skip: expected"):
        paged_window_attention(*args, **kw, skip=skip)  # no `out`
    with pytest.raises(ValueError, match="skip: expected"):
        paged_window_attention(*args, **{**kw, "splits": 1}, tiled=True, out=out, skip=skip)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_paged_window_kernel_on_gemma_shapes(dtype):
    """Gemma-3-270M's sliding layers (4 query heads, 1 KV head, head size 256, window 512),
    vLLM's cache layout, 8K rows after a drop: the Triton kernels (per row, tiled, per row split 8 ways) against the
    reference."""
    from uniprefill.kernels.paged_window import paged_window_attention_torch, paged_window_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim, block, window, rows = 4, 1, 256, 16, 512, 8192
    packed = torch.randn(1200, kv_heads, block, 2 * dim, device="cuda", dtype=dtype, generator=gen)
    key_cache, value_cache = packed.transpose(1, 2).split(dim, dim=-1)
    table = torch.randperm(1199, device="cuda", generator=gen)[:1024].view(2, 512).int() + 1
    request = torch.randint(0, 2, (rows,), device="cuda", generator=gen)
    logical = torch.randint(0, 8000, (rows,), device="cuda", generator=gen)
    count = torch.minimum(torch.randint(1, window + 1, (rows,), device="cuda", generator=gen), logical + 1)
    query = torch.randn(rows, heads, dim, device="cuda", dtype=dtype, generator=gen)
    args = (query, key_cache, value_cache, table, request, logical, count)
    ref = paged_window_attention_torch(*args, window=window, scale=dim ** -0.5)
    for kernel in ({"tiled": False}, {"tiled": True}, {"splits": 8}):
        out = paged_window_attention_triton(*args, window=window, scale=dim ** -0.5, **kernel)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), (kernel, err)


def test_the_window_kernel_splits_rows_only_in_steps_of_few_programs():
    """Split-KV (the default; the A/B aid UNIPREFILL_DEBUG_UNSPLIT_WINDOW keeps one program) only where a step has
    fewer than 64 rows x KV heads:
    a power of two up to 8, one program per 64 entries of the window."""
    from uniprefill.vllm.window import split_count

    assert [split_count(1, w) for w in (24, 64, 128, 200, 256, 512, 4096)] == [1, 1, 2, 2, 4, 8, 8]
    assert split_count(63, 512) == 8 and split_count(64, 512) == 1


@pytest.mark.interpreter  # Triton on CPU tensors
def test_a_step_mixing_long_and_short_requests_runs_each_on_its_kernel(monkeypatch):
    """`kernel_plan`: requests of at least TILED_MIN_ROWS rows on the tiled kernel, decode rows and short prompts on
    the per-row one (a tile of decode rows of many requests would walk their windows one after another); all
    long: tiled, all short: per-row. `paged_window_step` then runs both kernels (Triton's interpreter here) and
    writes each row where it belongs: equal to the reference on every row."""
    from uniprefill.kernels.paged_window import kernel as window_kernels
    from uniprefill.vllm.drop_records import WindowLayer, WindowRows
    from uniprefill.vllm.window import TILED_MIN_ROWS, kernel_plan, paged_window_step

    def layout(lens):  # only what `kernel_plan` reads
        qsl = torch.tensor([0] + lens).cumsum(0)
        return types.SimpleNamespace(query_lens_cpu=torch.tensor(lens), query_start_loc_cpu=qsl, query_start_loc=qsl)

    assert kernel_plan(layout([1, 1, 3]))[0] == "per_row"
    assert kernel_plan(layout([TILED_MIN_ROWS, 40]))[0] == "tiled"
    lens = [1, 20, 1, 3, 17]  # decode, a long prompt, decode, a short prompt, a long prompt
    request = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    kernel, tiled_rows, per_row_rows = kernel_plan(layout(lens))
    assert kernel == "mixed" and set(request[tiled_rows].tolist()) == {1, 4}
    assert set(request[per_row_rows].tolist()) == {0, 2, 3} and tiled_rows.numel() + per_row_rows.numel() == 42
    torch.manual_seed(0)
    heads, kv_heads, dim, block, window = 4, 2, 8, 16, 24
    packed = torch.randn(48, kv_heads, block, 2 * dim)
    key_cache, value_cache = packed.transpose(1, 2).split(dim, dim=-1)
    table = torch.randperm(47)[:40].view(5, 8).int() + 1  # logical indices up to 116: 8 blocks a request
    logical = torch.cat([torch.tensor([90]), torch.arange(60, 80), torch.tensor([33]), torch.arange(5, 8),
                         torch.arange(100, 117)])
    count = torch.minimum(torch.full_like(logical, window), logical + 1)
    query = torch.randn(logical.numel(), heads * dim)
    rows = WindowRows(table, request, logical, count, kernel, tiled_rows, per_row_rows)
    cache = WindowLayer(key_cache, value_cache, dim ** -0.5)
    launches = []
    run = window_kernels.paged_window_attention_triton
    monkeypatch.setattr(window_kernels, "paged_window_attention_triton",
                        lambda *a, **kw: launches.append((kw["rows"].numel(), kw["tiled"])) or run(*a, **kw))
    out = torch.full_like(query, float("nan"))
    paged_window_step(query, out, rows, cache, window, "triton")
    assert launches == [(37, True), (5, False)]  # each on its rows of the whole query, in place
    ref = paged_window_attention(query.view(-1, heads, dim), key_cache, value_cache, table, request, logical, count,
                                 window=window, scale=dim ** -0.5, impl="torch")
    torch.testing.assert_close(out.view(-1, heads, dim), ref, atol=1e-5, rtol=1e-5)


def test_tiles_below_a_gpu_dot_are_refused_outside_the_interpreter(monkeypatch):
    """Triton's dot needs sides of at least 16 on a GPU: a smaller `block_n` or `tile_block_n` raises a clear error
    there instead of a compiler failure (the interpreter runs any size; the tests above use tiles of 4)."""
    from uniprefill.kernels.paged_window import kernel as window_kernel
    from uniprefill.kernels.paged_window import paged_window_attention_triton

    # the kernels' module is imported above, under the interpreter: Triton chooses between its interpreter and its
    # compiler when a kernel is decorated, so a first import below, with the switch off, would leave this test
    # process's window kernels compiled-only for every later test (a CI run's xdist worker failed three that way)
    from uniprefill.kernels._common import interpret_enabled

    assert (type(window_kernel.paged_window_kernel).__name__ == "InterpretedFunction") == interpret_enabled()
    step = _two_request_step(0, 6)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what a GPU run sees
    for kw in ({"block_n": 4}, {"tiled": True, "tile_block_n": 8}, {"tiled": True, "tile_rows": 8}):
        with pytest.raises(ValueError, match="at least 16 of each on a GPU"):
            paged_window_attention_triton(*step, window=24, scale=0.3, **kw)
    launched = []
    for name in ("paged_window_kernel", "paged_window_tiled_kernel"):  # launches recorded, not run
        monkeypatch.setattr(window_kernel, name, _Launch(name, launched))
    for kw in ({"tiled": True, "tile_block_n": 32, "block_n": 8}, {"tile_block_n": 8}):  # the knob the path ignores
        paged_window_attention_triton(*step, window=24, scale=0.3, **kw)
    assert launched == ["paged_window_tiled_kernel", "paged_window_kernel"]


class _Launch:
    """A stand-in for a Triton kernel: `kernel[grid](...)` records the kernel's name."""

    def __init__(self, name, launched):
        self.name, self.launched = name, launched

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(self.name)


def _tail_layout(ctx, kv_base, tables, block_sizes):
    """What `window.context_tail_positions` and `_tail_slots` read of a right-aligned layout."""
    return types.SimpleNamespace(num_computed_tokens_cpu=torch.tensor(ctx), kv_base_cpu=torch.tensor(kv_base),
                                 block_tables=tables, block_sizes=block_sizes)


def test_context_tail_positions_and_slots_per_group():
    """The copy's positions (built once per drop point and window) and each KV-cache group's slots equal the
    per-request loop they replace: requests without context copy nothing, the others their last min(W - 1, ctx)
    entries to just below their first kept entry; two groups with other block sizes and tables; window 1 copies
    nothing; a gap too short raises."""
    from uniprefill.vllm.window import _tail_slots, context_tail_positions

    gen = torch.Generator().manual_seed(0)
    tables = [torch.randperm(400, generator=gen)[:3 * 40].view(3, 40).to(torch.int32),
              torch.randperm(400, generator=gen)[:3 * 10].view(3, 10).to(torch.int32)]
    right = _tail_layout([0, 5, 40], [10, 30, 100], tables, [4, 16])
    rows, src, dst = context_tail_positions(right, [0, 1, 2], 8, "cpu")
    assert rows.tolist() == [1] * 5 + [2] * 7
    assert src.tolist() == list(range(0, 5)) + list(range(33, 40))
    assert dst.tolist() == list(range(25, 30)) + list(range(93, 100))
    for group, block in enumerate((4, 16)):
        src_blocks, src_offsets, dst_blocks, dst_offsets = _tail_slots(right, group, rows, src, dst)
        want = [(int(tables[group][r, p // block]), p % block) for r, p in zip(rows.tolist(), src.tolist())]
        assert list(zip(src_blocks.tolist(), src_offsets.tolist())) == want
        want = [(int(tables[group][r, p // block]), p % block) for r, p in zip(rows.tolist(), dst.tolist())]
        assert list(zip(dst_blocks.tolist(), dst_offsets.tolist())) == want
    assert context_tail_positions(right, [0, 1, 2], 1, "cpu") is None  # a window of 1 sees no context entry
    assert context_tail_positions(right, [0], 8, "cpu") is None  # no context
    with pytest.raises(RuntimeError, match="request 2: a gap of 5 entries cannot hold its context tail of 7"):
        context_tail_positions(_tail_layout([0, 5, 40], [10, 30, 45], tables, [4, 16]), [0, 1, 2], 8, "cpu")
