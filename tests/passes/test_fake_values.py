"""`propagate_fake_values`: every node of a rewritten graph gets a `meta["val"]`, with the kept
count as an unbacked size after a drop point and the prompt length before it."""

from __future__ import annotations

import torch
import torch._dynamo
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from transformers import AutoModelForCausalLM, LlamaConfig

from uniprefill import UniPrefillConfig
from uniprefill.passes.fake_values import propagate_fake_values
from uniprefill.passes.token_drop import TokenDropPass


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _uniprefill_ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("uniprefill.")]


@torch.no_grad()
def test_every_node_of_a_rewritten_graph_gets_a_fake_value_with_the_kept_count():
    model = _llama()
    seen = {}

    def backend(gm, example_inputs):
        config = UniPrefillConfig(p=1.0, drop_layers=(1, 2), sink=16, last_q=16, block_size=16)
        result = TokenDropPass(gm, config).run()
        graph = result.graph_module
        assert any("val" not in n.meta and "example_value" not in n.meta for n in _uniprefill_ops(graph))
        seen["count"] = propagate_fake_values(graph)
        seen["graph"] = graph
        return graph.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    ids = torch.randint(0, 128, (1, 300))
    out = compiled(input_ids=ids, use_cache=False).logits  # the graph still runs after the propagation
    torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)
    graph = seen["graph"]
    nodes = [n for n in graph.graph.nodes if n.op != "output"]
    assert seen["count"] == len(nodes) and all("val" in n.meta for n in nodes)
    by_op = {}
    for node in _uniprefill_ops(graph):
        by_op.setdefault(str(node.target).split(".")[1], []).append(node)
    assert len(by_op["score_select"]) == 2  # one per drop point
    kept = [free_unbacked_symbols(n.meta["val"][0].shape[0]) for n in by_op["score_select"]]
    assert all(len(symbols) == 1 for symbols in kept) and kept[0] != kept[1]  # a fresh kept count per point
    for node in by_op["gather_tokens"]:  # gathered values are sized by a kept count, never by N
        assert free_unbacked_symbols(node.meta["val"].shape), node.format_node()
    for node in by_op["scatter_tokens"]:  # scattered back to the prompt length
        assert not free_unbacked_symbols(node.meta["val"].shape), node.format_node()
    for node in by_op.get("record_drop", []):
        assert node.meta["val"] is None
    torch._dynamo.reset()


@torch.no_grad()
def test_debug_dump_after_the_rewrite_shows_the_kept_sizes(caplog):
    import logging

    import uniprefill

    torch._dynamo.reset()
    fast = uniprefill.compile(_llama(), UniPrefillConfig(p=1.0, drop_layers=(1,), debug=True, sink=16,
                                                         last_q=16, block_size=16))
    with caplog.at_level(logging.INFO, logger="uniprefill.passes"):
        fast(input_ids=torch.randint(0, 128, (1, 300)), use_cache=False)
    after = [r.getMessage() for r in caplog.records if "graph after rewrite" in r.getMessage()]
    assert after and "u0" in after[0]  # the packed tensors' annotations name the kept count
    torch._dynamo.reset()
