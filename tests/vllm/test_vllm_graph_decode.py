"""Decode under vLLM's CUDA graphs after drops (`vllm.graph_decode`), on CPU.

No graph is captured here (no CUDA): what is tested is that the metadata the capture path
computes on the device, from vLLM's persistent inputs and the removed-KV table refilled before
each step, equals what the eager host path computes for the same decode step (`compact` with the
drop histories), for requests with and without a history, at two drop points; that padding rows
keep vLLM's -1 slot; and the configuration switches around it.
"""

from __future__ import annotations

import types

import pytest
import torch

from fake_vllm import make_world, step
from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.drop import VllmDropRuntime
from uniprefill.vllm.graph_decode import DecodeTables, segment_metadata

BLOCK, HEADS, HEAD = 16, 2, 16
QUERY_LENS = [400, 30, 260]  # the middle request is too short to drop: it has no history


def dropped_world(drop_layers=(1, 3), layers=6, max_reqs=8, windows=None, prefill=True):
    """A prefill step in which requests 0 and 2 drop (eager host path), and the runtime; `windows`:
    sliding layers (index -> window) after the drops. prefill=False: the runtime before any forward."""
    world = make_world(QUERY_LENS, layers=layers, groups=2, block=BLOCK, kv_heads=HEADS, head_size=HEAD, room=48)
    config = UniPrefillConfig(keep_ratio=0.5, drop_layers=drop_layers, min_tokens=64, sink=16, last_q=16,
                              block_size=BLOCK, impl="torch")
    sliding = {world.names[i]: w for i, w in (windows or {}).items()}
    runtime = VllmDropRuntime(config, world.names, drop_layers, lambda: world, lambda name: BLOCK,
                              request_ids_fn=lambda: world.request_ids, graph_decode_max_reqs=max_reqs,
                              windows=sliding, window_layer_fn=(lambda name: None) if sliding else None)
    if not prefill:
        return world, runtime
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(sum(QUERY_LENS), HEADS, HEAD, generator=gen) for _ in range(2))
    runtime.begin_step()
    kept = torch.arange(q.shape[0])
    for layer in drop_layers:
        kept_here = runtime.drop(q[kept], k[kept], layer)
        kept = kept[kept_here]
    assert runtime.totals.requests_dropped == 2
    return world, runtime


def decode_metadata(world, runtime, capture: bool, decoded: int = 3, forwards: int = 1):
    """Run the drop points of decode step `decoded` (after the prompt) eagerly or as a capture,
    `forwards` times over the same metadata dicts (vLLM's warm-up, then capture); return every
    layer's (seq_lens, slot_mapping) as installed."""
    step(world, [q + decoded for q in QUERY_LENS], [1] * len(QUERY_LENS))
    world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL" if capture else "NONE")
    if capture:
        runtime.before_step(tuple(world.request_ids))  # the runner hook, before the replay
    gen = torch.Generator().manual_seed(decoded)
    q, k = (torch.randn(len(QUERY_LENS), HEADS, HEAD, generator=gen) for _ in range(2))
    for _ in range(forwards):
        runtime.begin_step()
        for layer in runtime.drop_layers:
            assert torch.equal(runtime.drop(q, k, layer), torch.arange(len(QUERY_LENS)))
    return {name: (world.attn_metadata[name].seq_lens.long(), world.slot_mapping[name].long()) for name in world.names}


@pytest.mark.parametrize("drop_layers", [(1,), (1, 3)])
def test_capture_path_computes_the_host_paths_decode_metadata(drop_layers):
    world, runtime = dropped_world(drop_layers)
    assert runtime.graph_decode.table is not None  # allocated by the eager prefill, before any capture
    for decoded in (1, 5):
        eager = decode_metadata(world, runtime, capture=False, decoded=decoded)
        graph = decode_metadata(world, runtime, capture=True, decoded=decoded, forwards=2)  # warm-up + capture
        for name in world.names:
            torch.testing.assert_close(graph[name], eager[name], rtol=0, atol=0, msg=name)
    # the layers after the last drop point see fewer entries for the dropping requests only
    last_seq, _ = eager[world.names[-1]]
    vllm_seq = torch.tensor([q + 5 + 1 for q in QUERY_LENS])
    assert last_seq[1] == vllm_seq[1] and (last_seq[[0, 2]] < vllm_seq[[0, 2]]).all()
    first_seq, _ = eager[world.names[0]]
    assert torch.equal(first_seq, vllm_seq)  # before the drop: vLLM's own


def test_a_capture_before_any_eager_forward_is_refused():
    """The removed-KV table is allocated by an eager forward (vLLM's profiling run comes first); a capture that
    came first would bake a table address into the graph that nothing refills: refused, not replayed wrong."""
    world, runtime = dropped_world((1,), prefill=False)
    assert runtime.graph_decode.table is None
    with pytest.raises(RuntimeError, match="before any eager forward allocated the removed-KV table"):
        decode_metadata(world, runtime, capture=True)


def test_removed_table_follows_the_steps_requests_in_batch_order():
    world, runtime = dropped_world((1,))
    table = runtime.graph_decode.on(torch.device("cpu"))
    ids = tuple(world.request_ids)
    runtime.before_step(ids)
    removed = [runtime.store.kv_removed(runtime.store.rows_for([r]), 1).item() for r in ids]
    assert removed[1] == 0 and removed[0] > 0 and removed[2] > 0
    assert table[0, :3].tolist() == removed and table[0, 3:].tolist() == [0] * 5
    runtime.before_step((ids[2], ids[0]))  # another order, fewer requests: rows follow, the rest zeroed
    assert table[0, :3].tolist() == [removed[2], removed[0], 0]
    runtime.free(ids[0])
    runtime.before_step((ids[2], ids[0]))  # a freed history counts as none (the store's version changed)
    assert table[0, :2].tolist() == [removed[2], 0]
    with pytest.raises(RuntimeError, match="more than max_num_reqs=8"):
        runtime.before_step(tuple(f"r{i}" for i in range(9)))


def test_removed_table_is_refilled_only_before_a_full_graph_replay():
    """A step that replays no FULL graph (a prefill: eager or piecewise) leaves the tables as they are (its drop
    points read the histories on the host); the next replay finds them stale and refills them."""
    world, runtime = dropped_world((1,))
    table = runtime.graph_decode.on(torch.device("cpu"))
    ids = tuple(world.request_ids)
    runtime.before_step(ids, full_graph=False)
    assert table.abs().sum().item() == 0
    runtime.before_step(ids, full_graph=True)
    filled = table.clone()
    assert filled[0, :3].tolist() == [runtime.store.kv_removed(runtime.store.rows_for([r]), 1).item() for r in ids]
    runtime.before_step((ids[2],), full_graph=False)  # another batch, no replay: still the last replay's tables
    assert torch.equal(table, filled)
    runtime.before_step((ids[2],))
    assert table[0, 0].item() == filled[0, 2].item() and table[0, 1:].abs().sum().item() == 0


def test_segment_metadata_keeps_padding_rows_at_minus_one():
    table = torch.tensor([[3, 7], [5, 9], [0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 5, 0], dtype=torch.int32)  # the third row pads the captured batch
    slots = torch.tensor([7 * 16 + 3, 5 * 16 + 4, -1])
    lens, new = segment_metadata(seq_lens, table, slots, torch.tensor([6, 0, 0], dtype=torch.int32), 16)
    assert lens.tolist() == [14, 5, 0] and lens.dtype == seq_lens.dtype
    assert new.tolist() == [3 * 16 + 13, 5 * 16 + 4, -1]  # logical 13 in block 0; vLLM's own slot; padding


def test_graph_decode_needs_full_attention_after_the_drops_and_a_table_size():
    world = make_world([100], layers=4, groups=1, block=BLOCK, kv_heads=HEADS, head_size=HEAD)
    runtime = VllmDropRuntime(UniPrefillConfig(drop_layers=(1,)), world.names, (1,), lambda: world, lambda n: BLOCK,
                              graph_decode_max_reqs=4)
    world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
    q = torch.zeros(1, HEADS, HEAD)
    step(world, [100], [1])
    with pytest.raises(RuntimeError, match="before any eager forward allocated"):
        runtime.drop(q, q, 1)  # a capture before any eager forward: the table's zero-fill would be captured
    world.cudagraph_runtime_mode = types.SimpleNamespace(name="NONE")
    runtime.begin_step()
    runtime.drop(q, q, 1)  # an eager forward (vLLM's profiling run) allocates it
    assert runtime.graph_decode.table is not None
    windowed = VllmDropRuntime(UniPrefillConfig(drop_layers=(1,)), world.names, (1,), lambda: world, lambda n: BLOCK,
                               windows={world.names[2]: 32}, window_layer_fn=lambda n: None, graph_decode_max_reqs=4)
    windowed.graph_decode.on(q.device)  # sliding layers after the drop: the window tables come with the table
    assert windowed.graph_decode.tail.shape == (1, 4, 32) and windowed.graph_decode.has.shape == (4,)
    with pytest.raises(ValueError, match="max_num_reqs=0"):
        DecodeTables(1, 0)


def test_config_check_accepts_decode_graphs_only_behind_their_switch(monkeypatch):
    from uniprefill.vllm.plugin import check_vllm_config

    ns = types.SimpleNamespace
    cfg = ns(compilation_config=ns(mode=2, backend="uniprefill.vllm.plugin.vllm_backend",
                                   inductor_compile_config={"uniprefill": {}}, cudagraph_mode=ns(name="FULL_DECODE_ONLY")),
             parallel_config=ns(tensor_parallel_size=1, pipeline_parallel_size=1), cache_config=ns(enable_prefix_caching=False),
             scheduler_config=ns(enable_chunked_prefill=False, max_num_seqs=8), speculative_config=None)
    (error,) = check_vllm_config(cfg, drop_enabled=True).errors
    assert 'FULL_DECODE_ONLY with the option "vllm_decode_graphs": true' in error
    cfg.compilation_config.inductor_compile_config = {"uniprefill": {"vllm_decode_graphs": True}}
    check = check_vllm_config(cfg, drop_enabled=True)
    assert check.errors == [] and any("decode under full CUDA graphs" in n for n in check.notes)
    cfg.compilation_config.cudagraph_mode = ns(name="FULL_AND_PIECEWISE")  # prefill graphs: still refused
    assert len(check_vllm_config(cfg, drop_enabled=True).errors) == 1


@pytest.mark.parametrize("drops", [(1,), (1, 2)], ids=["one-drop", "two-drops"])
def test_decode_steps_through_the_capture_path_match_the_reference(drops):
    """The fake vLLM model rewritten with graph decoding on: prefill (two prompts drop, one is too
    short), then decode steps run as vLLM's capture runs them (forward context in FULL mode, the
    removed-KV table refilled by `before_step` first): attention reads, and the new KV lands in,
    the capture path's metadata, and each new token's hidden state equals the reference in which
    every layer after a drop attends over the prompt tokens it kept plus the decoded ones."""
    from fake_vllm_model import VOCAB, WORLD, TinyBackbone, compile_with_drops, fake_context, kept_per_request

    model = TinyBackbone().eval()
    config = UniPrefillConfig(keep_ratio=0.5, block_size=16, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, drops, graph_decode_max_reqs=4)
    query_lens = [300, 40, 170]
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    world = WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        compiled(ids, torch.cat([torch.arange(q) for q in query_lens]))
    runtime = state["runtime"]
    kept_sets = [kept_per_request(p, query_lens) for p in runtime.step.points]
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    tokens = [ids[qsl[r]:qsl[r + 1]] for r in range(len(query_lens))]
    assert runtime.graph_decode.table is not None  # the eager prefill allocated it
    calls = []
    capture_point = runtime._graph_decode_point
    runtime._graph_decode_point = lambda *args: (calls.append(args[2]), capture_point(*args))[1]
    for decoded in range(2):
        new = torch.randint(0, VOCAB, (len(query_lens),))
        computed = [q + decoded for q in query_lens]
        WORLD.context = step(world, computed, [1] * len(query_lens))
        world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
        runtime.before_step(tuple(world.request_ids))
        with torch.no_grad():
            hidden = compiled(new, torch.tensor(computed))
        for r in range(len(query_lens)):
            tokens[r] = torch.cat([tokens[r], new[r:r + 1]])
            with torch.no_grad():
                ref = model.decode_reference(tokens[r], query_lens[r], [sets[r] for sets in kept_sets], drops)
            torch.testing.assert_close(hidden[r], ref, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    assert calls == list(drops) * 2  # every drop point of both steps took the capture path
    assert runtime.totals.decode_graph_captures == 2 and runtime.totals.forwards == 1  # the prefill only


def test_a_decode_capture_returns_a_view_of_the_runtimes_row_numbers_and_clears_vllms_plan():
    """The kept rows a decode capture returns are a view of the runtime's persistent row numbers, made by the eager
    prefill (no kernel in the graph); the later layers' metadata drops vLLM's FA3 plan (made for vLLM's lengths), so
    FA3 plans the shorter lengths inside each call."""
    from fake_vllm_model import VOCAB, WORLD, TinyBackbone, compile_with_drops, fake_context

    drops = (1, 2)
    model = TinyBackbone().eval()
    config = UniPrefillConfig(keep_ratio=0.5, block_size=16, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, drops, graph_decode_max_reqs=4)
    query_lens = [300, 40, 170]
    torch.manual_seed(2)
    world = WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        compiled(torch.randint(0, VOCAB, (sum(query_lens),)), torch.cat([torch.arange(q) for q in query_lens]))
    runtime = state["runtime"]
    assert runtime._static_rows is not None  # made outside any capture
    returned = []
    capture_point = runtime._graph_decode_point
    runtime._graph_decode_point = lambda *args: returned.append(capture_point(*args)) or returned[-1]
    WORLD.context = step(world, list(query_lens), [1] * len(query_lens))
    for meta in {id(m): m for m in world.attn_metadata.values()}.values():
        meta.scheduler_metadata = torch.zeros(4)  # vLLM's plan, for its own lengths
    world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
    runtime.before_step(tuple(world.request_ids))
    with torch.no_grad():
        compiled(torch.randint(0, VOCAB, (len(query_lens),)), torch.tensor(query_lens))
    torch._dynamo.reset()
    assert len(returned) == 2 and all(rows.data_ptr() == runtime._static_rows.data_ptr() for rows in returned)
    assert all(torch.equal(rows, torch.arange(len(query_lens))) for rows in returned)
    assert [world.attn_metadata[name].scheduler_metadata for name in world.names[drops[0] + 1:]] == [None, None]
    assert world.attn_metadata[world.names[0]].scheduler_metadata is not None  # before the drops: vLLM's own


def test_a_capture_is_recognised_by_the_capturing_stream_when_the_context_says_none(monkeypatch):
    """vLLM 0.26's runner V2 captures FULL graphs with `cudagraph_runtime_mode=NONE` in the
    forward context: the capturing CUDA stream alone must send the drop point down the capture
    path (otherwise the graph would replay without the drop histories)."""
    from uniprefill.vllm import drop as vllm_drop

    context = types.SimpleNamespace(cudagraph_runtime_mode=types.SimpleNamespace(name="NONE"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert vllm_drop._capturing_full_graph(context)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not vllm_drop._capturing_full_graph(context)
    assert vllm_drop._capturing_full_graph(types.SimpleNamespace(cudagraph_runtime_mode=types.SimpleNamespace(name="FULL")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CPU: no stream to ask
    assert not vllm_drop._capturing_full_graph(types.SimpleNamespace())



def test_backend_sizes_the_table_from_max_num_seqs_and_takes_sliding_layers_after_a_drop(monkeypatch):
    """From vLLM's config: graph decoding only when dropping and asked for (FULL_DECODE_ONLY with the
    switch), sized by `max_num_seqs` (missing: an error, never graphs that ignore the histories);
    a model with sliding layers after the drop is no longer refused for the graphs (`window_rows`)."""
    from uniprefill.vllm.plugin import VllmTokenDropBackend

    ns = types.SimpleNamespace

    def config(max_num_seqs, decode_graphs=True):
        settings = {"drop_layers": [1], "vllm_drop": True, "vllm_decode_graphs": decode_graphs}
        return ns(compilation_config=ns(mode=2, backend="uniprefill.vllm.plugin.vllm_backend",
                                        inductor_compile_config={"uniprefill": settings},
                                        cudagraph_mode=ns(name="FULL_DECODE_ONLY")),
                  parallel_config=ns(tensor_parallel_size=1, pipeline_parallel_size=1),
                  cache_config=ns(enable_prefix_caching=False, block_size=16), speculative_config=None,
                  scheduler_config=ns(enable_chunked_prefill=False, max_num_seqs=max_num_seqs),
                  model_config=ns(hf_text_config=ns(num_hidden_layers=4, sliding_window=32,
                                                    layer_types=["full_attention", "full_attention",
                                                                 "sliding_attention", "full_attention"])))

    assert VllmTokenDropBackend.from_vllm_config(config(64), "0.26.0", aot_compile=False).graph_decode_max_reqs == 64
    with pytest.raises(ValueError, match="needs scheduler_config.max_num_seqs"):
        VllmTokenDropBackend.from_vllm_config(config(None), "0.26.0", aot_compile=False)
    with pytest.raises(ValueError, match="cudagraph_mode=FULL_DECODE_ONLY with token dropping"):
        VllmTokenDropBackend.from_vllm_config(config(64, decode_graphs=False), "0.26.0", aot_compile=False)
    backend = VllmTokenDropBackend.from_vllm_config(config(64), "0.26.0", aot_compile=False)
    report = types.SimpleNamespace(drop_layers=(1,), reason="")
    info = types.SimpleNamespace(gdn_ops=0, linear_sites=(), layers=(0, 1, 2, 3), sites=[types.SimpleNamespace(layer=i, layer_name=f"l{i}")
                                                             for i in range(4)])
    backend._hooks = types.SimpleNamespace(window_layer_fn=None)
    assert backend._rewrite(None, info, report) is None  # graph decoding no longer refuses them: the hooks' check
    assert report.reason == "sliding-window layers run after a drop point and the hooks give no window_layer_fn"


def recorded_decode_capture(windows=None):
    """A dropped prefill (`dropped_world`), then the drop points of decode step 1 run as vLLM runs a
    capture: once as a warm-up over the same dicts (a capture reading what it installed would replay
    it stale), then recorded (`graph_replay.Capture`: no host read allowed). Returns the world, the
    runtime, the request ids, vLLM's persistent inputs by layer ((metadata, slot mapping)), the
    forward and the recording."""
    from graph_replay import Capture

    world, runtime = dropped_world((1, 3), windows=windows)
    ids = tuple(world.request_ids)
    step(world, [q + 1 for q in QUERY_LENS], [1] * len(QUERY_LENS))
    captured = {n: (world.attn_metadata[n], world.slot_mapping[n]) for n in world.names}
    world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
    runtime.before_step(ids)
    q = k = torch.zeros(len(QUERY_LENS), HEADS, HEAD)

    def forward():
        runtime.begin_step()
        for layer in runtime.drop_layers:
            runtime.drop(q, k, layer)

    forward()
    with Capture() as graph:
        forward()
    return world, runtime, ids, captured, forward, graph


def test_a_replayed_capture_follows_the_refilled_buffers_and_histories():
    """The capture path recorded once (`tests/graph_replay.py` stands in for a CUDA graph: no host
    read allowed while capturing; a replay reruns the recorded ops only), then replayed for later
    decode steps after vLLM's buffers (seq_lens, slot mappings) are refilled in place and the
    runtime's table by `before_step`: every layer's seq_lens and slots equal the eager host
    path's for those steps, also after a request's history was freed."""
    world, runtime, ids, captured, forward, graph = recorded_decode_capture()
    installed = {n: (world.attn_metadata[n].seq_lens, world.slot_mapping[n]) for n in world.names}
    assert all(installed[n][0] is not captured[n][0].seq_lens for n in world.names[2:])  # the later layers' own
    for decoded, finished in ((4, None), (6, ids[0])):
        if finished is not None:
            assert runtime.free(finished)
        step(world, [q + decoded for q in QUERY_LENS], [1] * len(QUERY_LENS))
        for n in world.names:  # vLLM refills its persistent buffers in place before a replay
            captured[n][0].seq_lens.copy_(world.attn_metadata[n].seq_lens)
            captured[n][1].copy_(world.slot_mapping[n])
        runtime.before_step(ids)  # the runner hook
        replayed = graph.replay()
        world.cudagraph_runtime_mode = types.SimpleNamespace(name="NONE")  # the eager host path, same step
        forward()
        for n in world.names:
            seq, slots = installed[n]
            got = (replayed.get(id(seq), seq).long(), replayed.get(id(slots), slots).long())
            want = (world.attn_metadata[n].seq_lens.long(), world.slot_mapping[n].long())
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{n}, decode step {decoded}")
    last = world.attn_metadata[world.names[-1]].seq_lens.long()
    assert last[0] == QUERY_LENS[0] + 6 + 1 and last[2] < QUERY_LENS[2] + 6 + 1  # request 0's history was freed


WINDOWS = {2: 64, 4: 64, 5: 16}  # sliding layers after drop points 1 and 3 (two windows)


def window_rows_of_step(world, runtime, capture: bool, decoded: int):
    """Each sliding layer's (request, logical, count) for decode step `decoded`, eager or as a capture."""
    step(world, [q + decoded for q in QUERY_LENS], [1] * len(QUERY_LENS))
    world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL" if capture else "NONE")
    if capture:
        runtime.before_step(tuple(world.request_ids))
    q = k = torch.zeros(len(QUERY_LENS), HEADS, HEAD)
    runtime.begin_step()
    for layer in runtime.drop_layers:
        runtime.drop(q, k, layer)
    rows = runtime.step.window_rows
    return {n: (rows[n].request.long(), rows[n].logical.long(), rows[n].count.long()) for n in runtime.windows}


@pytest.mark.parametrize("decoded", [0, 3, 40])
def test_capture_path_counts_the_host_paths_window_rows(decoded):
    """Sliding layers after drops under decode graphs (Gemma-3 on vLLM's defaults): the rows the capture
    path computes on the device (`window_rows`, from vLLM's seq_lens and the window tables `before_step`
    refilled) equal the eager host path's (`window_counts` with the drop histories), for requests with
    and without a history, at two drop points and two windows, early and late in the decode."""
    world, runtime = dropped_world((1, 3), windows=WINDOWS)
    eager = window_rows_of_step(world, runtime, capture=False, decoded=decoded)
    captured = window_rows_of_step(world, runtime, capture=True, decoded=decoded)
    assert eager.keys() == captured.keys() == set(runtime.windows)
    for name in eager:
        for what, want, got in zip(("request", "logical", "count"), eager[name], captured[name]):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} {what}, decode step {decoded}")
    counts = eager[world.names[2]][2]
    assert counts[1] == min(QUERY_LENS[1] + decoded + 1, 64)  # no history: one entry per position
    assert counts[0] < min(QUERY_LENS[0] + decoded + 1, 64) or decoded >= 63  # a dropped prompt: fewer


def test_the_capture_path_counts_each_window_once_per_drop_point_for_all_kv_cache_groups(monkeypatch):
    """vLLM gives every KV-cache group one seq_lens tensor (Gemma-3-270M: 15 sliding layers in 5 groups): the
    capture path counts the rows of each window once per drop point, not once per group (on the H200 the repeated
    counts were a few hundred tiny kernels a decode step), and each layer still reads its own group's block table.
    Layers 2 (group 0) and 5 (group 1) share window 64, layer 4 (group 0) has 16: two counts at drop point 1
    (layers 2, 4, 5) and two at drop point 3 (layers 4, 5), not three and two; all equal to the eager host path's."""
    from uniprefill.vllm import graph_decode

    windows = {2: 64, 4: 16, 5: 64}
    world, runtime = dropped_world((1, 3), windows=windows)
    eager = window_rows_of_step(world, runtime, capture=False, decoded=3)
    calls = []
    counted = graph_decode.window_rows
    monkeypatch.setattr(graph_decode, "window_rows", lambda *a, **kw: calls.append(a[5]) or counted(*a, **kw))
    captured = window_rows_of_step(world, runtime, capture=True, decoded=3)
    assert sorted(calls) == [16, 16, 64, 64]  # drop point 1: windows 64 and 16; drop point 3: 16 and 64
    for name in eager:
        for want, got in zip(eager[name], captured[name]):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        group = world.names.index(name) % world.groups
        assert runtime.step.window_rows[name].block_table.data_ptr() == world.tables[group].data_ptr()


def test_a_replayed_capture_counts_the_windows_of_later_steps():
    """The capture path with sliding layers recorded once (`graph_replay.Capture`: no host read while
    capturing), replayed for later decode steps after vLLM's seq_lens are refilled in place and the
    window tables by `before_step`: every sliding layer's counts equal the eager host path's, also
    after a request's history was freed (its rows then count one entry per position)."""
    world, runtime, ids, captured, forward, graph = recorded_decode_capture(WINDOWS)
    counts = {n: runtime.step.window_rows[n].count for n in runtime.windows}
    for decoded, finished in ((5, None), (30, ids[2])):
        if finished is not None:
            assert runtime.free(finished)
        step(world, [q + decoded for q in QUERY_LENS], [1] * len(QUERY_LENS))
        for n in world.names:
            captured[n][0].seq_lens.copy_(world.attn_metadata[n].seq_lens)
        runtime.before_step(ids)
        replayed = graph.replay()
        world.cudagraph_runtime_mode = types.SimpleNamespace(name="NONE")
        forward()
        for n in runtime.windows:
            got = replayed.get(id(counts[n]), counts[n]).long()
            torch.testing.assert_close(got, runtime.step.window_rows[n].count.long(), rtol=0, atol=0,
                                       msg=f"{n}, decode step {decoded}")
        world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
    assert runtime.step.window_rows[world.names[2]].count[2] == 64  # request 2's history was freed


@pytest.mark.parametrize("p", [0.95, 1.0], ids=["p0.95", "p1"])
@pytest.mark.parametrize("unsplit_aid", [False, True], ids=["default", "unsplit-aid"])
def test_the_window_kernel_is_compiled_in_a_dummy_forward_never_in_a_capture(monkeypatch, unsplit_aid, p):
    """vLLM captures decode graphs after dummy forwards that carry metadata but no requests, in which sliding
    layers run vLLM's own attention: the window kernels must run once per layer there (Triton compiles at a
    first launch, which inside a capture would be captured), with the layer's real block table, in every variant
    a step may pick: the per-row kernel on one row on one program and split 8 ways at window 512 (one
    program only under the A/B aid UNIPREFILL_DEBUG_UNSPLIT_WINDOW), the
    tiled kernel on 16 and 17 rows; at p = 1 (decode graphs that keep vLLM's rows) the per-row ones also skipping
    rows; every one that does not skip also on rows named by `rows=` (a mixed step's); not before the KV cache
    exists, and not again. (A capture's drop point takes the capture path, never this
    one.)"""
    from uniprefill.kernels import paged_window
    from uniprefill.vllm.drop_records import WindowLayer

    world = make_world([40], layers=4, groups=2, block=BLOCK, kv_heads=HEADS, head_size=HEAD)
    caches = {}  # none allocated yet: vLLM's profiling run
    runtime = VllmDropRuntime(UniPrefillConfig(p=p, drop_layers=(1,), impl="torch"), world.names, (1,), lambda: world,
                              lambda n: BLOCK, request_ids_fn=lambda: None, graph_decode_max_reqs=4,
                              windows={world.names[2]: 512, world.names[3]: 512}, window_layer_fn=caches.get)
    runtime.vllm_attention = {2: lambda *a, **k: None, 3: lambda *a, **k: None}
    if unsplit_aid:
        monkeypatch.setenv("UNIPREFILL_DEBUG_UNSPLIT_WINDOW", "1")
    launched = []
    real = paged_window.paged_window_attention
    monkeypatch.setattr(paged_window, "paged_window_attention", lambda q, k, v, table, *a, **kw: (
        launched.append((q.shape[0], kw["tiled"], kw["splits"], kw["skip"] is not None, kw["rows"] is not None,
                         table.data_ptr())),
        real(q, k, v, table, *a, **kw))[1])
    q = torch.randn(1, HEADS * HEAD)

    def dummy_forward():
        runtime.begin_step()
        runtime.drop(q.view(1, HEADS, HEAD), q.view(1, HEADS, HEAD), 1)
        assert runtime.step.profiling
        for layer in (2, 3):
            runtime.window_attention((q, q, q, torch.empty_like(q), world.names[layer]), {}, layer)

    dummy_forward()
    assert launched == [] and runtime.windows_warmed == set()  # no cache yet: nothing compiled, try again
    for name in world.names:
        cache = world.kv_caches[name]
        caches[name] = WindowLayer(cache[0].view(-1, BLOCK, HEADS, HEAD), cache[1].view(-1, BLOCK, HEADS, HEAD), 0.25)
    dummy_forward()
    per_row = [(1, False, 1)] + ([] if unsplit_aid else [(1, False, 8)])
    variants = ([(*v, False) for v in per_row] + [(*v, True) for v in per_row if p == 1.0]
                + [(16, True, 1, False), (17, True, 1, False)])
    variants = [(*v, False) for v in variants] + [(*v, True) for v in variants if not v[3]]
    assert runtime.windows_warmed == set(world.names[2:])
    assert launched == [v + (world.attn_metadata[n].block_table.data_ptr(),) for n in world.names[2:] for v in variants]
    dummy_forward()
    assert len(launched) == 2 * len(variants)  # once per layer


def test_window_rows_of_padding_rows_and_stale_tables_keep_the_kernels_contract():
    """A captured decode batch is padded (seq_lens 0): those rows read entry 0 with count 1 (count 0 would make
    the kernel's softmax 0/0); a count never exceeds the window, even from tables that do not fit the step."""
    from uniprefill.vllm.graph_decode import window_rows

    seq_lens = torch.tensor([300, 5, 0, 0])
    tail = torch.arange(0, 16).repeat(4, 1) + 280  # kept positions 280..295 for every row
    prompt_end = torch.tensor([296, 400, 0, 0])  # row 1: a position before its prompt end (stale)
    has = torch.tensor([True, True, False, False])
    rows = window_rows(seq_lens, torch.zeros(4, 8, dtype=torch.int32), tail, prompt_end, has, window=8)
    assert rows.logical.tolist() == [299, 4, 0, 0]
    assert rows.count.tolist()[2:] == [1, 1]  # padding rows
    assert all(1 <= c <= min(8, l + 1) for c, l in zip(rows.count.tolist(), rows.logical.tolist()))
    assert rows.count[0] == 4 + 4  # kept 292..295 and decoded 296..299


def test_the_tables_refuse_a_refill_inside_a_capture(monkeypatch):
    """A refill captured into a CUDA graph would replay its copy from a pinned staging buffer reused since: raised."""
    from uniprefill.vllm.metadata import DropHistoryStore

    tables = DecodeTables(1, 4)
    tables.on(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        tables.fill(DropHistoryStore((1,), 3), ("a",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_upload_queues_the_copy_behind_the_stream_and_lands_every_value():
    """`upload` (the decode tables' refill) copies through pinned memory without waiting for the stream: values queued
    behind a long kernel still land, and a later refill of the same rows does not overwrite the earlier one's
    source before the copy read it (the caching host allocator holds it)."""
    from uniprefill.vllm.graph_decode import upload

    table = torch.zeros(3, 8, dtype=torch.int32, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    for round_ in range(20):
        big @ big  # work queued before the copy
        host = torch.arange(24, dtype=torch.int32).reshape(3, 8) + round_
        upload(table[:, :5], host[:, :5])
        del host  # the pinned copy must outlive this
    torch.cuda.synchronize()
    assert torch.equal(table[:, :5].cpu(), torch.arange(24, dtype=torch.int32).reshape(3, 8)[:, :5] + 19)
    assert table[:, 5:].eq(0).all()
    tail = torch.full((2, 8, 4), -1, dtype=torch.long, device="cuda")  # the window tables' transposed fill
    host = torch.arange(5 * 2 * 4).reshape(5, 2, 4)
    upload(tail[:, :5], host.transpose(0, 1))
    torch.cuda.synchronize()
    assert torch.equal(tail[:, :5].cpu(), host.transpose(0, 1)) and tail[:, 5:].eq(-1).all()
