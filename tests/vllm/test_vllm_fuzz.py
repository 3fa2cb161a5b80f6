"""A differential fuzzer of the vLLM door (mode 3, vLLM's default) on CPU: random steps against the
standard compile and against the eager rewrite.

Each case is one random step of the fake vLLM (`fake_vllm.py`): 1-5 requests, each a fresh prompt, the
last chunk of a longer prompt (context cached, `num_prompt_tokens` says where it ends), a continuation
without a drop (context, prompt already done) or a decode token, in a random order, over paged caches
filled with random values (the cached context). Three engines see the same step:

* standard: the model compiled by the stand-in of vLLM's backend (`fake_vllm_compile.py`: split at the
  attention ops, Inductor per piece) without the option;
* p = 1: the same with `{"p": 1.0, "vllm_drop": true}` at random drop layers: every output bit equal
  to standard's (`torch.equal`), as on the H200 (120 of 120 prompts, every logprob). Inductor's C++ kernels
  here sum alike with or without the H200's fixes; the Triton side is `test_triton_pieces_on_cpu.py`'s;
  every third step as a replay of vLLM's piecewise CUDA graphs (the drop point then keeps every row);
* keep 0.5: forced dropping under mode 3 against the same rewrite run eagerly (mode 2, no Inductor):
  equal within float tolerance, and the drop points agree on every request's kept count.

And multi-step cases (prompts that drop, then uniform decode steps; sliding layers with random windows or
none): decode down the path of vLLM's default full decode graphs equals eager decode.

The seeds are fixed (a failure names its case); `CASES` per parametrized group (half for the multi-step cases).
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from fake_vllm import make_world, step
from fake_vllm_model import BLOCK, HEADS, DIM, LAYERS, VOCAB, WORLD, TinyBackbone, compile_with_drops
from test_vllm_piecewise import SETTINGS, compile_mode3, runtimes  # noqa: F401  (the fixture)
from uniprefill.config import UniPrefillConfig

CASES = 8
KINDS = ("prompt", "last_chunk", "continuation", "decode")


def random_step(seed: int):
    """(world, ids, positions, description) of one random step; the caches hold random context."""
    rng = random.Random(seed)
    requests = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(KINDS)
        ctx = 0 if kind == "prompt" else rng.randint(1, 300)
        qlen = 1 if kind == "decode" else rng.randint(2, 400)
        requests.append((kind, ctx, qlen))
    if sum(q for _, _, q in requests) < 2:  # a one-token step would make dynamo specialise (a recompile)
        requests.append(("prompt", 0, rng.randint(2, 50)))
    ctxs, qlens = [c for _, c, _ in requests], [q for _, _, q in requests]
    world = make_world([c + q for c, q in zip(ctxs, qlens)], layers=LAYERS, groups=2, block=BLOCK, kv_heads=HEADS,
                       head_size=DIM, room=0, request_prefix=f"case{seed}-")
    step(world, ctxs, qlens)
    gen = torch.Generator().manual_seed(seed)
    for cache in world.kv_caches.values():
        cache.copy_(torch.randn(cache.shape, generator=gen))
    # where each prompt ends: a last chunk's prompt ends with this step; a continuation's and a decode's before it
    world.num_prompt_tokens = torch.tensor([c + q if kind in ("prompt", "last_chunk") else c
                                            for kind, c, q in requests])
    ids = torch.randint(0, VOCAB, (sum(qlens),), generator=gen)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(ctxs, qlens)])
    return world, ids, positions, requests


def run(compiled, seed: int, piecewise_graphs: bool = False, sliding: tuple[tuple[int, ...], int] | None = None):
    """The step of `seed` through `compiled`; with `piecewise_graphs` every third step runs as a replay
    of vLLM's piecewise CUDA graphs (the forward context says PIECEWISE: the drop point keeps every row);
    `sliding` (layers, window): those layers' attention slides (the fake vLLM's FlashAttention windows them)."""
    world, ids, positions, requests = random_step(seed)
    if sliding is not None:
        world.windows = {world.names[i]: sliding[1] for i in sliding[0]}
    if piecewise_graphs and seed % 3 == 0:
        world.cudagraph_runtime_mode = types.SimpleNamespace(name="PIECEWISE")
        requests = [*requests, "piecewise graphs"]
    WORLD.context = world
    with torch.no_grad():
        return compiled(ids, positions), requests


def drop_layers_of(group: int) -> list[int]:
    return sorted(random.Random(1000 + group).sample(range(LAYERS - 1), random.randint(1, 2)))


def sliding_layers_of(group: int, drops: list[int]) -> tuple[tuple[int, ...], int]:
    """Sliding layers (at least one after the first drop point, none a drop layer) and their window."""
    rng = random.Random(2000 + group)
    after = [i for i in range(drops[0] + 1, LAYERS) if i not in drops]
    layers = {rng.choice(after)} | {i for i in range(LAYERS) if i not in drops and rng.random() < 0.4}
    return tuple(sorted(layers)), rng.choice([8, 24, 64])


@pytest.mark.parametrize("group, sliding", [(0, False), (1, False), (2, False), (3, True)],
                         ids=["group0", "group1", "group2", "group3-sliding"])
def test_p1_equals_standard_bit_for_bit_on_random_steps(runtimes, group, sliding):  # noqa: F811
    """With `sliding`, some layers slide (Gemma-3's kind), at least one after a drop point: at p = 1 they run vLLM's
    own attention there (`StepDrops.vllm_windows`), so every bit stays standard's."""
    model = TinyBackbone().eval()
    drops = drop_layers_of(group)
    windows = sliding_layers_of(group, drops) if sliding else None
    seeds = [group * CASES + i for i in range(CASES)]
    outputs = {}
    for name, settings in (("standard", None), ("p1", {**SETTINGS, "keep_ratio": None, "p": 1.0,
                                                         "drop_layers": drops})):
        torch._dynamo.reset()
        compiled, _ = compile_mode3(model, settings, sliding=windows)
        outputs[name] = [run(compiled, seed, piecewise_graphs=True, sliding=windows) for seed in seeds]
    assert [p.layer for p in runtimes[-1].step.points] == drops  # the p = 1 engine ran its drop points
    if sliding:  # a sliding layer after a drop point took vLLM's attention
        assert runtimes[-1].windows and runtimes[-1].step.vllm_windows
    for seed, (standard, requests), (p1, _) in zip(seeds, outputs["standard"], outputs["p1"]):
        assert torch.equal(standard, p1), f"case {seed} {requests}: max |diff| {(standard - p1).abs().max()}"


@pytest.mark.parametrize("group", [0, 1])
def test_dropping_under_mode_3_equals_the_eager_rewrite_on_random_steps(runtimes, group):  # noqa: F811
    model = TinyBackbone().eval()
    drops = drop_layers_of(group)
    settings = {**SETTINGS, "drop_layers": drops}
    config = UniPrefillConfig(**{k: v for k, v in settings.items() if k != "vllm_drop"})
    seeds = [100 + group * CASES + i for i in range(CASES)]
    torch._dynamo.reset()
    eager, state = compile_with_drops(model, config, tuple(drops))
    references = []
    for seed in seeds:
        out, requests = run(eager, seed)
        references.append((out, requests, [p.kept for p in state["runtime"].step.points]))
    torch._dynamo.reset()
    compiled, _ = compile_mode3(model, settings)
    dropped = 0
    for seed, (reference, requests, kept) in zip(seeds, references):
        ours, _ = run(compiled, seed)
        points = runtimes[-1].step.points
        assert [p.kept for p in points] == kept, f"case {seed} {requests}"
        dropped += sum(points[-1].kept) < sum(points[0].entering)
        torch.testing.assert_close(ours, reference, atol=2e-5, rtol=2e-5, msg=f"case {seed} {requests}")
    assert dropped >= CASES // 4  # the cases exercise dropping, not only steps that keep every row


def decode_scenario(seed: int):
    """(drop layers, windows by layer, prompt lengths, decode steps, first chunks) of one random multi-step case;
    first chunks: None (each prompt prefills in one step), or per prompt the tokens of a first step that does not
    drop, so the last chunk drops with its context in the cache."""
    rng = random.Random(seed)
    drops = (1,) if rng.random() < 0.5 else (1, 2)
    windows = {}
    if rng.random() < 0.6:  # a Gemma-like model: sliding layers, at least one after the last drop point
        window = rng.choice([8, 24, 64, 200])
        windows = {layer: window for layer in (0, 2, 3) if rng.random() < 0.5 and layer not in drops}
        windows[3] = window
    prompts = [rng.randint(2, 400) for _ in range(rng.randint(2, 5))]
    decode_steps = rng.randint(2, 4)
    first = [rng.randint(1, q - 1) for q in prompts] if rng.random() < 0.4 else None
    return drops, windows, prompts, decode_steps, first


def run_decode_scenario(seed: int, decode_graphs: bool):
    """Prefill (eager: some prompts drop) then uniform decode steps, eagerly or down the path of vLLM's full
    decode graphs (forward context FULL, the device tables refilled by `before_step`); the decode outputs."""
    drops, windows, prompts, steps, first = decode_scenario(seed)
    model = TinyBackbone().eval()
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    torch._dynamo.reset()
    compiled, state = compile_with_drops(model, config, drops, windows, graph_decode_max_reqs=8 if decode_graphs else 0)
    world = make_world(prompts, layers=LAYERS, groups=2, block=BLOCK, kv_heads=HEADS, head_size=DIM, room=steps,
                       request_prefix=f"dec{seed}-")
    world.windows = {world.names[i]: w for i, w in windows.items()}
    WORLD.context = world
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(prompts),), generator=gen)
    with torch.no_grad():
        if first is None:
            compiled(ids, torch.cat([torch.arange(q) for q in prompts]))
        else:  # a first chunk (kept whole), then the last chunks drop with their context in the cache
            world.num_prompt_tokens = torch.tensor(prompts)
            offsets = [0] + torch.tensor(prompts).cumsum(0).tolist()
            for done, todo in ((([0] * len(prompts)), first), (first, [q - f for q, f in zip(prompts, first)])):
                step(world, done, todo)
                chunk = torch.cat([ids[o + d:o + d + t] for o, d, t in zip(offsets, done, todo)])
                compiled(chunk, torch.cat([torch.arange(d, d + t) for d, t in zip(done, todo)]))
    runtime = state["runtime"]
    outputs = []
    for decoded in range(steps):
        computed = [q + decoded for q in prompts]
        step(world, computed, [1] * len(prompts))
        if decode_graphs:
            world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
            runtime.before_step(tuple(world.request_ids))
        with torch.no_grad():
            outputs.append(compiled(torch.randint(0, VOCAB, (len(prompts),), generator=gen), torch.tensor(computed)))
    torch._dynamo.reset()
    return outputs, runtime.totals


@pytest.mark.parametrize("group", [0, 1])
def test_decode_down_the_full_graph_path_equals_eager_decode_on_random_cases(group):
    """Multi-step cases (2-5 prompts, some prefilled in two chunks so that the last chunk drops with context, 1-2
    drop points, sliding layers with windows of 8-200 tokens or none, 2-4 decode steps): the decode outputs computed through the capture path (what vLLM's default full decode
    graphs replay: the later layers' lengths and slots, and sliding layers' windows, counted on the device)
    equal eager decode's, whose host path `test_vllm_rewrite.py` checks against the reference model."""
    for seed in range(500 + group * CASES // 2, 500 + (group + 1) * CASES // 2):
        eager, eager_totals = run_decode_scenario(seed, decode_graphs=False)
        graphed, graph_totals = run_decode_scenario(seed, decode_graphs=True)
        assert graph_totals.decode_graph_captures == len(graphed) and eager_totals.decode_graph_captures == 0
        assert graph_totals.requests_dropped == eager_totals.requests_dropped
        for n, (want, got) in enumerate(zip(eager, graphed)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=f"case {seed} {decode_scenario(seed)}, decode step {n}")


@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager-decode", "decode-graph-path"])
@pytest.mark.parametrize("group", [0, 1])
@pytest.mark.interpreter  # Triton on CPU tensors
def test_the_row_kernels_on_triton_equal_their_reference_through_random_multi_step_cases(monkeypatch, group,
                                                                                         decode_graphs):
    """The layouts' rows, slots and window counts, and the decode graphs' lengths, slots and window rows, from the
    Triton kernels (`kernels.layout_rows`, what runs on a GPU; Triton's interpreter here) instead of their PyTorch
    references, through whole multi-step cases (prompts that drop, last chunks with context, sliding layers, decode
    eagerly or down the full-graph path): every decode output equal, bit for bit."""
    import uniprefill.vllm.drop as drop_module
    import uniprefill.vllm.graph_decode as graph_decode
    from uniprefill.kernels.layout_rows import kernel as triton_kernels

    seeds = range(700 + group * 3, 703 + group * 3)
    reference = {seed: run_decode_scenario(seed, decode_graphs=decode_graphs) for seed in seeds}
    for module, name in ((drop_module, "batch_layout"), (graph_decode, "decode_segment"),
                         (graph_decode, "decode_window")):
        monkeypatch.setattr(module, name, lambda *a, _real=getattr(module, name), **kw: _real(*a, **{**kw,
                                                                                                  "impl": "triton"}))
    launches = {name: 0 for name in ("layout_rows_triton", "window_counts_triton", "decode_segment_triton",
                                     "decode_window_triton")}
    for name in launches:
        def counted(*a, _real=getattr(triton_kernels, name), _name=name, **kw):
            launches[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(triton_kernels, name, counted)
    dropped = 0
    for seed, (want, totals) in reference.items():
        got, got_totals = run_decode_scenario(seed, decode_graphs=decode_graphs)
        assert got_totals.requests_dropped == totals.requests_dropped
        dropped += totals.requests_dropped
        for n, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"case {seed} {decode_scenario(seed)}, decode step {n}"
    ran = {name for name, n in launches.items() if n}
    expected = {"layout_rows_triton", "window_counts_triton"} | (
        {"decode_segment_triton", "decode_window_triton"} if decode_graphs else set())
    assert dropped and ran == expected, launches  # the cases drop, with sliding layers; Triton ran where it should
