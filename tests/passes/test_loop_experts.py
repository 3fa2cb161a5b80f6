"""MoE layers whose routing reaches Python: DBRX's experts loop as `uniprefill::routed_experts`
(compat.make_experts_opaque), and JetMoE's `.tolist()` of routing counts traced as unbacked sizes
that the rewrite recomputes from the kept tokens (passes/shape_exprs.py). Without either, dynamo
breaks the graph at every MoE layer and nothing is dropped."""

from __future__ import annotations

import torch

import uniprefill
from uniprefill import UniPrefillConfig, compat, expert_ops

SETTINGS = dict(sink=16, last_q=16, block_size=16, drop_layers="all")


def _dbrx():
    from transformers import DbrxConfig, DbrxForCausalLM

    config = DbrxConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, max_seq_len=512,
                        attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
                        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
                        pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return DbrxForCausalLM._from_config(config, attn_implementation="sdpa").eval()


def _jetmoe():
    from transformers import JetMoeConfig, JetMoeForCausalLM

    config = JetMoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                          num_key_value_heads=2, kv_channels=8, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=512, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return JetMoeForCausalLM._from_config(config, attn_implementation="sdpa").eval()


def _ids(rows=1, length=200):
    return torch.randint(3, 64, (rows, length), generator=torch.Generator().manual_seed(1))


def _experts(model):
    return model.transformer.blocks[0].ffn.experts


def test_the_experts_op_is_the_module_at_every_token_count_and_its_fake_agrees():
    model = _dbrx()
    experts = _experts(model)
    key = expert_ops.register(experts)
    forward = expert_ops.original_forward(type(experts))
    for tokens in (1, 7, 64):
        hidden = torch.randn(1, tokens, 32)
        index = torch.randint(0, 4, (tokens, 2))
        weights = torch.rand(tokens, 2)
        with torch.no_grad():
            out = torch.ops.uniprefill.routed_experts(hidden, index, weights, key)
            assert torch.equal(out, forward(experts, hidden, index, weights))
        torch.library.opcheck(torch.ops.uniprefill.routed_experts.default, (hidden, index, weights, key),
                              test_utils=("test_schema", "test_faketensor"))


def test_experts_patch_is_idempotent_reversible_and_leaves_eager_calls_alone():
    model = _dbrx()
    cls = type(_experts(model))
    compat.restore_experts(model)  # a known start: an earlier test may have patched the class
    original = cls.forward
    ids = _ids()
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        assert compat.make_experts_opaque(model) == [f"{cls.__module__}.{cls.__qualname__}"]
        assert compat.make_experts_opaque(model) == []  # idempotent
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, plain)  # eager: the class's own forward
        assert compat.restore_experts(model) == [f"{cls.__module__}.{cls.__qualname__}"]
    assert cls.forward is original


def test_dbrx_is_one_graph_p1_equals_the_plain_model_and_keep_half_drops():
    model = _dbrx()
    ids = _ids()
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :37] = 0
    with torch.no_grad():
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, **SETTINGS))
        out = exact(input_ids=ids, use_cache=False).logits
        assert exact.backend.last_unaccelerated is None
        assert torch.allclose(out, model(input_ids=ids, use_cache=False).logits, atol=1e-5)
        assert [r.rewritten for r in uniprefill.graph_reports(exact)] == [True]  # embedding and layers: one graph
        two = _ids(2)
        assert torch.allclose(exact(input_ids=two, attention_mask=mask, use_cache=False).logits[:, -1],
                              model(input_ids=two, attention_mask=mask, use_cache=False).logits[:, -1], atol=1e-5)
        torch._dynamo.reset()
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, **SETTINGS))
        assert torch.isfinite(fast(input_ids=ids, use_cache=False).logits).all()
        report = uniprefill.last_drop_report(fast)
        assert report is not None and report.points and report.overall_retention < 1
    torch._dynamo.reset()


def test_jetmoe_routing_counts_are_recomputed_from_the_kept_tokens():
    model = _jetmoe()
    ids = _ids()
    with torch.no_grad():
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, **SETTINGS))
        out = exact(input_ids=ids, use_cache=False).logits
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        assert torch.allclose(out, model(input_ids=ids, use_cache=False).logits, atol=1e-5)
        torch._dynamo.reset()
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, **SETTINGS))
        assert torch.isfinite(fast(input_ids=ids, use_cache=False).logits).all()
        report = uniprefill.last_drop_report(fast)
        assert report is not None and report.points and report.overall_retention < 1
    torch._dynamo.reset()
