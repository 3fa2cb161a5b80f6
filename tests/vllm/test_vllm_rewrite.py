"""The vLLM prefill rewrite on CPU, in a fake vLLM (`tests/vllm/fake_vllm_model.py`): paged KV caches
written through slot mappings and attention read through block tables and `seq_lens`, driven
by a forward context of per-layer metadata shaped like vLLM 0.26's (`FlashAttentionMetadata`
field names), and a tiny token-major model traced by dynamo as vLLM's mode 2 traces its backbone.

Reference: the same weights run in plain PyTorch, every request on its own, with the drop
point keeping exactly the rows the rewritten graph kept: layers up to the drop layer's
attention on all tokens, everything after on the kept tokens at their original positions.
"""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from fake_vllm_model import (BLOCK, HIDDEN, LAYERS, VOCAB, WORLD, TinyBackbone, compile_with_drops, fake_context,
                             kept_per_request, step_context)
from uniprefill.backend import GraphReport
from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.graph import analyze_vllm_graph
from uniprefill.vllm.rewrite import rewrite_vllm_graph
from uniprefill.vllm.drop import VllmDropRuntime
from uniprefill.vllm.metadata import SkipReason


@pytest.fixture(scope="module")
def model():
    return TinyBackbone().eval()


@pytest.mark.parametrize("drops", [(1,), (1, 2)], ids=["one-drop", "two-drops"])
def test_rewritten_graph_matches_the_reference_on_kept_tokens(model, drops):
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, drops)
    query_lens = [300, 40, 170]  # the 40-token prompt is below min_tokens: it keeps every row
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        hidden = compiled(ids, positions)
    torch._dynamo.reset()
    info, runtime, result = state["info"], state["runtime"], state["result"]
    assert info.layers == tuple(range(LAYERS))
    assert result.drop_layers == drops and result.gathered >= 3 and result.sizes_replaced >= 1 and result.scattered == 1
    layout = runtime.step.layout
    assert hidden.shape == (sum(query_lens), HIDDEN)
    counts = layout.query_lens_cpu.tolist()
    assert counts[1] == 40 and counts[0] < 300 * 0.6 and counts[2] < 170 * 0.6
    assert [p.layer for p in runtime.step.points] == list(drops)
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    with torch.no_grad():
        for r, q in enumerate(query_lens):
            kept, entering = {}, torch.arange(qsl[r], qsl[r + 1])  # rows of the original batch
            for point in runtime.step.points:
                keep = torch.nonzero(torch.isin(entering, point.source_rows)).flatten()
                kept[point.layer], entering = keep, entering[keep]
            assert entering[-1] == qsl[r + 1] - 1  # the last token is always kept
            ref = model.reference(ids[qsl[r]:qsl[r + 1]], kept)
            torch.testing.assert_close(hidden[qsl[r + 1] - 1], ref, atol=1e-5, rtol=1e-5)


def test_rewrite_refuses_what_it_cannot_do_yet(model):
    """Sliding-window layers after a drop (their window over original positions and their KV
    storage are open in vLLM) and drop layers that are not attention sites are refused."""
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16)
    errors = []

    def backend(gm, example_inputs):
        info = analyze_vllm_graph(gm)
        runtime = VllmDropRuntime(config, [s.layer_name for s in info.sites], (1,),
                                  context_fn=lambda: WORLD.context, block_size_fn=lambda name: BLOCK)
        for drops, kinds in (((1,), ["full", "full", "sliding", "full"]), ((7,), ["full"] * LAYERS)):
            with pytest.raises((ValueError, KeyError)) as exc:
                rewrite_vllm_graph(gm, info, drops, kinds, runtime)
            errors.append(str(exc.value))
        return gm.forward

    WORLD.context = fake_context([64])
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=True, fullgraph=True)(
            torch.zeros(64, dtype=torch.long), torch.arange(64))
    torch._dynamo.reset()
    assert "sliding-window layers [2]" in errors[0] and "no window" in errors[0] and "no attention layer 7" in errors[1]



@pytest.mark.parametrize("drops", [(1,), (1, 2)], ids=["one-drop", "two-drops"])
def test_decode_after_a_dropped_prefill_sees_each_layers_kept_keys(model, drops):
    """Prefill (two prompts drop, one is too short), then two decode steps of all three: each
    new token's hidden state equals the reference in which every layer after a drop point
    attends over the prompt tokens it kept plus the decoded ones."""
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, drops)
    query_lens = [300, 40, 170]
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    world = WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        compiled(ids, positions)
    runtime = state["runtime"]
    kept_sets = [[set((p.source_rows[(p.source_rows >= qsl[r]) & (p.source_rows < qsl[r + 1])] - qsl[r]).tolist())
                  for p in runtime.step.points] for r in range(len(query_lens))]
    assert len(runtime.store) == 2 and runtime.store.get("req-1") is None  # the short prompt did not drop
    tokens = [ids[qsl[r]:qsl[r + 1]] for r in range(len(query_lens))]
    for step in range(2):
        new = torch.randint(0, VOCAB, (len(query_lens),))
        computed = [q + step for q in query_lens]
        WORLD.context = step_context(world, computed, [1] * len(query_lens))
        with torch.no_grad():
            hidden = compiled(new, torch.tensor(computed))
        for r in range(len(query_lens)):
            tokens[r] = torch.cat([tokens[r], new[r:r + 1]])
            with torch.no_grad():
                ref = model.decode_reference(tokens[r], query_lens[r], kept_sets[r], drops)
            torch.testing.assert_close(hidden[r], ref, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    assert runtime.free("req-0") and not runtime.free("req-1") and len(runtime.store) == 1


def test_a_request_recomputed_from_scratch_replaces_its_history_and_totals_count_drops(model):
    """vLLM may preempt a request, free its KV and later prefill it again from position 0
    under the same id: the old history is forgotten (it described KV that no longer exists)
    and the new prefill drops exactly as the first did. The runtime's totals count both."""
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, (1,))
    query_lens = [300, 40, 170]
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    outputs, histories = [], []
    for _ in range(2):
        WORLD.context = fake_context(query_lens)
        with torch.no_grad():
            outputs.append(compiled(ids, positions))
        histories.append(state["runtime"].store.get("req-0"))
    torch._dynamo.reset()
    runtime = state["runtime"]
    last = [q - 1 for q in torch.tensor(query_lens).cumsum(0).tolist()]
    torch.testing.assert_close(outputs[1][last], outputs[0][last], atol=0, rtol=0)
    assert histories[0] is not None and histories[1] is not histories[0] and len(runtime.store) == 2
    totals = runtime.totals
    assert (totals.forwards, totals.dropping_forwards, totals.requests_dropped) == (2, 2, 4)
    assert totals.requests_removing_rows == 4
    assert totals.rows_in == 2 * (300 + 170) and totals.rows_kept < 0.6 * totals.rows_in
    # KV entries: layers 0 and 1 (the drop layer's attention runs before its drop) write every
    # prompt row, the later ones the kept rows only
    layers = len(runtime.layer_names)
    assert runtime.drop_layers == [1] and layers > 2
    assert totals.kv_entries_prompt == totals.rows_in * layers
    assert totals.kv_entries_written == totals.rows_in * 2 + totals.rows_kept * (layers - 2)
    assert totals.kv_written_share == totals.kv_entries_written / totals.kv_entries_prompt < 1
    from uniprefill.vllm import runner_hook as hook

    listeners = hook.FinishedListeners()  # as vLLM's collective_rpc(drop_totals) reads them in a worker
    listeners.add(runtime)
    live = len(runtime.store)
    assert listeners.totals() == [dataclasses.asdict(totals) | {"live_drop_histories": live}]
    assert isinstance(hook.drop_totals(object()), list)
    for request_id in list(runtime.store._histories):  # as vLLM's finished (or aborted) request ids do
        runtime.free(request_id)
    assert live > 0 and listeners.totals()[0]["live_drop_histories"] == 0

    class Worker:
        pass

    assert hook.install_worker_method(Worker) and not hook.install_worker_method(Worker)

    class LLM:  # vLLM's LLM.collective_rpc calls a method by name, or a function, in each worker
        def collective_rpc(self, fn, timeout=None):
            return [getattr(Worker(), fn)() if isinstance(fn, str) else fn("worker-0")]

    class Unpatched:  # no method by that name in the worker: the function is sent
        def collective_rpc(self, fn, timeout=None):
            if isinstance(fn, str):
                raise NotImplementedError(f"Method {fn!r} is not implemented.")
            return [fn("worker-0")]

    class Broken:
        def collective_rpc(self, fn, timeout=None):
            raise RuntimeError("insecure serialization is off")

    assert hook.collect_drop_totals(LLM()) == [hook.drop_totals()] == hook.collect_drop_totals(Unpatched())
    assert hook.collect_drop_totals(Broken()).startswith("unavailable: RuntimeError")


def test_each_request_may_bring_its_own_p(model):
    """Per-request p (`extra_args={"uniprefill": {"p": x}}` through the runner hook): in one
    batch, every request keeps exactly the rows a batch of engines with that request's p alone
    would keep; a request without its own p takes the config's."""
    query_lens = [300, 170, 250]
    torch.manual_seed(6)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()

    def kept_rows(p: float, request_p=None) -> list[set]:
        config = UniPrefillConfig(p=p, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
        compiled, state = compile_with_drops(model, config, (1,))
        WORLD.context = fake_context(query_lens)
        WORLD.context.request_p = request_p
        with torch.no_grad():
            compiled(ids, positions)
        torch._dynamo.reset()
        rows = state["runtime"].step.points[0].source_rows
        return [set(rows[(rows >= qsl[r]) & (rows < qsl[r + 1])].tolist()) for r in range(len(query_lens))]

    mixed = kept_rows(0.9, torch.tensor([0.5, math.nan, 0.99]))
    low, default, high = kept_rows(0.5), kept_rows(0.9), kept_rows(0.99)
    assert mixed == [low[0], default[1], high[2]]
    assert len(low[0]) < len(high[0])  # the p values do differ in what they keep


def assert_prefill_and_decode_match_the_reference(model, ids, query_lens, kept, hidden, new, step) -> None:
    """One drop at layer 1: each request's last prefill row and its decode row equal the plain
    model run on its kept positions (plus the decoded token)."""
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    for r, q in enumerate(query_lens):
        prompt = ids[qsl[r]:qsl[r + 1]]
        with torch.no_grad():
            ref_prefill = model.reference(prompt, {1: torch.tensor(sorted(kept[r]))})
            ref_decode = model.reference(torch.cat([prompt, new[r:r + 1]]), {1: torch.tensor(sorted(kept[r] | {q}))})
        torch.testing.assert_close(hidden[qsl[r + 1] - 1], ref_prefill, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step[r], ref_decode, atol=1e-5, rtol=1e-5)


def test_backend_with_the_experimental_switch_drops_and_decodes_like_the_reference(model, monkeypatch, tmp_path):
    """VllmTokenDropBackend end to end in the fake vLLM, as vLLM would call it, with
    the option vllm_drop: the graph is rewritten (its code dumped where
    UNIPREFILL_VLLM_REWRITE_DUMP says), the prefill and a decode step match the reference, and
    a finished request's history is freed through the hook's listeners."""
    from uniprefill.vllm import runner_hook as hook
    from uniprefill.vllm.plugin import VllmHooks, VllmTokenDropBackend

    monkeypatch.setenv("UNIPREFILL_VLLM_REWRITE_DUMP", str(tmp_path / "dump"))
    listeners = hook.FinishedListeners()
    hooks = VllmHooks(lambda: WORLD.context, lambda: WORLD.context.request_ids, lambda: None, listeners)
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64, drop_layers=(1,),
                              vllm_drop=True)
    backend = VllmTokenDropBackend(config, layer_kinds=["full"] * LAYERS, block_size=BLOCK, hooks=hooks)
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    query_lens = [200, 120]
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    world = WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        hidden = compiled(ids, torch.cat([torch.arange(q) for q in query_lens]))
    report, runtime = backend.graphs[0], backend.runtimes[0]
    assert report.rewritten and report.drop_layers == (1,) and not report.reason
    assert report.drop_layers == (1,) and report.counts["scattered"] == 1 and report.counts["gathered"] >= 3
    assert isinstance(report, GraphReport) and "drop layers [1]" in str(report)  # the Hugging Face backend's type
    (dumped,) = (tmp_path / "dump").iterdir()
    assert dumped.read_text().startswith("# VllmRewriteResult(drop_layers=(1,)") and "scatter_rows" in dumped.read_text()
    kept = kept_per_request(runtime.step.points[0], query_lens)
    new = torch.randint(0, VOCAB, (2,))
    WORLD.context = step_context(world, query_lens, [1, 1])
    with torch.no_grad():
        step = compiled(new, torch.tensor(query_lens))
    torch._dynamo.reset()
    assert_prefill_and_decode_match_the_reference(model, ids, query_lens, kept, hidden, new, step)
    assert len(runtime.store) == 2
    listeners.notify(["req-0"])
    assert len(runtime.store) == 1 and runtime.store.get("req-0") is None


def test_backend_under_model_runner_v2_drops_decodes_and_frees(model, monkeypatch):
    """The same end to end, with request ids from the V2 hook (vLLM 0.26's default runner for
    Llama and Gemma-3) rather than from the fake world: a fake V2 runner whose `execute_model`
    prepares the batch and runs the compiled model. A dummy run drops nothing; the prefill
    drops; the decode step matches the reference; a finished request's history is freed by the
    next `execute_model`."""
    import numpy as np

    from uniprefill.vllm import runner_hook as hook
    from uniprefill.vllm.plugin import VllmHooks, VllmTokenDropBackend

    listeners = hook.FinishedListeners()
    hooks = VllmHooks(lambda: WORLD.context, hook.step_request_ids, hook.num_prompt_tokens, listeners,
                      opted_out_fn=hook.opted_out)
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64, drop_layers=(1,),
                              vllm_drop=True)
    backend = VllmTokenDropBackend(config, layer_kinds=["full"] * LAYERS, block_size=BLOCK, hooks=hooks)
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    prompts = {"req-0": 200, "req-1": 120}

    class RunnerV2:
        def prepare_inputs(self, scheduler_output, batch_desc):
            ids = list(WORLD.context.request_ids)
            return types.SimpleNamespace(req_ids=ids, prefill_len_np=np.array([prompts[r] for r in ids]))

        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            if not dummy_run:
                self.prepare_inputs(scheduler_output, None)
            with torch.no_grad():
                return compiled(*scheduler_output.inputs)

    assert hook.install_v2(RunnerV2, listeners)
    runner = RunnerV2()

    def output(inputs, finished=()):
        return types.SimpleNamespace(inputs=inputs, finished_req_ids=set(finished), preempted_req_ids=None,
                                     scheduled_new_reqs=[])

    query_lens = list(prompts.values())
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (sum(query_lens),))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    WORLD.context = fake_context(query_lens)
    runner.execute_model(output((ids, positions)), dummy_run=True)
    runtime = backend.runtimes[0]
    assert runtime.step.profiling and len(runtime.store) == 0
    world = WORLD.context = fake_context(query_lens)
    hidden = runner.execute_model(output((ids, positions)))
    assert runtime.totals.dropping_forwards == 1 and len(runtime.store) == 2
    kept = kept_per_request(runtime.step.points[0], query_lens)
    assert all(len(k) < q for k, q in zip(kept, query_lens))  # both prompts dropped rows
    new = torch.randint(0, VOCAB, (2,))
    WORLD.context = step_context(world, query_lens, [1, 1])
    step = runner.execute_model(output((new, torch.tensor(query_lens))))
    torch._dynamo.reset()
    assert_prefill_and_decode_match_the_reference(model, ids, query_lens, kept, hidden, new, step)
    runner.execute_model(output((new, torch.tensor(query_lens)), finished=["req-0"]), dummy_run=True)
    assert len(runtime.store) == 2  # a dummy run frees nothing: finished ids arrive with real steps
    WORLD.context = step_context(world, [q + 1 for q in query_lens], [1, 1])
    runner.execute_model(output((new, torch.tensor(query_lens) + 1), finished=["req-0"]))
    assert len(runtime.store) == 1 and runtime.store.get("req-0") is None


class TokenAxisSecond(TinyBackbone):
    """Carries a [1, s] value across the drop point: the rewrite cannot follow it."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        row = positions.float()[None, :]  # token axis second
        return super().forward(input_ids, positions) + 0.0 * row.sum()


class OutputSummedOverTokens(TinyBackbone):
    """Returns, beside the hidden states, a sum over tokens: a drop would change it."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = super().forward(input_ids, positions)
        return x, x.sum(0)


@pytest.mark.parametrize(("model_cls", "reason"), [
    (TokenAxisSecond, "depends on the token count"),
    (OutputSummedOverTokens, "is not one row per token"),
], ids=["token-axis-second", "output-summed-over-tokens"])
def test_a_refusal_half_way_leaves_vllms_graph_intact(monkeypatch, model_cls, reason):
    from uniprefill.vllm import runner_hook as hook
    from uniprefill.vllm.plugin import VllmHooks, VllmTokenDropBackend

    model = model_cls().eval()
    hooks = VllmHooks(lambda: WORLD.context, lambda: WORLD.context.request_ids, lambda: None,
                      hook.FinishedListeners())
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64, drop_layers=(1,),
                              vllm_drop=True)
    backend = VllmTokenDropBackend(config, layer_kinds=["full"] * LAYERS, block_size=BLOCK, hooks=hooks)
    query_lens = [200, 120]
    ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    WORLD.context = fake_context(query_lens)
    with torch.no_grad(), pytest.warns(UserWarning, match="unaccelerated"):
        out = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)(ids, positions)
    torch._dynamo.reset()
    report = backend.graphs[0]
    assert not report.rewritten and "refused" in report.reason and reason in report.reason
    WORLD.context = fake_context(query_lens)  # fresh caches: the plain model, run directly
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids, positions), atol=1e-5, rtol=1e-5)


def test_backend_under_tensor_parallelism_sums_scores_over_the_tp_group(model, monkeypatch, tmp_path):
    """TP > 1: refused without a way to reach the TP group; with one (here a one-rank gloo
    group standing in for vLLM's) the runtime selects through it and matches the reference."""
    import torch.distributed as dist

    from uniprefill.vllm import runner_hook as hook
    from uniprefill.vllm.plugin import VllmHooks, VllmTokenDropBackend

    config = UniPrefillConfig(p=0.9, block_size=BLOCK, last_q=16, sink=16, min_tokens=64, drop_layers=(1,),
                              vllm_drop=True)
    query_lens = [200, 120]
    ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(8))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    plain = VllmHooks(lambda: WORLD.context, lambda: WORLD.context.request_ids, lambda: None, hook.FinishedListeners())
    refused = VllmTokenDropBackend(config, layer_kinds=["full"] * LAYERS, block_size=BLOCK, hooks=plain,
                                   tensor_parallel=2)
    WORLD.context = fake_context(query_lens)
    with torch.no_grad(), pytest.warns(UserWarning, match="unaccelerated"):
        torch.compile(model, backend=refused, dynamic=True, fullgraph=True)(ids, positions)
    torch._dynamo.reset()
    assert "tp_group_fn" in refused.graphs[0].reason
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        calls = []
        hooks = dataclasses.replace(plain, tp_group_fn=lambda: calls.append(1) or dist.group.WORLD)
        backend = VllmTokenDropBackend(config, layer_kinds=["full"] * LAYERS, block_size=BLOCK, hooks=hooks,
                                       tensor_parallel=2)
        WORLD.context = fake_context(query_lens)
        with torch.no_grad():
            hidden = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)(ids, positions)
        torch._dynamo.reset()
    finally:
        dist.destroy_process_group()
    runtime = backend.runtimes[0]
    assert backend.graphs[0].rewritten and calls == [1] and runtime.group is not None
    assert sum(runtime.step.points[0].kept) < sum(query_lens), "the case must drop tokens"
    point, qsl = runtime.step.points[0], [0, query_lens[0], sum(query_lens)]
    for r in range(2):
        rows = point.source_rows[(point.source_rows >= qsl[r]) & (point.source_rows < qsl[r + 1])] - qsl[r]
        with torch.no_grad():
            ref = model.reference(ids[qsl[r]:qsl[r + 1]], {1: rows})
        torch.testing.assert_close(hidden[qsl[r + 1] - 1], ref, atol=1e-5, rtol=1e-5)


def test_a_request_that_opted_out_keeps_every_row(model):
    """A request asking for prompt logprobs (or opting out) keeps all its rows; the others drop."""
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    state = {}

    def backend(gm, example_inputs):
        info = analyze_vllm_graph(gm)
        runtime = VllmDropRuntime(config, [s.layer_name for s in info.sites], (1,), lambda: WORLD.context,
                                  lambda name: BLOCK, opted_out_fn=lambda: torch.tensor([True, False]))
        state.update(runtime=runtime, result=rewrite_vllm_graph(gm, info, (1,), ["full"] * LAYERS, runtime))
        return gm.forward

    query_lens = [200, 120]
    ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(9))
    WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        hidden = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)(
            ids, torch.cat([torch.arange(q) for q in query_lens]))
    torch._dynamo.reset()
    runtime = state["runtime"]
    kept = runtime.step.points[0].kept
    assert kept[0] == 200 and kept[1] < 120
    assert runtime.step.reasons.tolist() == [SkipReason.OPTED_OUT, SkipReason.ELIGIBLE]
    with torch.no_grad():
        ref = model.reference(ids[:200], {1: torch.arange(200)})
    torch.testing.assert_close(hidden[199], ref, atol=1e-5, rtol=1e-5)


def test_a_forward_without_attention_metadata_runs_through(model):
    """vLLM's profiling and warm-up runs (`_dummy_run`) carry no attention metadata or no
    request ids: the rewritten graph keeps every row and the sliding layer after the drop runs
    vLLM's own op (zeros without metadata, the plain result with it); the next real step
    drops as usual."""
    window = 24
    config = UniPrefillConfig(keep_ratio=0.4, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, (1,), {0: window, 2: window})
    query_lens = [150, 90]
    ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(10))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    world = fake_context(query_lens)
    world.windows = {world.names[0]: window, world.names[2]: window}
    world.attn_metadata = None  # a dummy run
    world.request_ids = None
    WORLD.context = world
    with torch.no_grad():
        out = compiled(ids, positions)
    runtime = state["runtime"]
    assert out.shape == (sum(query_lens), HIDDEN) and torch.isfinite(out).all()
    assert runtime.step.profiling and not runtime.step.points and len(runtime.store) == 0
    # a warm-up with attention metadata but outside a request step (no request ids): vLLM's
    # own attention runs on vLLM's own metadata, so the result is the plain model's
    warm = WORLD.context = fake_context(query_lens)
    warm.windows, warm.request_ids = world.windows, None
    with torch.no_grad():
        out = compiled(ids, positions)
    assert runtime.step.profiling
    plain = WORLD.context = fake_context(query_lens)
    plain.windows = world.windows
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids, positions), atol=1e-5, rtol=1e-5)
    WORLD.context = fake_context(query_lens)
    WORLD.context.windows = world.windows
    with torch.no_grad():
        compiled(ids, positions)
    torch._dynamo.reset()
    assert not runtime.step.profiling and runtime.step.points[0].kept[0] < 150
    assert (runtime.totals.forwards_without_requests, runtime.totals.forwards) == (1, 1)  # the warm-up; the step


def test_many_forwards_without_request_ids_are_reported_once(model, caplog):
    """An unwrapped model runner (vLLM's V2 before its hook) shows up as forwards with attention
    metadata and no request ids: after a handful (dummy runs) the runtime says so, once."""
    from uniprefill.vllm import drop as vllm_drop

    config = UniPrefillConfig(keep_ratio=0.4, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, (1,))
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(11))
    with caplog.at_level("WARNING", logger=vllm_drop.__name__), torch.no_grad():
        for _ in range(vllm_drop._SILENT_DUMMY_RUNS + 3):
            WORLD.context = fake_context([100])
            WORLD.context.request_ids = None
            compiled(ids, torch.arange(100))
    torch._dynamo.reset()
    warnings = [r for r in caplog.records if "no request ids" in r.getMessage()]
    assert len(warnings) == 1 and "not one uniprefill wraps" in warnings[0].getMessage()
    assert state["runtime"].totals.forwards_without_requests == vllm_drop._SILENT_DUMMY_RUNS + 3


def test_kv_entries_count_each_segment_of_layers_at_its_own_rows():
    """`DropTotals.kv_entries_*` with two drop points (layers 1 and 3 of 6): layers 0-1 write every
    prompt row, 2-3 the rows kept at layer 1, 4-5 those kept at layer 3; a request too short to
    drop counts in neither."""
    from fake_vllm import make_world

    from uniprefill.config import UniPrefillConfig
    from uniprefill.vllm.drop import VllmDropRuntime

    world = make_world([400, 30, 260], layers=6, groups=1, block=16, kv_heads=2, head_size=16)
    config = UniPrefillConfig(keep_ratio=0.5, drop_layers=(1, 3), min_tokens=64, sink=16, last_q=16, block_size=16,
                              impl="torch")
    runtime = VllmDropRuntime(config, world.names, (1, 3), lambda: world, lambda name: 16,
                              request_ids_fn=lambda: world.request_ids)
    assert runtime.segment_layers == [2, 2, 2]
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(690, 2, 16, generator=gen) for _ in range(2))
    runtime.begin_step()
    kept1 = runtime.drop(q, k, 1)
    kept3 = runtime.drop(q[kept1], k[kept1], 3)
    first, second = runtime.step.points
    assert first.entering == [400, 30, 260] and first.kept[1] == 30  # the short request keeps every row
    after1, after3 = first.kept[0] + first.kept[2], second.kept[0] + second.kept[2]
    assert kept3.numel() == sum(second.kept) and after3 < after1 < 660
    totals = runtime.totals
    assert (totals.requests_dropped, totals.rows_in, totals.rows_kept) == (2, 660, after3)
    assert totals.kv_entries_prompt == 660 * 6
    assert totals.kv_entries_written == 2 * 660 + 2 * after1 + 2 * after3
    other = VllmDropRuntime(config, world.names, (0, 4), lambda: world, lambda name: 16)
    assert other.segment_layers == [1, 4, 1]


def test_score_and_select_kernels_are_warmed_up_once_at_the_first_dummy_forward():
    """With `warm_up_max_seqlen` (the backend passes max_model_len on CUDA), the first forward
    without request ids (vLLM's profiling run) compiles the kernels for this drop point's head
    shapes and the engine's settings, once; never inside a CUDA-graph capture, never without it.
    On the H200 that moved 14 compiles (0.9-6.6 s per step that met one) to the engine's start."""
    from fake_vllm import make_world

    world = make_world([300, 40], layers=4, groups=1, block=16, kv_heads=2, head_size=16)
    config = UniPrefillConfig(p=0.9, drop_layers=(1,), min_tokens=64, sink=16, last_q=16, block_size=16, impl="torch")
    calls = []
    runtime = VllmDropRuntime(config, world.names, (1,), lambda: world, lambda name: 16,
                              request_ids_fn=lambda: world.request_ids, warm_up_max_seqlen=4096,
                              warm_up_fn=lambda **kw: calls.append(kw) or "ran")
    q, k = torch.randn(340, 4, 16), torch.randn(340, 2, 16)  # 4 query heads, 2 KV heads
    world.request_ids = None  # a dummy run: no requests
    for _ in range(2):
        runtime.begin_step()
        assert runtime.drop(q, k, 1).numel() == 340
    assert len(calls) == 1 and runtime.totals.kernel_warm_ups == 1
    assert {key: calls[0][key] for key in ("num_heads", "num_kv_heads", "head_dim", "max_seqlen", "p", "keep_ratio")} \
        == {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_seqlen": 4096, "p": 0.9, "keep_ratio": None}
    assert (calls[0]["block_size"], calls[0]["sink"], calls[0]["last_q"], calls[0]["min_tokens"]) == (16, 16, 16, 64)
    assert calls[0]["per_sequence_sink"]  # the variant `selection.select_rows` calls, one sink count per request

    forced = UniPrefillConfig(keep_ratio=0.3, drop_layers=(1,), min_tokens=64, sink=16, last_q=16, block_size=16,
                              impl="torch")
    captured, plain = [], []
    world.cudagraph_runtime_mode = "FULL"  # a capture: the kernels must not be compiled into a graph
    in_capture = VllmDropRuntime(forced, world.names, (1,), lambda: world, lambda name: 16,
                                 request_ids_fn=lambda: world.request_ids, warm_up_max_seqlen=4096,
                                 warm_up_fn=lambda **kw: captured.append(kw))
    in_capture.begin_step()
    in_capture.drop(q, k, 1)
    del world.cudagraph_runtime_mode
    off = VllmDropRuntime(forced, world.names, (1,), lambda: world, lambda name: 16,
                          request_ids_fn=lambda: world.request_ids, warm_up_fn=lambda **kw: plain.append(kw))
    off.begin_step()
    off.drop(q, k, 1)
    assert captured == [] and plain == [] and off.totals.kernel_warm_ups == 0
    in_capture.begin_step()
    in_capture.drop(q, k, 1)  # the next dummy run outside a capture warms up, with the forced ratio
    assert len(captured) == 1 and captured[0]["keep_ratio"] == 0.3


def test_everything_the_rewrite_inserts_is_an_op_and_every_node_gets_a_fake_value(model):
    """No Python callable of uniprefill enters vLLM's graph (the drop point, the step start, the
    scatter and the row check are `torch.library` ops found by `graph_ops.running`), and the
    rewritten graph propagates on fake inputs: each drop point's kept rows are an unbacked size."""
    import inspect

    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from uniprefill.passes.fake_values import propagate_fake_values
    from uniprefill.vllm import graph_ops

    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, (1, 2))
    query_lens = [200, 120]
    ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(3))
    WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        compiled(ids, torch.cat([torch.arange(q) for q in query_lens]))
    torch._dynamo.reset()
    gm = state["gm"]
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if inspect.ismethod(t) or getattr(t, "__module__", "").startswith("uniprefill")]
    ours = {str(t) for t in targets if str(t).startswith("uniprefill.")}
    assert ours == {"uniprefill.vllm_begin_step.default", "uniprefill.vllm_drop.default",
                    "uniprefill.vllm_kept_rows.default", "uniprefill.gather_rows.default",
                    "uniprefill.scatter_rows.default"}
    propagate_fake_values(gm)
    drops = [n for n in gm.graph.nodes if n.target is torch.ops.uniprefill.vllm_drop.default]
    assert len(drops) == 2 and all(free_unbacked_symbols(n.meta["val"].shape) for n in drops)
    gm.graph.eliminate_dead_code()  # what a later compiler may run: the effectful ops stay
    assert {str(n.target) for n in gm.graph.nodes if str(n.target).startswith("uniprefill.")} == ours
    with pytest.raises(RuntimeError, match="outside its forward"):  # the ops need the graph's own forward
        graph_ops.vllm_begin_step(torch.zeros(1))


def test_the_row_kernels_are_warmed_up_at_the_first_dummy_forward_without_max_model_len_and_never_in_a_capture(
        monkeypatch):
    """The layouts' and decode graphs' row kernels (`kernels.layout_rows`) are compiled and checked at the first
    dummy forward outside a capture, whether or not the score kernels' warm-up runs (`warm_up_max_seqlen`): a decode
    graph's capture launches two of them, and a first compile inside a capture must not happen."""
    from fake_vllm import make_world

    import uniprefill.kernels.layout_rows as layout_rows

    calls = []
    monkeypatch.setattr(layout_rows, "warm_up", lambda device, impl: calls.append((device.type, impl)) or 7)
    world = make_world([40], layers=4, groups=1, block=16, kv_heads=2, head_size=16)
    config = UniPrefillConfig(p=0.9, drop_layers=(1,), impl="triton")
    runtime = VllmDropRuntime(config, world.names, (1,), lambda: world, lambda name: 16,
                              request_ids_fn=lambda: world.request_ids)
    q, k = torch.randn(40, 4, 16), torch.randn(40, 2, 16)
    world.request_ids = None  # dummy forwards
    world.cudagraph_runtime_mode = "FULL"  # a capture first: nothing compiled
    runtime.begin_step()
    runtime.drop(q, k, 1)
    assert calls == [] and not runtime.row_kernels_warmed
    del world.cudagraph_runtime_mode
    for _ in range(2):
        runtime.begin_step()
        runtime.drop(q, k, 1)
    assert calls == [("cpu", "triton")] and runtime.row_kernels_warmed and runtime.totals.kernel_warm_ups == 0
