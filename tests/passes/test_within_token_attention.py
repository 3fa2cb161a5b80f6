"""A maskless attention call is "bidirectional" only when it attends over the tokens.

Inkling2 (transformers' `inkling2_text`, `inkling2_loop_text`) is causal (the census's probe finds its
earlier logits unchanged by later tokens), yet the pass once refused it as "not a causal decoder:
every attention layer is bidirectional". The SDPA calls it read were the block attention residuals:
each token attends over the outputs of earlier layer blocks (queries and keys of a constant length,
the tokens on another axis), maskless because nothing there is a token. The attention over the
tokens is eager code no pattern matches: causal through an additive mask, with a relative-position
bias computed per query and a sink logit computed per query. The refusal now says that; a truly
bidirectional model (BERT-generation's default config, without `is_decoder`) keeps its reason.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch._dynamo
from transformers import AutoConfig, AutoModelForCausalLM, BertGenerationConfig

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.passes.classify import WITHIN_TOKEN
from uniprefill.unaccelerated import Kind

SMALL = dict(sink=16, last_q=16, block_size=16)
_TINY_INKLING = dict(
    vocab_size=128, unpadded_vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    sliding_window_size=64, rel_extent=128, d_rel=8, moe_intermediate_size=32, n_routed_experts=4,
    num_experts_per_tok=2, n_layers_per_attn_res_block=2, pad_token_id=0, eos_token_id=1,
    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
)


def _inkling(model_type: str):
    default = AutoConfig.for_model(model_type)
    fields = set(inspect.signature(type(default).__init__).parameters) | set(vars(default))
    config = type(default)(**{k: v for k, v in _TINY_INKLING.items() if k in fields})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _refusal(model):
    """The reason of a compiled p = 1 call on 200 tokens, whose logits equal the plain model's."""
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        out = compiled(input_ids=ids, use_cache=False).logits
        ref = model(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    assert compiled.backend.last_unaccelerated
    return compiled.backend.last_unaccelerated, uniprefill.graph_reports(compiled)


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_inkling2_is_refused_for_its_unmatched_eager_attention_not_as_bidirectional(model_type):
    reason, reports = _refusal(_inkling(model_type))
    assert "bidirectional" not in reason, reason
    assert reason.kind is Kind.GRAPH_NOT_FOLLOWED
    assert reason.startswith("graph not rewritten: no full-attention layer in this graph: eager attention (softmax "
                             "over the N x N logits and a sink column"), reason
    # what the rewrite does not model, then what enforces causality
    assert "not matched: a relative-position bias gathered at query-key distances, computed from the activations" \
        in reason
    assert "; sinks computed per query from the activations" in reason
    assert "; masked by an additive mask where(visible, 0, min), a form the rewrite reads (layers: " in reason
    # the block attention residuals: maskless SDPA calls within each token, named as such
    assert f"(layers: 0: other ({WITHIN_TOKEN}); 1: other ({WITHIN_TOKEN});" in reason
    assert not any(report.rewritten for report in reports)


def test_bert_generation_without_is_decoder_keeps_the_bidirectional_reason():
    cfg = BertGenerationConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=512)
    assert not cfg.is_decoder
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    reason, _ = _refusal(model)
    assert reason.startswith("graph not rewritten: not a causal decoder: every attention layer is bidirectional"), \
        reason
    assert WITHIN_TOKEN not in reason
