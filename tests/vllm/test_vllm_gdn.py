"""Qwen3-Next's Gated DeltaNet layers after drop points in vLLM (CPU, the fake vLLM of `fake_vllm_gdn.py`).

The backend rewrites a hybrid graph whose attention layers are 1 and 3 of 0..5 (the runtime indexes them 0 and 1),
and the GDN layers after each drop point get vLLM's builder's metadata rebuilt for the kept rows
(`uniprefill.vllm.gdn_metadata`). The fake GDN op checks that its metadata describes the rows it gets, so a missing
rebuild fails loudly, and the outputs are compared with each request run alone on its kept rows.
"""

from __future__ import annotations

import pytest
import torch

from fake_vllm_gdn import BLOCK, KINDS, FakeGDNBuilder, HybridBackbone, gdn_step, gdn_world, layer_name
from fake_vllm_model import VOCAB, WORLD
from uniprefill.config import UniPrefillConfig
from uniprefill.vllm import gdn_metadata
from uniprefill.vllm import runner_hook as hook
from uniprefill.vllm.graph import analyze_vllm_graph
from uniprefill.vllm.plugin import VllmHooks, VllmTokenDropBackend

DROPS = (1, 3)
LINEAR = [layer_name(i) for i, kind in enumerate(KINDS) if kind == "linear"]


@pytest.fixture(scope="module")
def model():
    return HybridBackbone().eval()


@pytest.fixture
def builder():
    gdn_metadata.record_builds(FakeGDNBuilder)
    yield FakeGDNBuilder()
    gdn_metadata.unrecord_builds(FakeGDNBuilder)


def compiled_backend(model, **settings):
    hooks = VllmHooks(lambda: WORLD.context, lambda: WORLD.context.request_ids,
                      lambda: getattr(WORLD.context, "num_prompt_tokens", None), hook.FinishedListeners())
    config = UniPrefillConfig(block_size=BLOCK, last_q=16, sink=16, min_tokens=64, drop_layers=DROPS, vllm_drop=True,
                              **settings)
    backend = VllmTokenDropBackend(config, layer_kinds=list(KINDS), block_size=BLOCK, hooks=hooks)
    return backend, torch.compile(model, backend=backend, dynamic=True, fullgraph=True)


def kept_rows(points, first: int, last: int, before: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """Per drop layer, the rows (of those entering it) one request kept; its rows are `first:last` of the step's
    batch, after `before` (positions of earlier steps, kept everywhere)."""
    before = torch.arange(0) if before is None else before
    kept, entering = {}, torch.cat([-1 - before, torch.arange(first, last)])  # earlier positions: never in a step row
    for layer, point in zip(DROPS, points):
        keep = torch.nonzero((entering < 0) | torch.isin(entering, point.source_rows)).flatten()
        kept[layer], entering = keep, entering[keep]
    assert entering[-1] == last - 1  # the last token is always kept
    return kept


def test_the_graph_reads_gdn_sites_and_the_runtime_indexes_attention_by_position(model, builder):
    backend, compiled = compiled_backend(model, keep_ratio=0.5)
    WORLD.context = gdn_world([100], builder)
    with torch.no_grad():
        compiled(torch.randint(0, VOCAB, (100,)), torch.arange(100))
    torch._dynamo.reset()
    report, runtime = backend.graphs[0], backend.runtimes[0]
    assert report.rewritten and report.layers == (1, 3) and report.drop_layers == DROPS
    assert runtime.drop_layers == [0, 1] and runtime.layer_names == [layer_name(1), layer_name(3)]
    assert runtime.linear_layers == {layer_name(0): 0, layer_name(2): 1, layer_name(4): 2, layer_name(5): 2}
    assert [p.layer for p in runtime.step.points] == [0, 1]


def test_gdn_layers_after_drops_run_on_the_kept_rows_through_prefill_and_decode(model, builder):
    """Prefill (two prompts drop at both points, one is too short), then two decode steps: every request's row
    equals the request alone on its kept rows; the rebuilt metadata keeps vLLM's state slots and split."""
    backend, compiled = compiled_backend(model, keep_ratio=0.5)
    query_lens = [200, 40, 130]
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    world = WORLD.context = gdn_world(query_lens, builder)
    vllms = {name: WORLD.context.attn_metadata[name] for name in LINEAR}
    with torch.no_grad():
        hidden = compiled(ids, torch.cat([torch.arange(q) for q in query_lens]))
    runtime = backend.runtimes[0]
    installed = WORLD.context.attn_metadata
    assert installed[layer_name(0)] is vllms[layer_name(0)]  # before any drop point: vLLM's own
    rebuilt = installed[layer_name(4)]
    assert rebuilt is not vllms[layer_name(4)] and installed[layer_name(5)] is not rebuilt  # one per KV-cache group
    counts = runtime.step.layout.query_lens_cpu
    assert rebuilt.num_actual_tokens == installed[layer_name(5)].num_actual_tokens == int(counts.sum())
    assert installed[layer_name(2)].num_actual_tokens > int(counts.sum())  # after the first drop point only
    assert counts[1] == 40 and counts[0] < 120
    assert torch.equal(rebuilt.non_spec_state_indices_tensor, vllms[layer_name(4)].non_spec_state_indices_tensor)
    assert rebuilt.num_decodes == 0 and not bool(rebuilt.has_initial_state.any())
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    prompt_kept = []
    with torch.no_grad():
        for r in range(len(query_lens)):
            kept = kept_rows(runtime.step.points, qsl[r], qsl[r + 1])
            torch.testing.assert_close(hidden[qsl[r + 1] - 1], model.reference(ids[qsl[r]:qsl[r + 1]], kept),
                                       atol=1e-5, rtol=1e-5)
            prompt_kept.append([set((p.source_rows[(p.source_rows >= qsl[r]) & (p.source_rows < qsl[r + 1])]
                                     - qsl[r]).tolist()) for p in runtime.step.points])
    tokens = [ids[qsl[r]:qsl[r + 1]] for r in range(len(query_lens))]
    for step in range(2):
        new = torch.randint(0, VOCAB, (len(query_lens),))
        computed = [q + step for q in query_lens]
        WORLD.context = gdn_step(world, computed, [1] * len(query_lens))
        with torch.no_grad():
            out = compiled(new, torch.tensor(computed))
            for r in range(len(query_lens)):
                tokens[r] = torch.cat([tokens[r], new[r:r + 1]])
                ref = model.decode_reference(tokens[r], query_lens[r], prompt_kept[r], DROPS)
                torch.testing.assert_close(out[r], ref, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_a_step_of_a_decode_and_a_dropping_last_chunk_keeps_vllms_split_and_state(model, builder):
    """Step 1: request 0's whole prompt (drops) and request 1's first chunk (never drops). Step 2: request 0
    decodes (one row, first, as vLLM orders decodes) beside request 1's last chunk, which drops among its own rows
    and continues the GDN state of its first chunk (`has_initial_state`)."""
    backend, compiled = compiled_backend(model, keep_ratio=0.5)
    torch.manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (120,)), torch.randint(0, VOCAB, (220,))]
    world = WORLD.context = gdn_world([120, 100], builder, room=130)
    world.num_prompt_tokens = torch.tensor([120, 220])
    with torch.no_grad():
        compiled(torch.cat([prompts[0], prompts[1][:100]]), torch.cat([torch.arange(120), torch.arange(100)]))
    runtime = backend.runtimes[0]
    assert runtime.step.layout.query_lens_cpu[1] == 100 and runtime.step.layout.query_lens_cpu[0] < 120
    first_kept = [set((p.source_rows[p.source_rows < 120]).tolist()) for p in runtime.step.points]
    new = torch.randint(0, VOCAB, (1,))
    ctx = WORLD.context = gdn_step(world, [120, 100], [1, 120])
    ctx.num_prompt_tokens = torch.tensor([120, 220])
    with torch.no_grad():
        out = compiled(torch.cat([new, prompts[1][100:]]), torch.cat([torch.tensor([120]), torch.arange(100, 220)]))
    counts = runtime.step.layout.query_lens_cpu
    assert counts[0] == 1 and counts[1] < 120  # the last chunk dropped
    rebuilt = ctx.attn_metadata[layer_name(4)]
    assert rebuilt.num_decodes == 1 and rebuilt.num_actual_tokens == int(counts.sum())
    assert rebuilt.has_initial_state.tolist() == [True, True]
    with torch.no_grad():
        ref0 = model.decode_reference(torch.cat([prompts[0], new]), 120, first_kept, DROPS)
        kept1 = kept_rows(runtime.step.points, 1, 121, before=torch.arange(100))
        ref1 = model.reference(prompts[1], kept1)
    torch._dynamo.reset()
    torch.testing.assert_close(out[0], ref0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[-1], ref1, atol=1e-5, rtol=1e-5)


def test_at_p_1_the_hybrid_equals_the_plain_model(model, builder):
    """p = 1 keeps every row: the GDN layers keep vLLM's metadata and the outputs equal the plain model's."""
    backend, compiled = compiled_backend(model, p=1.0)
    query_lens = [180, 70]
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    results = []
    for run in (compiled, model):
        WORLD.context = gdn_world(query_lens, builder)
        vllms = dict(WORLD.context.attn_metadata)
        with torch.no_grad():
            results.append(run(ids, positions))
        assert all(WORLD.context.attn_metadata[n] is vllms[n] for n in LINEAR)
    torch._dynamo.reset()
    assert backend.graphs[0].rewritten
    assert torch.equal(results[0], results[1])


def test_a_rebuild_that_would_change_vllms_decode_split_or_lacks_its_record_raises(builder):
    """A fresh prompt left with one row at the front would be a decode to vLLM's builder, whose decode kernels read
    the state slot unzeroed: refused. Metadata without the recorded build cannot be rebuilt: refused, named."""
    from fake_vllm_gdn import FakeCommon

    qsl = torch.tensor([0, 50, 130], dtype=torch.int32)
    common = FakeCommon(qsl, qsl.clone(), torch.tensor([50, 80], dtype=torch.int32), 2, 130, 80,
                        torch.tensor([[3], [5]], dtype=torch.int32))
    meta = builder.build(0, common)
    kept = torch.tensor([0, 1, 41], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="num_decodes=1 where vLLM's has 0"):
        gdn_metadata.rebuild_for_rows(meta, kept, kept, 40)
    kept = torch.tensor([0, 20, 61], dtype=torch.int32)
    rebuilt = gdn_metadata.rebuild_for_rows(meta, kept, kept, 41)
    assert rebuilt.num_actual_tokens == 61 and rebuilt.non_spec_state_indices_tensor.tolist() == [3, 5]
    assert getattr(rebuilt, gdn_metadata.BUILD_INPUTS).common is common  # a second drop starts from vLLM's again
    gdn_metadata.unrecord_builds(FakeGDNBuilder)
    with pytest.raises(RuntimeError, match="record_builds is not installed"):
        gdn_metadata.rebuild_for_rows(FakeGDNBuilder().build(0, common), kept, kept, 41)


def test_in_align_mode_the_rebuild_keeps_the_state_slot_vllm_picked_from_seq_lens():
    """Prefix caching puts Qwen3-Next's states in `mamba_cache_mode="align"`: the slot is the block table's column
    of the request's last token (`seq_lens`). The rebuild keeps vLLM's `seq_lens` (compacted ones would pick
    another column), so the slots stay vLLM's."""
    from fake_vllm_gdn import FakeCommon

    builder = FakeGDNBuilder(align_block=64)
    gdn_metadata.record_builds(FakeGDNBuilder)
    try:
        qsl = torch.tensor([0, 150, 330], dtype=torch.int32)
        table = torch.arange(1, 13, dtype=torch.int32).view(2, 6)
        common = FakeCommon(qsl, qsl.clone(), torch.tensor([150, 250], dtype=torch.int32), 2, 330, 180, table)
        meta = builder.build(0, common)
        kept = torch.tensor([0, 40, 90], dtype=torch.int32)
        rebuilt = gdn_metadata.rebuild_for_rows(meta, kept, kept, 50)
    finally:
        gdn_metadata.unrecord_builds(FakeGDNBuilder)
    assert meta.non_spec_state_indices_tensor.tolist() == [3, 10]  # columns 149 // 64 = 2 and 249 // 64 = 3
    assert rebuilt.non_spec_state_indices_tensor.tolist() == [3, 10]
    assert rebuilt.has_initial_state.tolist() == [False, True] and rebuilt.prefill_query_start_loc.tolist() == [0, 40, 90]


def test_last_q_below_2_and_gdn_layers_are_refused(model, builder):
    """With last_q = 1 a prompt could keep one row, which vLLM's builder would take for a decode: refused up front
    (the review of 2026-12-04 made it happen with last_q=1, sink=0, keep_ratio=0.01)."""
    import types

    backend, _ = compiled_backend(model, keep_ratio=0.5)
    backend.config = UniPrefillConfig(block_size=BLOCK, last_q=1, sink=0, min_tokens=64, drop_layers=DROPS,
                                      vllm_drop=True, keep_ratio=0.01)
    report = types.SimpleNamespace(drop_layers=DROPS, reason="")
    info = analyze_vllm_graph(torch.fx.symbolic_trace(model))
    assert backend._rewrite(None, info, report) is None and "use last_q >= 2" in report.reason


def test_auto_drop_layers_count_a_hybrids_gdn_layers(model):
    """"auto" picks the drop points from the model's depth, Gated DeltaNet layers included, as the Hugging Face
    path does (a kinds list over the attention layers alone would end at the last attention layer)."""
    import types

    from uniprefill.passes.classify import LayerInfo
    from uniprefill.passes.drop_points import resolve_drop_layers

    backend, _ = compiled_backend(model, keep_ratio=0.5)
    backend.config = UniPrefillConfig(drop_layers="auto", vllm_drop=True)
    report = types.SimpleNamespace(layers=(), drop_layers=None, plan_error=None)
    backend._plan(torch.fx.symbolic_trace(model), report)
    whole = {i: LayerInfo(i, backend.layer_kinds[i]) for i in range(len(KINDS))}
    assert report.drop_layers == resolve_drop_layers("auto", whole)


def test_gdn_ops_whose_layer_names_cannot_be_read_or_other_scans_are_refused(model, builder):
    """A GDN op without a readable 'layers.N.' name, and Mamba-like layers (LINEAR kinds with no GDN op), run
    unaccelerated with the reason."""
    import types

    backend, _ = compiled_backend(model, keep_ratio=0.5)
    report = types.SimpleNamespace(drop_layers=DROPS, reason="")
    info = types.SimpleNamespace(gdn_ops=4, linear_sites=(), layers=(1, 3), sites=())
    assert backend._rewrite(None, info, report) is None and "no readable 'layers.<index>.'" in report.reason
    info = types.SimpleNamespace(gdn_ops=0, linear_sites=(), layers=(1, 3), sites=())
    assert backend._rewrite(None, info, report) is None
    assert "other than Gated DeltaNet" in report.reason and "[0, 2, 4, 5]" in report.reason


def test_analysis_of_the_hybrid_graph(model):
    gm = torch.fx.symbolic_trace(model)
    info = analyze_vllm_graph(gm)
    assert info.layers == (1, 3) and info.gdn_ops == 4
    assert [(s.layer_name, s.layer, s.attention_before) for s in info.linear_sites] == [
        (layer_name(0), 0, 0), (layer_name(2), 2, 1), (layer_name(4), 4, 2), (layer_name(5), 5, 2)]
    assert info.position(3) == 1


def test_under_vllms_default_mode_3_the_hybrid_drops_as_the_eager_rewrite(model, builder, monkeypatch):
    """vLLM's default compilation: the graph split at the attention and GDN ops (vLLM lists
    `qwen_gdn_attention_core` among its splitting ops) and at uniprefill's, the pieces compiled by Inductor: the
    outputs equal the eager rewrite's, rows were dropped, and the GDN layers after the drops got rebuilt metadata."""
    import types

    from fake_vllm_compile import FakeVllmBackend, fake_mode3_config
    from uniprefill.vllm import piecewise

    made = []
    hooks = VllmHooks(lambda: WORLD.context, lambda: WORLD.context.request_ids,
                      lambda: getattr(WORLD.context, "num_prompt_tokens", None), types.SimpleNamespace(add=made.append))
    monkeypatch.setattr(VllmHooks, "from_vllm", classmethod(lambda cls: hooks))
    settings = {"keep_ratio": 0.5, "block_size": BLOCK, "last_q": 16, "sink": 16, "min_tokens": 64,
                "drop_layers": list(DROPS), "vllm_drop": True}
    config = fake_mode3_config(settings, layers=len(KINDS), block=BLOCK, splitting_ops=[
        "uniprefill_fakevllm::unified_attention_with_output", "uniprefill_fakevllm::unified_kv_cache_update",
        "uniprefill_fakevllm::gdn_attention_core"])
    config.model_config.hf_text_config.layer_types = [f"{k}_attention" for k in KINDS]
    query_lens = [220, 50, 140]
    torch.manual_seed(6)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    _, eager = compiled_backend(model, keep_ratio=0.5)
    WORLD.context = gdn_world(query_lens, builder)
    with torch.no_grad():
        reference = eager(ids, positions)
    torch._dynamo.reset()
    assert piecewise.install(FakeVllmBackend)
    try:
        compiled = torch.compile(model, backend=lambda gm, inputs: FakeVllmBackend(config)(gm, inputs), dynamic=True,
                                 fullgraph=True)
        WORLD.context = gdn_world(query_lens, builder)
        with torch.no_grad():
            ours = compiled(ids, positions)
    finally:
        assert piecewise.uninstall(FakeVllmBackend)
        torch._dynamo.reset()
    runtime = made[-1]
    assert sum(runtime.step.points[-1].kept) < sum(query_lens) and runtime.linear_layers
    assert WORLD.context.attn_metadata[layer_name(5)].num_actual_tokens == sum(runtime.step.points[-1].kept)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=2e-5)


FUZZ_CASES = 6  # per CI run; `FUZZ_CASES = 100` for a longer run


def positions_as_rows(kept_positions: list[set[int]], length: int) -> dict[int, torch.Tensor]:
    """`reference`'s `kept` (rows among those entering each drop layer) from the positions each drop point kept."""
    kept, entering = {}, list(range(length))
    for layer, positions in zip(DROPS, kept_positions):
        keep = [i for i, p in enumerate(entering) if p in positions]
        kept[layer], entering = torch.tensor(keep), [entering[i] for i in keep]
    return kept


@pytest.mark.parametrize("case", range(FUZZ_CASES))
def test_random_multi_step_cases_equal_each_request_alone_on_its_kept_rows(model, builder, case):
    """A differential fuzz of the hybrid under forced dropping: 1-4 requests, whole prompts first and prompts in
    two chunks after them (vLLM's order: in step 2 the whole ones decode before the last chunks), then 0-2 decode
    steps of all; every request's row in every step equals the request alone over the positions each drop point
    kept for it so far (its GDN state included)."""
    import random

    rng = random.Random(case)
    whole = [rng.randint(2, 300) for _ in range(rng.randint(0, 2))]
    chunked = [(rng.randint(1, 200), rng.randint(2, 200)) for _ in range(rng.randint(0, 2))]
    whole.append(rng.randint(100, 300))  # one prompt long enough to drop in every case (min_tokens 64)
    while len(whole) + len(chunked) < 2:  # a one-token decode step would make dynamo specialise (a recompile)
        whole.append(rng.randint(2, 300))
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(case * 10 + i))
               for i, n in enumerate(whole + [a + b for a, b in chunked])]
    lengths = [len(p) for p in prompts]
    steps = [[(0, n) for n in whole] + [(0, a) for a, _ in chunked]]
    steps.append([(n, 1) for n in whole] + [(a, b) for a, b in chunked])
    done = [n + 1 for n in whole] + [a + b for a, b in chunked]  # tokens computed after step 2
    for extra in range(rng.randint(0, 2)):
        steps.append([(n + extra, 1) for n in done])
    backend, compiled = compiled_backend(model, keep_ratio=0.5)
    tokens = [p.clone() for p in prompts]
    kept = [[set(), set()] for _ in prompts]
    world = None
    for number, step in enumerate(steps):
        computed, query_lens = [c for c, _ in step], [q for _, q in step]
        if world is None:
            world = WORLD.context = gdn_world(query_lens, builder, room=420)
        else:
            WORLD.context = gdn_step(world, computed, query_lens)
        WORLD.context.num_prompt_tokens = torch.tensor(lengths)
        rows = []
        for r, (c, q) in enumerate(step):
            if c + q > len(tokens[r]):
                tokens[r] = torch.cat([tokens[r], torch.randint(0, VOCAB, (1,), generator=torch.Generator()
                                                                .manual_seed(case * 100 + number * 10 + r))])
            rows.append((r, c, q))
        ids = torch.cat([tokens[r][c:c + q] for r, c, q in rows])
        positions = torch.cat([torch.arange(c, c + q) for _, c, q in rows])
        with torch.no_grad():
            out = compiled(ids, positions)
        qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
        for i, point in enumerate(backend.runtimes[0].step.points):
            for r, c, q in rows:
                mine = point.source_rows[(point.source_rows >= qsl[r]) & (point.source_rows < qsl[r + 1])]
                kept[r][i] |= set((mine - qsl[r] + c).tolist())
        if number == 0:
            assert sum(backend.runtimes[0].step.points[-1].kept) < sum(query_lens), f"case {case}: nothing dropped"
        for r, c, q in rows:
            with torch.no_grad():
                ref = model.reference(tokens[r][:c + q], positions_as_rows(kept[r], c + q))
            torch.testing.assert_close(out[qsl[r + 1] - 1], ref, atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"case {case}, step {number}, request {r}: {m}")
    torch._dynamo.reset()


def test_the_qwen3_next_80b_shaped_folder_has_its_layer_order_and_sizes(tmp_path):
    """The dummy-weight engine runs of the Qwen3-Next shape (`defaults_engine.py --qwen3next-layers`) get the real
    model's layer sizes and order: three Gated DeltaNet layers, then full attention."""
    from transformers import AutoConfig

    from uniprefill.testing import word_llama

    word_llama.write_qwen3_next_folder(tmp_path, word_llama.qwen3_next_layer_types(12), word_llama.QWEN3_NEXT_80B_A3B)
    config = AutoConfig.from_pretrained(tmp_path)
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [3, 7, 11]
    assert (config.hidden_size, config.num_experts, config.num_experts_per_tok, config.linear_num_value_heads) == \
        (2048, 512, 10, 32)
