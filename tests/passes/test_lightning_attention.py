"""MiniMax's lightning attention (linear attention in blocks, written inline in its `forward`) as one
op (`uniprefill.lightning_ops`, routed by `compat.make_linear_attention_opaque`).

Traced as it stands, the block loop holds only for prompts with the traced number of blocks; through
`uniprefill::lightning_attention_blocks` it runs on any length: at p = 1 MiniMax equals the plain model,
and after a drop the later lightning layers run on the kept tokens in order, which equals an eager run of
the model's own modules on those tokens.
"""

from __future__ import annotations

import torch
import torch._dynamo

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.compat import make_linear_attention_opaque, restore_linear_attention
from uniprefill.testing.census import tiny_config
from uniprefill.testing.eager_reference import dropped_run

SMALL = dict(sink=16, last_q=16, block_size=16)
ATOL = 1e-4
LENGTH, BLOCK = 120, 16  # 8 lightning blocks; the kept tokens fill fewer


def _model():
    """The census's tiny MiniMax (lightning, full, lightning, full...) with 16-token lightning blocks."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("minimax")
    config.block_size = BLOCK
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _ids(rows: int = 1):
    return torch.randint(3, 128, (rows, LENGTH), generator=torch.Generator().manual_seed(1))


def _lightning_modules(model):
    return [layer.self_attn for layer in model.model.layers if layer.block_type == "linear_attention"]


def test_the_op_is_the_method_at_every_length_and_its_fake_agrees():
    """The op equals transformers' own block loop (the method, before `compat` rebinds it) bit for bit,
    at lengths within one block, on a block boundary and across several; opcheck holds its fake."""
    model = _model()
    restore_linear_attention(model)
    attention = _lightning_modules(model)[0]
    g = torch.Generator().manual_seed(0)
    for length in (1, 5, 16, 17, 40):
        hidden = torch.randn(2, length, model.config.hidden_size, generator=g)
        with torch.no_grad():
            ref_out, ref_state = attention(hidden, None, None)
            make_linear_attention_opaque(model)
            out, state = attention(hidden, None, None)
            restore_linear_attention(model)
        assert torch.equal(out, ref_out) and torch.equal(state, ref_state), length
        heads, dim = attention.num_attention_heads, attention.head_dim
        q, k, v = (torch.randn(2, heads, length, dim, generator=g) for _ in range(3))
        args = (q, k, v, attention.slope_rate, attention.query_decay, attention.key_decay,
                attention.diagonal_decay, BLOCK)
        torch.library.opcheck(torch.ops.uniprefill.lightning_attention_blocks.default, args,
                              test_utils=("test_schema", "test_faketensor"))


def test_patching_is_idempotent_and_reversible():
    model = _model()
    cls = type(_lightning_modules(model)[0])
    restore_linear_attention(model)
    original = cls.__dict__["forward"]
    assert make_linear_attention_opaque(model) == ["transformers.models.minimax.modeling_minimax"]
    assert make_linear_attention_opaque(model) == [] and cls.__dict__["forward"] is not original
    assert restore_linear_attention(model) == ["transformers.models.minimax.modeling_minimax"]
    assert cls.__dict__["forward"] is original


def test_p1_equals_the_plain_model_one_row_padded_rows_and_generation():
    model = _model()
    ids = _ids(2)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        one = exact(input_ids=ids[:1], use_cache=False).logits[:, -1]
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        assert uniprefill.last_drop_report(exact).points, "the prefill went through the rewritten graph"
        torch.testing.assert_close(one, model(input_ids=ids[:1], use_cache=False).logits[:, -1], atol=ATOL, rtol=0)
        two = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
        # several rows: the lightning op would carry one row's state into the next row's packed tokens
        assert "lightning_attention_blocks mixes tokens" in str(exact.backend.last_unaccelerated)
        torch.testing.assert_close(two, model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1],
                                   atol=ATOL, rtol=0)
        gen = exact.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        ref_gen = model.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, ref_gen)
    torch._dynamo.reset()


def _reference(model, ids: torch.Tensor, kept: dict[int, torch.Tensor]) -> torch.Tensor:
    """Last-token logits of MiniMax run module by module, cutting the stream after the attention of each
    drop layer L to the ORIGINAL positions `kept[L]`: full attention with RoPE at the original positions
    and a causal mask over the live tokens; lightning attention over the live tokens in order."""
    h = model.model.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])
    for idx, layer in enumerate(model.model.layers):
        x = layer.input_layernorm(h)
        if layer.block_type == "linear_attention":
            out, _ = layer.self_attn(hidden_states=x, position_embeddings=None, attention_mask=None)
        else:
            causal = torch.ones(pos.numel(), pos.numel(), dtype=torch.bool).tril()[None, None]
            out, _ = layer.self_attn(hidden_states=x, position_embeddings=model.model.rotary_emb(x, pos[None]),
                                     attention_mask=causal)
        h = x * layer.attn_alpha_factor + out * layer.attn_beta_factor
        if idx in kept:
            take = torch.searchsorted(pos, kept[idx])
            assert torch.equal(pos[take], kept[idx]), "kept positions must be a subset of the live ones"
            h, pos = h[:, take], kept[idx]
        x = layer.post_attention_layernorm(h)
        h = x * layer.mlp_alpha_factor + layer.mlp(x) * layer.mlp_beta_factor
    return model.lm_head(model.model.norm(h))[:, -1]


def test_a_drop_runs_the_later_lightning_layers_on_the_kept_tokens_as_the_reference_does():
    model = _model()
    ids = _ids()
    out, kept, full = dropped_run(model, ids, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
    with torch.no_grad():
        ref = _reference(model, ids, kept)
    assert kept and min(kept) < len(model.model.layers) - 1, "a drop before a later lightning layer"
    assert all(k.numel() <= 0.6 * LENGTH for k in kept.values()), "the drops must drop tokens"
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert (out - full).abs().max() > 10 * ATOL, "dropping must change the answer of a random model"
