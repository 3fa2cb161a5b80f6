"""A differential fuzzer of the vLLM door (mode 3, vLLM's default) on CPU: random steps against the
standard compile and against the eager rewrite.

Each case is one random step of the fake vLLM (`fake_vllm.py`): 1-5 requests, each a fresh prompt, the
last chunk of a longer prompt (context cached, `num_prompt_tokens` says where it ends), a continuation
without a drop (context, prompt already done) or a decode token, in a random order, over paged caches
filled with random values (the cached context). Three engines see the same step:

* standard: the model compiled by the stand-in of vLLM's backend (`fake_vllm_compile.py`: split at the
  attention ops, Inductor per piece) without the option;
* p = 1: the same with `{"p": 1.0, "vllm_drop": true}` at random drop layers: every output bit equal
  to standard's (`torch.equal`), the gold standard of the H200 run (120 of 120 prompts, every logprob);
  every third step as a replay of vLLM's piecewise CUDA graphs (the drop point then keeps every row);
* keep 0.5: forced dropping under mode 3 against the same rewrite run eagerly (mode 2, no Inductor):
  equal within float tolerance, and the drop points agree on every request's kept count.

The seeds are fixed (a failure names its case); `CASES` per parametrized group.
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


def run(compiled, seed: int, piecewise_graphs: bool = False):
    """The step of `seed` through `compiled`; with `piecewise_graphs` every third step runs as a replay
    of vLLM's piecewise CUDA graphs (the forward context says PIECEWISE: the drop point keeps every row)."""
    world, ids, positions, requests = random_step(seed)
    if piecewise_graphs and seed % 3 == 0:
        world.cudagraph_runtime_mode = types.SimpleNamespace(name="PIECEWISE")
        requests = [*requests, "piecewise graphs"]
    WORLD.context = world
    with torch.no_grad():
        return compiled(ids, positions), requests


def drop_layers_of(group: int) -> list[int]:
    return sorted(random.Random(1000 + group).sample(range(LAYERS - 1), random.randint(1, 2)))


@pytest.mark.parametrize("group", [0, 1, 2])
def test_p1_equals_standard_bit_for_bit_on_random_steps(runtimes, group):  # noqa: F811
    model = TinyBackbone().eval()
    drops = drop_layers_of(group)
    seeds = [group * CASES + i for i in range(CASES)]
    outputs = {}
    for name, settings in (("standard", None), ("p1", {**SETTINGS, "keep_ratio": None, "p": 1.0,
                                                         "drop_layers": drops})):
        torch._dynamo.reset()
        compiled, _ = compile_mode3(model, settings)
        outputs[name] = [run(compiled, seed, piecewise_graphs=True) for seed in seeds]
    assert [p.layer for p in runtimes[-1].step.points] == drops  # the p = 1 engine ran its drop points
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
