"""Refusals that remain say why in words a user understands (issue 19), and pieces of a model
split by graph breaks do not hide the reason of the graph that holds the layers.

Each case below is a tiny Llama changed in one way, as a model type of the census is: attention
whose keys are chosen by top-k (DeepSeek sparse attention, Doge), a mask computed from the
activations (Doge's dynamic mask), bidirectional attention (BERT-generation without
`is_decoder`), a layer run twice on its own output (Dory's recurrent section), attention in two
module lists (HRM's two stacks), and a graph break before the LM head (CTRL, JetMoE). Every
refused call still equals the plain model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.passes.graph_pieces import why_no_tokens
from uniprefill.unaccelerated import Kind

SMALL = dict(sink=16, last_q=16, block_size=16)


def _llama(attention: str = "sdpa", layers: int = 3):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _compiled_run(model, config=None):
    """The compiled model's backend after one 200-token call, whose logits equal the plain model's."""
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = uniprefill.compile(model, config or UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        out = compiled(input_ids=ids, use_cache=False).logits
        ref = model(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    return compiled.backend


def _with_attention(name, mask_fn, is_causal=False):
    def attention(module, q, k, v, attention_mask, scaling, dropout=0.0, **kwargs):
        mask = mask_fn(module, q, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    return _llama(name)


def _causal(q, k):
    return torch.arange(k.shape[-2])[None, :] <= torch.arange(q.shape[-2])[:, None]


def _top_k_keys(module, q, k, v):  # each query keeps its 8 best-scoring earlier keys (sparse attention)
    scores = (q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)).masked_fill(
        ~_causal(q, k), float("-inf"))
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, scores.topk(8, dim=-1).indices, True)
    return chosen & _causal(q, k)


def _per_key_bias(module, q, k, v):  # a bias per key computed from the values (Doge's dynamic mask)
    bias = v.mean(dim=(1, 3))[:, None, None, :]
    return torch.where(_causal(q, k), bias, torch.finfo(q.dtype).min)


@pytest.mark.parametrize("name, mask_fn, words", [
    ("uniprefill_test_top_k", _top_k_keys, "sparse attention: the keys each query attends are chosen by top-k"),
    ("uniprefill_test_key_bias", _per_key_bias, "a data-dependent mask: it is computed from the layer's activations"),
], ids=["top-k keys", "per-key bias"])
def test_a_data_dependent_mask_is_named_for_what_it_is(name, mask_fn, words):
    backend = _compiled_run(_with_attention(name, mask_fn))
    reason = backend.graphs[-1].reason
    assert not backend.graphs[-1].rewritten and words in reason, reason
    assert "mask built with" not in reason and "role not understood" not in reason


def test_bidirectional_attention_is_reported_as_not_a_causal_decoder():
    backend = _compiled_run(_with_attention("uniprefill_test_bidirectional", lambda module, q, k, v: None))
    reason = backend.last_unaccelerated
    assert reason.startswith("graph not rewritten: not a causal decoder: every attention layer is bidirectional"), reason
    assert reason.kind is Kind.GRAPH_NOT_FOLLOWED


class _Twice(nn.Module):
    """A decoder layer applied twice to its own output (a looped, recurrent-depth stack)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, **kwargs):
        return self.layer(self.layer(hidden_states, **kwargs), **kwargs)


def test_a_layer_run_twice_on_its_own_output_is_named_a_looped_stack():
    model = _llama()
    model.model.layers[1] = _Twice(model.model.layers[1])
    reason = _compiled_run(model).graphs[-1].reason
    assert reason.startswith("layer 1 runs 2 times, each run on the output of the one before"), reason


class _Stack(nn.Module):
    """A layer that holds a module list of its own (a second stack, as HRM's two)."""

    def __init__(self, layer):
        super().__init__()
        self.stack = nn.ModuleList([layer])

    def forward(self, hidden_states, **kwargs):
        return self.stack[0](hidden_states, **kwargs)


def test_attention_in_two_module_lists_is_named():
    model = _llama()
    model.model.layers[1] = _Stack(model.model.layers[1])
    reason = _compiled_run(model).graphs[-1].reason
    assert reason.startswith("the attention calls sit in 2 module lists (model.layers, model.layers.1.stack)"), reason


class _BreakFirst(nn.Module):
    """The LM head behind a graph break: dynamo compiles it as a graph of its own."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, hidden_states):
        torch._dynamo.graph_break()
        return self.head(hidden_states)


def test_a_piece_without_layers_after_a_graph_break_does_not_hide_the_acceleration():
    model = _llama()
    model.lm_head = _BreakFirst(model.lm_head)
    backend = _compiled_run(model)
    rewritten = [g for g in backend.graphs if g.rewritten]
    pieces = [g for g in backend.graphs if not g.rewritten]
    assert len(rewritten) == 1 and rewritten[0].counts, backend.graphs
    assert pieces and all(g.reason.startswith("this graph holds no decoder layer") for g in pieces)
    # before, the LM head's graph ran last and reported "no token-id input" for an accelerated call
    assert backend.last_unaccelerated is None
    assert backend.graphs_with_layers == 1


def test_a_piece_without_layers_keeps_the_reason_of_the_graph_with_layers():
    model = _with_attention("uniprefill_test_bidirectional_split", lambda module, q, k, v: None)
    model.lm_head = _BreakFirst(model.lm_head)
    backend = _compiled_run(model)
    assert "not a causal decoder" in backend.last_unaccelerated, backend.last_unaccelerated


def _embedding_graph(prepare):
    def f(ids, weight):
        return F.embedding(prepare(ids), weight)

    gm = fx.symbolic_trace(f)
    ids, weight = gm.graph.find_nodes(op="placeholder")
    ids.meta["example_value"] = torch.zeros(1, 8, dtype=torch.long)
    weight.meta["example_value"] = torch.zeros(16, 4)
    return gm.graph


@pytest.mark.parametrize("prepare, ops", [
    (lambda ids: ids.transpose(0, 1).contiguous(), "transpose, contiguous"),
    (lambda ids: torch.cat([torch.zeros(1, 4, dtype=ids.dtype), ids], dim=1), "cat"),
], ids=["time-major", "tokens prepended"])
def test_an_embedding_off_the_prompts_token_axis_names_the_ops(prepare, ops):
    reason = why_no_tokens(_embedding_graph(prepare), None)
    assert reason.startswith(f"the embedding reads the prompt's token ids through {ops}"), reason


class _RoutedMLP(nn.Module):
    """An MLP behind a top-k router (as an MoE layer's): its top-k is no attention's selection."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        gate = torch.zeros_like(x).scatter(-1, x.topk(8, dim=-1).indices, 1.0)
        return self.mlp(x) * (1 + gate)


def test_a_routers_top_k_upstream_is_not_read_as_sparse_attention():
    model = _with_attention("uniprefill_test_key_bias_routed", _per_key_bias)
    model.model.layers[0].mlp = _RoutedMLP(model.model.layers[0].mlp)
    reason = _compiled_run(model).graphs[-1].reason
    assert "a data-dependent mask" in reason and "sparse attention" not in reason, reason


def _with_block_keys(name):
    """Attention over the tokens and one extra key per 16 tokens (a pooled block, as DeepSeek-V4's
    compressed entries), every extra key visible."""
    def attention(module, q, k, v, attention_mask, scaling, dropout=0.0, **kwargs):
        k = torch.cat([k, k[:, :, ::16]], dim=2)
        v = torch.cat([v, v[:, :, ::16]], dim=2)
        n = q.shape[-2]
        mask = torch.cat([_causal(q, q), torch.ones(n, k.shape[2] - n, dtype=torch.bool)], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    return _llama(name)


def test_keys_beside_the_tokens_are_named():
    reason = _compiled_run(_with_block_keys("uniprefill_test_block_keys")).graphs[-1].reason
    assert "in every attention layer, its keys are more than the prompt's tokens (N + " in reason, reason
    assert "key entries for N tokens" in reason, reason
