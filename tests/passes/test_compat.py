"""uniprefill.compat, the one place uniprefill changes transformers process-wide: the decode
attention is added to transformers' registries once; the linear-attention fallback is routed
through one op idempotently and reversibly, with identical numbers."""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface

from uniprefill import compat
from uniprefill.runtime.decode_attention import ATTENTION_NAME


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                             num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                             shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(config).eval()


def test_decode_attention_is_registered_once_under_its_own_name():
    compat.register_decode_attention()
    compat.register_decode_attention()
    assert ATTENTION_NAME in AttentionInterface._global_mapping
    assert AttentionInterface._global_mapping["sdpa"].__module__.startswith("transformers")  # nothing replaced


def test_linear_attention_fallback_is_opaque_idempotent_and_reversible():
    model = _qwen3_next()
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    was_patched = bool(compat.restore_linear_attention(model))  # a known start: an earlier test may have patched it
    original = module.torch_chunk_gated_delta_rule
    ids = torch.randint(0, 64, (1, 150), generator=torch.Generator().manual_seed(0))  # > 2 chunks of 64
    with torch.no_grad():
        plain = model(ids).logits
        try:
            assert compat.make_linear_attention_opaque(model) == [module.__name__]
            assert compat.make_linear_attention_opaque(model) == []  # idempotent
            assert module.torch_chunk_gated_delta_rule._uniprefill_original is original
            assert torch.equal(model(ids).logits, plain)  # the op runs the very same function
        finally:
            assert compat.restore_linear_attention(model) == [module.__name__]
        assert module.torch_chunk_gated_delta_rule is original and compat.restore_linear_attention(model) == []
        assert torch.equal(model(ids).logits, plain)
    if was_patched:  # leave the process as the test found it
        compat.make_linear_attention_opaque(model)
