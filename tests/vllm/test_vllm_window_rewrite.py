"""vLLM's sliding-window layers after a drop on CPU, in the fake vLLM of `test_vllm_rewrite.py` (split from it): the
window over original positions read from the paged cache (eager and decode-graph paths, the Triton kernels in the
interpreter), the layer name the window op gets, the model's own window, and FlashAttention's cache layout."""

from __future__ import annotations

import types

import pytest
import torch

from fake_vllm_model import (BLOCK, DIM, VOCAB, WORLD, TinyBackbone, compile_with_drops, fake_context,
                             fake_window_layer, kept_per_request, step_context)
from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.graph import analyze_vllm_graph
from uniprefill.vllm.rewrite import rewrite_vllm_graph
from uniprefill.vllm.drop import VllmDropRuntime

ON_CPU = pytest.mark.interpreter  # a case that runs Triton on CPU tensors (tests/conftest.py)


@pytest.fixture(scope="module")
def model():
    return TinyBackbone().eval()


def free_blocks_behind_the_window(world, seq_lens: list[int], window: int, group: int = 0) -> int:
    """What vLLM's sliding-window manager does after a step: blocks whose every entry lies more
    than `window` entries behind the request's end may be freed and reused. Here they are
    overwritten with NaN in every layer of the group, so reading one poisons the result."""
    table, freed = world.tables[group], 0
    for r, seq_len in enumerate(seq_lens):
        for b in range(max(0, seq_len - window) // BLOCK):
            slots = int(table[r, b]) * BLOCK + torch.arange(BLOCK)
            for i, name in enumerate(world.names):
                if i % world.groups == group:
                    world.kv_caches[name][:, slots] = float("nan")
            freed += 1
    return freed


@pytest.mark.parametrize("decode_graphs, window, triton", [(False, 24, ""), (True, 24, ""), (True, 64, "")] + [
    pytest.param(*case, marks=ON_CPU)
    for case in ((False, 24, "tiled"), (False, 24, "per-row"), (True, 24, "split"), (True, 24, "unsplit"))],
                         ids=["eager-decode", "decode-graph-path", "decode-graph-path-w64", "triton-window-kernels",
                              "triton-per-row-aid", "triton-split-decode-graphs", "triton-unsplit-aid-decode-graphs"])
def test_sliding_layers_after_a_drop_window_over_original_positions(model, monkeypatch, decode_graphs, window, triton):
    """Layers 0 and 2 slide (window 24, one KV-cache group), the drop is at layer 1: layer 2
    runs `window_attention` over its right-aligned kept keys. Prefill, then vLLM frees the
    blocks behind each window, then two decode steps: every request's hidden state equals the
    reference whose sliding layers see the keys at original positions p - 24 < pos <= p. With
    `decode_graphs` the decode steps run as vLLM captures full decode graphs (vLLM's default
    FULL_AND_PIECEWISE): the window rows come from the device tables `before_step` refills (at window 64
    dropped prompt positions lie inside a decode token's window: fewer entries than the window). `triton`: the
    Triton kernels (CPU interpreter): the prefill step on the tiled one, decode steps on the per-row one; with
    the A/B aid `UNIPREFILL_DEBUG_PER_ROW_WINDOW` ("per-row") every step on the per-row one; with split-KV
    forced to 2 programs a row ("split": one of them sees no entry at window 24; the default splits only from
    window 128 on) the decode steps split each row, unless the A/B aid `UNIPREFILL_DEBUG_UNSPLIT_WINDOW` keeps one
    program a row ("unsplit")."""
    windows = {0: window, 2: window}
    config = UniPrefillConfig(keep_ratio=0.4, block_size=BLOCK, last_q=16, sink=16, min_tokens=64,
                              impl="triton" if triton else "auto")
    launches = []
    if triton:
        from uniprefill.kernels.paged_window import kernel as window_kernels

        run = window_kernels.paged_window_attention_triton
        if triton == "per-row":
            monkeypatch.setenv("UNIPREFILL_DEBUG_PER_ROW_WINDOW", "1")
        if triton in ("split", "unsplit"):
            from uniprefill.vllm import window as vllm_window

            monkeypatch.setattr(vllm_window, "split_count", lambda programs, window: 2)
        if triton == "unsplit":
            monkeypatch.setenv("UNIPREFILL_DEBUG_UNSPLIT_WINDOW", "1")
        monkeypatch.setattr(window_kernels, "paged_window_attention_triton",
                            lambda *a, **kw: launches.append((a[0].shape[0], kw["tiled"], kw["splits"]))
                            or run(*a, **kw))
    compiled, state = compile_with_drops(model, config, (1,), windows, graph_decode_max_reqs=4 if decode_graphs else 0)
    query_lens = [300, 40, 170]
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    world = WORLD.context = fake_context(query_lens)
    world.windows = {world.names[i]: w for i, w in windows.items()}
    with torch.no_grad():
        hidden = compiled(ids, torch.cat([torch.arange(q) for q in query_lens]))
    runtime, result = state["runtime"], state["result"]
    assert result.windowed == 1 and set(runtime.step.window_rows) == {world.names[2]}
    point = runtime.step.points[0]
    kept = [set((point.source_rows[(point.source_rows >= qsl[r]) & (point.source_rows < qsl[r + 1])] - qsl[r]).tolist())
            for r in range(3)]
    assert len(kept[0]) < 0.5 * 300 and len(kept[1]) == 40
    tokens = [ids[qsl[r]:qsl[r + 1]] for r in range(3)]
    with torch.no_grad():
        for r in range(3):
            ref = model.reference(tokens[r], {1: torch.tensor(sorted(kept[r]))}, windows)
            torch.testing.assert_close(hidden[qsl[r + 1] - 1], ref, atol=1e-5, rtol=1e-5)
    assert free_blocks_behind_the_window(world, query_lens, window) >= (20 if window == 24 else 10)
    for step in range(2):
        new = torch.randint(0, VOCAB, (3,))
        computed = [q + step for q in query_lens]
        WORLD.context = step_context(world, computed, [1, 1, 1])
        if decode_graphs:
            world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
            runtime.before_step(tuple(world.request_ids))
        with torch.no_grad():
            out = compiled(new, torch.tensor(computed))
        for r in range(3):
            tokens[r] = torch.cat([tokens[r], new[r:r + 1]])
            keep = torch.tensor(sorted(kept[r] | set(range(query_lens[r], tokens[r].numel()))))
            with torch.no_grad():
                ref = model.reference(tokens[r], {1: keep}, windows)
            torch.testing.assert_close(out[r], ref, atol=1e-5, rtol=1e-5)
        free_blocks_behind_the_window(world, [c + 1 for c in computed], window)
        if window == 64:
            assert int(runtime.step.window_rows[world.names[2]].count[0]) < window
    assert runtime.totals.decode_graph_captures == (2 if decode_graphs else 0)
    if triton:  # the prefill step on the tiled kernel, the decode steps (a row per request) on the per-row one
        assert [t for _, t, _ in launches] == [triton in ("tiled", "split", "unsplit"), False, False] and launches[0][0] > 3
        assert [s for _, _, s in launches] == ([1, 2, 2] if triton == "split" else [1, 1, 1])
    torch._dynamo.reset()


def test_the_window_op_gets_the_layer_name_as_a_string_where_vllm_hoists_it(model):
    """vLLM 0.26 on torch >= 2.11 hands each layer name as a placeholder holding an opaque `LayerName`; the window
    op's schema takes a string. Passing the placeholder on stopped Gemma-3-270M's first engine on the H200 (Inductor:
    "Expected a value of type 'str' for argument 'layer_name' but instead found type 'FakeScriptObject'")."""
    captured = {}

    def capture(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    WORLD.context = fake_context([40])
    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=True, fullgraph=True)(torch.zeros(40, dtype=torch.long),
                                                                          torch.arange(40))
    gm = captured["gm"]
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.args[4:5] and isinstance(n.args[4], str)]:
        with gm.graph.inserting_before(first):
            hoisted = gm.graph.placeholder(f"synthetic_{node.name}")
        hoisted.meta["example_value"] = types.SimpleNamespace(real_obj=LayerName(node.args[4]))
        node.update_arg(4, hoisted)
    info = analyze_vllm_graph(gm)
    names = [site.layer_name for site in info.sites]
    runtime = VllmDropRuntime(UniPrefillConfig(keep_ratio=0.4, block_size=BLOCK, last_q=16, sink=16), names, (1,),
                              context_fn=lambda: WORLD.context, block_size_fn=lambda name: BLOCK,
                              windows={names[2]: 24}, window_layer_fn=fake_window_layer)
    assert rewrite_vllm_graph(gm, info, (1,), ["full", "full", "sliding"], runtime).windowed == 1
    window_ops = [n for n in gm.graph.nodes if n.target is torch.ops.uniprefill.vllm_window_attention.default]
    assert [n.args[4] for n in window_ops] == [names[2]]


class LayerName:
    """vLLM's opaque layer-name type, as Dynamo records it (`.value`)."""

    def __init__(self, value: str) -> None:
        self.value = value


def test_a_window_over_cache_entries_would_differ(model):
    """The check above has teeth: FlashAttention's window over cache entries (the released
    code's rule) gives a different prefill result than the window over original positions."""
    window, keep = 24, torch.tensor(sorted(set(range(0, 299, 4)) | {299}))
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        positions_rule = model.reference(ids, {1: keep}, {0: window, 2: window})
        # a window of 24 ENTRIES after the drop reaches back 96 positions at this retention
        entries_rule = model.reference(ids, {1: keep}, {0: window, 2: 4 * window})
    assert not torch.allclose(positions_rule, entries_rule, atol=1e-3)


def test_backend_drops_before_sliding_layers_with_the_models_window(model, monkeypatch):
    """VllmTokenDropBackend with a sliding/full model config: the sliding layer after the drop
    gets the config's window and the hooks' cache access; without a window it is refused."""
    from uniprefill.vllm import runner_hook as hook
    from uniprefill.vllm.plugin import VllmHooks, VllmTokenDropBackend

    window, kinds = 24, ["sliding", "full", "sliding", "full"]
    config = UniPrefillConfig(keep_ratio=0.4, block_size=BLOCK, last_q=16, sink=16, min_tokens=64, drop_layers=(1,),
                              vllm_drop=True)
    query_lens = [200, 120]
    ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(7))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    hooks = VllmHooks(lambda: WORLD.context, lambda: WORLD.context.request_ids, lambda: None,
                      hook.FinishedListeners(), fake_window_layer)
    refused = VllmTokenDropBackend(config, layer_kinds=kinds, block_size=BLOCK, hooks=hooks)  # no window
    WORLD.context = fake_context(query_lens)
    with torch.no_grad(), pytest.warns(UserWarning, match="unaccelerated"):
        torch.compile(model, backend=refused, dynamic=True, fullgraph=True)(ids, positions)
    torch._dynamo.reset()
    assert "no sliding_window" in refused.graphs[0].reason
    backend = VllmTokenDropBackend(config, layer_kinds=kinds, block_size=BLOCK, hooks=hooks, sliding_window=window)
    world = WORLD.context = fake_context(query_lens)
    world.windows = {world.names[0]: window, world.names[2]: window}
    with torch.no_grad():
        hidden = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)(ids, positions)
    torch._dynamo.reset()
    runtime = backend.runtimes[0]
    assert backend.graphs[0].rewritten and runtime.windows == {world.names[2]: window}
    point, qsl = runtime.step.points[0], [0, query_lens[0], sum(query_lens)]
    for r in range(2):
        rows = point.source_rows[(point.source_rows >= qsl[r]) & (point.source_rows < qsl[r + 1])] - qsl[r]
        assert rows.numel() < query_lens[r]
        with torch.no_grad():
            ref = model.reference(ids[qsl[r]:qsl[r + 1]], {1: rows}, {0: window, 2: window})
        torch.testing.assert_close(hidden[qsl[r + 1] - 1], ref, atol=1e-5, rtol=1e-5)


def test_vllm_window_layer_reads_flash_attentions_cache_layout(monkeypatch):
    """The vLLM side of the window path, against a fake `vllm.forward_context`: K and V are the
    halves of the (blocks, kv heads, block size, 2 x head size) cache; the window is read from
    the layer's (left, 0) pair; a quantised cache or a bidirectional window is refused."""
    import sys

    from uniprefill.vllm.plugin import vllm_window_layer

    kv = torch.randn(5, 2, BLOCK, 2 * DIM)
    impl = types.SimpleNamespace(head_size=DIM, scale=0.25, sliding_window=(511, 0), logits_soft_cap=0.0,
                                 kv_cache_dtype="auto")
    layers = {"model.layers.2.self_attn.attn": types.SimpleNamespace(impl=impl, kv_cache=kv)}
    fake = types.ModuleType("vllm.forward_context")
    fake.get_forward_context = lambda: types.SimpleNamespace(no_compile_layers=layers)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.forward_context", fake)
    got = vllm_window_layer("model.layers.2.self_attn.attn")
    assert got.window == 512 and got.scale == 0.25 and got.softcap is None
    assert got.key_cache.shape == (5, BLOCK, 2, DIM)
    torch.testing.assert_close(got.key_cache[3, 7, 1], kv[3, 1, 7, :DIM])
    torch.testing.assert_close(got.value_cache[3, 7, 1], kv[3, 1, 7, DIM:])
    impl.sliding_window = (511, 511)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        vllm_window_layer("model.layers.2.self_attn.attn")
    impl.sliding_window, impl.kv_cache_dtype = (511, 0), "fp8"
    with pytest.raises(NotImplementedError, match="quantised"):
        vllm_window_layer("model.layers.2.self_attn.attn")


@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager-decode", "decode-graph-path"])
def test_at_p1_the_sliding_layers_after_a_drop_give_vllms_own_bits(model, monkeypatch, decode_graphs):
    """At p = 1 nothing is removed, so the sliding layers after the drop point run vLLM's own attention on vLLM's
    own metadata (`StepDrops.vllm_windows`; in the decode graphs of an engine at p = 1, rows of requests that removed
    nothing take vLLM's result, `WindowRows.vllm_rows`, whatever the window kernel wrote: here NaN, since on CPU its numbers may
    equal vLLM's): prefill and two decode steps equal the plain model's bit for bit. With the window kernel in
    their place, Gemma-3-270M at p = 1 parted from standard vLLM on 19 of 120 prompts on the H200 (2026-12-04),
    some at their first token."""
    from uniprefill.vllm import window as vllm_window

    def nan_window(query, output, rows, *args, skip=None):  # what the kernel may write: NaN, skipped rows untouched
        mine = output[:rows.request.numel()]
        keep = torch.zeros(mine.shape[0], dtype=torch.bool) if skip is None else skip
        mine.copy_(torch.where(keep.view(-1, *[1] * (mine.dim() - 1)), mine, float("nan")))

    monkeypatch.setattr(vllm_window, "paged_window_step", nan_window)
    windows = {0: 24, 2: 24}
    config = UniPrefillConfig(p=1.0, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, (1,), windows, graph_decode_max_reqs=4 if decode_graphs else 0)
    query_lens = [300, 40, 170]
    torch.manual_seed(7)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    worlds = []
    for run in (compiled, model):  # uniprefill at p = 1, then the plain model, each in a fresh fake vLLM
        world = WORLD.context = fake_context(query_lens)
        world.windows = {world.names[i]: w for i, w in windows.items()}
        with torch.no_grad():
            worlds.append((world, run, run(ids, positions)))
    (ours, _, got), (plain, _, want) = worlds
    runtime = state["runtime"]
    assert torch.equal(got, want)
    assert runtime.totals.requests_dropped == 2 and runtime.totals.rows_in == runtime.totals.rows_kept
    assert runtime.totals.requests_removing_rows == 0  # through the drop points, nothing removed
    assert runtime.step.vllm_windows == {ours.names[2]} and not runtime.step.window_rows
    for decoded in range(2):
        new = torch.randint(0, VOCAB, (3,))
        computed = [q + decoded for q in query_lens]
        outs = []
        for world, run, _ in worlds:
            WORLD.context = step_context(world, computed, [1, 1, 1])
            if decode_graphs and run is compiled:
                world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
                runtime.before_step(tuple(world.request_ids))
            with torch.no_grad():
                outs.append(run(new, torch.tensor(computed)))
        assert torch.equal(outs[0], outs[1]), f"decode step {decoded}"
        if decode_graphs:
            assert bool(runtime.step.window_rows[ours.names[2]].vllm_rows.all())
    assert runtime.totals.decode_graph_captures == (2 if decode_graphs else 0)
    torch._dynamo.reset()


def prefill_with_windows(model, config, drops, windows, query_lens, decode_graphs, request_p=None):
    """(compiled, runtime, world, ids, hidden) after a prefill of random prompts of `query_lens` in a fresh fake
    vLLM whose layers `windows` slide; `request_p`: the requests' own p (NaN: the config's)."""
    compiled, state = compile_with_drops(model, config, drops, windows, graph_decode_max_reqs=4 if decode_graphs else 0)
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    world = WORLD.context = fake_context(query_lens)
    world.windows = {world.names[i]: w for i, w in windows.items()}
    if request_p is not None:
        world.request_p = torch.tensor(request_p)
    with torch.no_grad():
        hidden = compiled(ids, torch.cat([torch.arange(q) for q in query_lens]))
    return compiled, state["runtime"], world, ids, hidden


def decode_two_steps_against_the_reference(model, compiled, runtime, world, ids, query_lens, kept, drops, windows,
                                           decode_graphs):
    """Two decode steps after the prefill in `world`: every request's hidden state equals the reference's with
    the rows `kept` [point][request] kept (`TinyBackbone.decode_reference`)."""
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    tokens = [ids[qsl[r]:qsl[r + 1]] for r in range(len(query_lens))]
    for decoded in range(2):
        new = torch.randint(0, VOCAB, (len(query_lens),))
        computed = [q + decoded for q in query_lens]
        WORLD.context = step_context(world, computed, [1] * len(query_lens))
        world.request_p = None
        if decode_graphs:
            world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
            runtime.before_step(tuple(world.request_ids))
        with torch.no_grad():
            out = compiled(new, torch.tensor(computed))
        for r in range(len(query_lens)):
            tokens[r] = torch.cat([tokens[r], new[r:r + 1]])
            with torch.no_grad():
                ref = model.decode_reference(tokens[r], query_lens[r], [k[r] for k in kept], drops, windows)
            torch.testing.assert_close(out[r], ref, atol=1e-5, rtol=1e-5, msg=f"request {r}, decode step {decoded}")


@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager-decode", "decode-graph-path"])
def test_a_first_drop_point_that_removes_nothing_then_a_second_that_drops(model, decode_graphs):
    """Drop points 0 and 2, keeping everything at the first (keep_ratio 1.0) and 0.4 at the second; layers 1 and 3
    slide (window 100, wide enough that a wrong layout shows): layer 1 runs vLLM's own attention, layer 3 the
    window over original positions; prefill and decode equal the reference."""
    windows, drops, query_lens = {1: 100, 3: 100}, (0, 2), [300, 40, 170]
    config = UniPrefillConfig(keep_ratio=(1.0, 0.4), block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, runtime, world, ids, hidden = prefill_with_windows(model, config, drops, windows, query_lens,
                                                                 decode_graphs)
    assert runtime.step.vllm_windows == {world.names[1]} and set(runtime.step.window_rows) == {world.names[3]}
    kept = [kept_per_request(p, query_lens) for p in runtime.step.points]
    assert [len(k) for k in kept[0]] == query_lens and len(kept[1][0]) < 0.5 * 300
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    with torch.no_grad():
        for r in range(3):
            ref = model.decode_reference(ids[qsl[r]:qsl[r + 1]], query_lens[r], [kept[0][r], kept[1][r]], drops, windows)
            torch.testing.assert_close(hidden[qsl[r + 1] - 1], ref, atol=1e-5, rtol=1e-5)
    decode_two_steps_against_the_reference(model, compiled, runtime, world, ids, query_lens, kept, drops, windows,
                                           decode_graphs)
    torch._dynamo.reset()


@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager-decode", "decode-graph-path"])
def test_an_engine_at_p1_with_a_request_at_its_own_p(model, decode_graphs):
    """An engine at p = 1 drops for a request that brings its own p (0.5): in its decode steps that request's rows
    take the window over original positions, the others' vLLM's attention (under decode graphs row by row,
    `WindowRows.vllm_rows`); all equal the reference (window 100)."""
    windows, drops, query_lens = {0: 100, 2: 100}, (1,), [300, 200, 170]
    config = UniPrefillConfig(p=1.0, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, runtime, world, ids, _ = prefill_with_windows(model, config, drops, windows, query_lens, decode_graphs,
                                                            request_p=[0.5, float("nan"), float("nan")])
    kept = [kept_per_request(p, query_lens) for p in runtime.step.points]
    assert len(kept[0][0]) < 300 and [len(k) for k in kept[0][1:]] == query_lens[1:]
    decode_two_steps_against_the_reference(model, compiled, runtime, world, ids, query_lens, kept, drops, windows,
                                           decode_graphs)
    if decode_graphs:
        assert runtime.step.window_rows[world.names[2]].vllm_rows.tolist() == [False, True, True]
    torch._dynamo.reset()
