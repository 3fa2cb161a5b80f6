"""The row-layout kernels (`uniprefill.kernels.layout_rows`): Triton (the CPU interpreter here) equals the PyTorch
reference on random ragged layouts, and the reference equals a per-row loop of the definitions."""

from __future__ import annotations

import pytest
import torch

from uniprefill.kernels.layout_rows import decode_segment, decode_window, layout_rows, window_counts


def _random_layout(gen: torch.Generator):
    requests = int(torch.randint(1, 7, (1,), generator=gen))
    lens = torch.randint(0, 40, (requests,), generator=gen)
    lens[int(torch.randint(0, requests, (1,), generator=gen))] += 1  # at least one row
    qsl = torch.zeros(requests + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    kv_base = torch.randint(0, 50, (requests,), generator=gen)
    return lens, qsl, kv_base


def _per_row(qsl, kv_base, tables, block, kept, positions, source):
    """The definitions, one row at a time."""
    out = {"request": [], "logical": [], "positions": [], "source": [], "slots": [[] for _ in tables]}
    for r in range(qsl.numel() - 1):
        for t in range(int(qsl[r]), int(qsl[r + 1])):
            logical = int(kv_base[r]) + t - int(qsl[r])
            out["request"].append(r)
            out["logical"].append(logical)
            out["positions"].append(int(positions[int(kept[t])]))
            out["source"].append(int(source[int(kept[t])]))
            for g, table in enumerate(tables):
                out["slots"][g].append(int(table[r, logical // block]) * block + logical % block)
    return out


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.interpreter  # Triton on CPU tensors
def test_layout_rows_triton_equals_the_reference_and_the_definition(seed):
    """Up to 11 tables (more than one launch's 8), int32 tables with padding columns and extra rows, the three
    row modes (gathered through `kept`, vLLM's own batch, none)."""
    gen = torch.Generator().manual_seed(seed)
    lens, qsl, kv_base = _random_layout(gen)
    tokens, block = int(qsl[-1]), (1, 16, 64)[seed % 3]
    width = int((kv_base + lens).max()) // block + 2
    tables = [torch.randint(0, 1000, (qsl.numel() + 1, width + 3), generator=gen, dtype=torch.int32)[:, :width]
              for _ in range(int(torch.randint(0, 12, (1,), generator=gen)))]
    before = tokens + 30  # rows of the earlier layout
    kept = torch.sort(torch.randperm(before, generator=gen)[:tokens]).values
    positions = torch.sort(torch.randint(0, 10 ** 6, (before,), generator=gen)).values
    source = torch.randperm(before, generator=gen)
    brute = _per_row(qsl, kv_base, tables, block, kept, positions, source)
    for rows in ({"kept": kept, "positions": positions, "source": source}, {}, {"positions": positions}):
        ref = layout_rows(qsl, kv_base, tables, block, tokens, impl="torch", **rows)
        got = layout_rows(qsl, kv_base, tables, block, tokens, impl="triton", **rows)
        for name, a, b in zip(("positions", "source", "request", "logical"), ref[:4], got[:4]):
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), name
        assert len(ref[4]) == len(got[4]) == len(tables)
        assert all(torch.equal(a, b) for a, b in zip(ref[4], got[4]))
        assert ref[2].tolist() == brute["request"] and ref[3].tolist() == brute["logical"]
        assert [s.tolist() for s in ref[4]] == brute["slots"]
        if "kept" in rows:
            assert ref[0].tolist() == brute["positions"] and ref[1].tolist() == brute["source"]
        elif not rows:  # vLLM's own batch: a row's position is its logical index, its source itself
            assert ref[0].tolist() == brute["logical"] and ref[1].tolist() == list(range(tokens))
        else:
            assert ref[0] is None and ref[1] is None


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("window", [1, 7, 64])
@pytest.mark.interpreter  # Triton on CPU tensors
def test_window_counts_triton_equals_the_reference_and_the_rule(seed, window):
    """Dropping requests count their rows within the window plus the context entries within it; the others
    min(W, pos + 1)."""
    gen = torch.Generator().manual_seed(seed)
    lens, qsl, _ = _random_layout(gen)
    tokens = int(qsl[-1])
    context = torch.randint(0, 200, (lens.numel(),), generator=gen)
    positions = torch.cat([int(c) + torch.sort(torch.randperm(300, generator=gen)[:int(n)]).values
                           for c, n in zip(context, lens)])
    request = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    dropping = torch.rand(lens.numel(), generator=gen) < 0.6
    ref = window_counts(positions, request, qsl, context, dropping, window, max_query_len=int(lens.max()),
                        impl="torch")
    got = window_counts(positions, request, qsl, context, dropping, window, max_query_len=int(lens.max()),
                        impl="triton")
    assert torch.equal(ref, got)
    expected = []
    for t in range(tokens):
        r, p = int(request[t]), int(positions[t])
        if dropping[r]:
            mine = positions[int(qsl[r]):t + 1].tolist()
            keys = list(range(int(context[r]))) + mine
        else:
            keys = list(range(p + 1))
        expected.append(sum(1 for k in keys if 0 <= p - k < window))
    assert ref.tolist() == expected


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.interpreter  # Triton on CPU tensors
def test_the_decode_kernels_equal_their_references(seed):
    """The decode graphs' computations (`vllm.graph_decode`): a step of R requests, some padding rows (seq_lens 0,
    slot -1), int32 seq_lens / removed / block table as vLLM and `DecodeTables` hold them; window tables with
    absent entries, requests with and without a history, stale rows (a count the clamps must bound), with and
    without `removed` (the `vllm_rows` flags)."""
    gen = torch.Generator().manual_seed(seed)
    requests, block, window = int(torch.randint(1, 40, (1,), generator=gen)), (1, 16)[seed % 2], 24
    max_window = (32, 130)[seed % 2]  # 130: more than one pass of the kernel's 128 entries
    seq_lens = torch.randint(1, 400, (requests,), generator=gen, dtype=(torch.int32, torch.int64)[seed % 3 == 2])
    seq_lens[torch.rand(requests, generator=gen) < 0.2] = 0  # padding rows of a captured batch
    removed = torch.randint(0, 50, (requests + 5,), generator=gen, dtype=torch.int32)
    removed[:requests] = torch.minimum(removed[:requests], seq_lens)  # as the tables hold them; a stale one exceeds:
    removed[requests - 1] = int(seq_lens[requests - 1]) + 3
    removed[torch.rand(requests + 5, generator=gen) < 0.3] = 0
    table = torch.randint(0, 10 ** 5, (requests + 2, 400 // block + 3), generator=gen, dtype=torch.int32)
    slots = torch.where(seq_lens > 0, torch.randint(0, 10 ** 6, (requests,), generator=gen), -1).long()
    slots = torch.cat([slots, torch.full((3,), -1)])  # vLLM's slot mapping is padded past R
    ref = decode_segment(seq_lens, table, slots, removed, block, impl="torch")
    got = decode_segment(seq_lens, table, slots, removed, block, impl="triton")
    assert ref[0].dtype == got[0].dtype == seq_lens.dtype and torch.equal(ref[0], got[0])
    assert got[1].dtype == torch.int64 and torch.equal(ref[1], got[1])
    tail = torch.full((requests + 4, max_window), -(2 ** 40), dtype=torch.long)
    for r in range(requests):
        n = int(torch.randint(0, max_window + 1, (1,), generator=gen))
        top = int(seq_lens[r]) - int(torch.randint(0, 60, (1,), generator=gen))
        tail[r, :n] = torch.sort(top - torch.randperm(300, generator=gen)[:n]).values
    prompt_end = seq_lens.long() - torch.randint(-3, 30, (requests,), generator=gen)  # some stale (past pos)
    has = torch.rand(requests, generator=gen) < 0.6
    for flags in (None, removed):
        ref = decode_window(seq_lens, tail, prompt_end, has, window, flags, impl="torch")
        got = decode_window(seq_lens, tail, prompt_end, has, window, flags, impl="triton")
        for name, a, b in zip(("request", "logical", "count", "vllm_rows"), ref, got):
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), name
        count, logical = ref[2], ref[1]
        assert (count >= 1).all() and (count <= window).all() and (count <= logical + 1).all()


@pytest.mark.parametrize("tokens", [1, 4, 5, 33])
@pytest.mark.interpreter  # Triton on CPU tensors
def test_every_output_view_starts_on_16_bytes(tokens):
    """The window kernels read `row_request` / `row_logical` and the decode graphs' rows; a plain `triton.jit` kernel
    compiles a variant per pointer alignment, and the warm-up compiled the aligned one: an odd row count must not
    put a view off 16 bytes (it would compile inside a request's step, or inside a graph capture)."""
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    table = torch.zeros(1, 8, dtype=torch.int32)
    for rows in ({"kept": torch.arange(tokens), "positions": torch.arange(tokens), "source": torch.arange(tokens)},
                 {}, {"positions": torch.arange(tokens)}):
        for impl in ("torch", "triton"):
            out = layout_rows(qsl, qsl[:1], [table] * 3, 16, tokens, impl=impl, **rows)
            views = [t for t in (*out[:4], *out[4]) if t is not None]
            assert all(t.data_ptr() % 16 == 0 for t in views), (impl, rows.keys(), [t.data_ptr() % 16 for t in views])
    seq_lens = torch.full((tokens,), 9, dtype=torch.int32)
    tail = torch.zeros(tokens, 4, dtype=torch.long)
    for impl in ("torch", "triton"):
        request, logical, count, _ = decode_window(seq_lens, tail, tail[:, 0].contiguous(), seq_lens > 0, 4, impl=impl)
        assert all(t.data_ptr() % 16 == 0 for t in (request, logical, count)), impl


def test_bad_inputs_raise_with_what_was_expected():
    qsl, base = torch.tensor([0, 3, 5], dtype=torch.int32), torch.zeros(2, dtype=torch.long)
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_base: expected shape"):
        layout_rows(qsl, base[:1], [table], 16, 5)
    with pytest.raises(ValueError, match="unit column stride"):
        layout_rows(qsl, base, [table.t()], 16, 5)
    with pytest.raises(ValueError, match="kept: expected shape"):
        layout_rows(qsl, base, [table], 16, 5, kept=torch.arange(4), positions=torch.arange(9), source=torch.arange(9))
    with pytest.raises(ValueError, match="needs the earlier layout"):
        layout_rows(qsl, base, [table], 16, 5, kept=torch.arange(5))
    with pytest.raises(ValueError, match="kept: expected a contiguous"):  # read as pointer + i by the kernel
        layout_rows(qsl, base, [table], 16, 5, kept=torch.arange(10)[::2], positions=torch.arange(10),
                    source=torch.arange(10))
    with pytest.raises(ValueError, match="query_start_loc: expected a contiguous"):
        layout_rows(torch.tensor([0, 0, 3, 3, 5, 5], dtype=torch.int32)[::2], base, [table], 16, 5)
    with pytest.raises(ValueError, match="removed: expected a contiguous"):
        decode_segment(qsl[:2], table, torch.zeros(2, dtype=torch.long), torch.zeros(4, dtype=torch.int32)[::2], 16)
    with pytest.raises(ValueError, match="prompt_end: expected"):  # the kernel would read past it
        decode_window(torch.ones(8, dtype=torch.int32), torch.zeros(8, 4, dtype=torch.long),
                      torch.zeros(2, dtype=torch.long), torch.zeros(8, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="window=0"):
        window_counts(torch.arange(5), torch.zeros(5, dtype=torch.long), qsl, base, base.bool(), 0, max_query_len=3)
    with pytest.raises(ValueError, match="context: expected shape"):
        window_counts(torch.arange(5), torch.zeros(5, dtype=torch.long), qsl, base[:1], base.bool(), 4,
                      max_query_len=3)


@pytest.mark.interpreter  # Triton on CPU tensors
def test_warm_up_runs_the_kernels_only_where_triton_runs_them():
    from uniprefill.kernels.layout_rows import warm_up

    assert warm_up(torch.device("cpu"), "torch") == 0
    assert warm_up(torch.device("cpu"), "auto") == 0  # the reference runs on the CPU
    assert warm_up(torch.device("cpu"), "triton") == 7  # the interpreter here (tests/conftest.py)


@pytest.mark.interpreter  # Triton on CPU tensors
def test_the_warm_up_refuses_a_kernel_that_disagrees_with_its_reference(monkeypatch):
    """The warm-up (at the engine's first dummy forward) checks every kernel against its PyTorch reference on the
    device it will serve on: a kernel computing wrong layouts stops the engine's start with the reason, instead of
    serving wrong answers."""
    from uniprefill.kernels.layout_rows import kernel as triton_kernels
    from uniprefill.kernels.layout_rows import warm_up

    real = triton_kernels.decode_segment_triton
    monkeypatch.setattr(triton_kernels, "decode_segment_triton", lambda *a: (real(*a)[0], real(*a)[1] + 1))
    with pytest.raises(RuntimeError, match="decode_segment disagrees with its PyTorch reference"):
        warm_up(torch.device("cpu"), "triton")


def _compiled_variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no per-device kernel cache to count")
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.gpu
def test_gpu_kernels_equal_the_reference_and_compile_one_variant_each():
    """CUDA, vLLM's dtypes, a 32K-row step of four requests and Gemma-3-270M's six KV-cache groups: every kernel
    (the layouts' and the decode graphs') equals its reference; after `warm_up`, steps of other row counts, request
    counts, table counts, strides and row modes compile nothing more (a compile is ~1 s inside a request's step,
    and must not happen inside a graph capture)."""
    from uniprefill.kernels.layout_rows import kernel as triton_kernels
    from uniprefill.kernels.layout_rows import warm_up

    dev = torch.device("cuda")
    warm_up(dev)
    kernels = (triton_kernels.layout_rows_kernel, triton_kernels.window_counts_kernel,
               triton_kernels.decode_segment_kernel, triton_kernels.decode_window_kernel)
    before = [_compiled_variants(k) for k in kernels]
    gen = torch.Generator().manual_seed(0)
    for requests, tokens, groups in ((4, 32000, 6), (1, 17, 1), (3, 4097, 9), (2, 2, 0)):
        lens = torch.full((requests,), tokens // requests)
        lens[-1] += tokens - int(lens.sum())
        qsl = torch.zeros(requests + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(lens, 0)
        kv_base = torch.randint(0, 500, (requests,), generator=gen).int()
        width = int((kv_base + lens).max()) // 16 + 1
        tables = [torch.randint(0, 10 ** 5, (requests + 3, width + g), generator=gen, dtype=torch.int32)
                  for g in range(groups)]
        before_rows = tokens + 999
        kept = torch.sort(torch.randperm(before_rows, generator=gen)[:tokens]).values
        positions = torch.sort(torch.randint(0, 10 ** 6, (before_rows,), generator=gen)).values
        source = torch.randperm(before_rows, generator=gen)
        for rows in ({"kept": kept, "positions": positions, "source": source}, {}, {"positions": positions}):
            ref = layout_rows(qsl, kv_base, tables, 16, tokens, impl="torch", **rows)
            moved = {k: v.to(dev) for k, v in rows.items()}
            got = layout_rows(qsl.to(dev), kv_base.to(dev), [t.to(dev) for t in tables], 16, tokens, impl="triton",
                              **moved)
            for a, b in zip(ref[:4], got[:4]):
                assert (a is None and b is None) or torch.equal(a, b.cpu())
            assert all(torch.equal(a, b.cpu()) for a, b in zip(ref[4], got[4]))
        request = ref[2]
        pos = torch.arange(tokens) + torch.repeat_interleave(kv_base.long(), lens)
        context, dropping = kv_base.long(), torch.arange(requests) % 2 == 0
        for window in (512, 4096):
            a = window_counts(pos, request, qsl, context, dropping, window, max_query_len=int(lens.max()),
                              impl="torch")
            b = window_counts(pos.to(dev), request.to(dev), qsl.to(dev), context.to(dev),
                              dropping.long().to(dev), window, max_query_len=int(lens.max()), impl="triton")
            assert torch.equal(a, b.cpu())
        # a decode step of the same requests: vLLM's int32 seq_lens and tables, `DecodeTables`' int32 removed counts
        seq_lens = (kv_base + lens.int()).to(torch.int32)
        removed = torch.minimum(torch.randint(0, 300, (requests + 1,), generator=gen, dtype=torch.int32),
                                torch.cat([seq_lens, seq_lens[:1]]))
        slots = torch.randint(-1, 10 ** 6, (requests + 2,), generator=gen)
        tail = torch.randint(-(2 ** 40), 10 ** 4, (requests + 1, 512), generator=gen)
        ends, has = torch.randint(0, 10 ** 4, (requests + 1,), generator=gen), torch.rand(requests + 1) < 0.5
        for g in range(min(groups, 2)):
            a = decode_segment(seq_lens, tables[g], slots, removed, 16, impl="torch")
            b = decode_segment(*(t.to(dev) for t in (seq_lens, tables[g], slots, removed)), 16, impl="triton")
            assert all(torch.equal(x, y.cpu()) for x, y in zip(a, b))
        for flags in (None, removed):
            a = decode_window(seq_lens, tail, ends, has, 512, flags, impl="torch")
            b = decode_window(*(t.to(dev) for t in (seq_lens, tail, ends, has)), 512,
                              None if flags is None else flags.to(dev), impl="triton")
            assert all((x is None and y is None) or torch.equal(x, y.cpu()) for x, y in zip(a, b))
    after = [_compiled_variants(k) for k in kernels]
    assert after == before, (before, after)
