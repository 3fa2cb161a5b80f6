"""DeepSeek sparse attention (DSA) layers on kept tokens (`passes/indexer_mask.py`).

A DSA layer's mask keeps, per query, the top min(index_topk, N) keys of the layer's own indexer. At
p = 1 the rewritten graph equals the plain model (one row, left-padded rows); after a drop the DSA
layers run on the kept tokens, which equals the model's own modules run eagerly on those tokens at
their ORIGINAL positions, with the top-k selecting (index_topk < kept count) and without (index_topk
above it). Top-k masks of other forms stay refused (negative tests).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.testing.census import tiny_config
from uniprefill.testing.eager_reference import dropped_run

SMALL = dict(sink=16, last_q=16, block_size=16)
ATOL = 1e-4
LENGTH = 120


def _model(index_topk: int):
    """The census's tiny DeepSeek-V3.2 with a small indexer (4 heads of 32) keeping `index_topk` keys."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("deepseek_v32")
    config.index_topk, config.index_n_heads, config.index_head_dim = index_topk, 4, 32
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _ids(rows: int = 1):
    return torch.randint(3, 128, (rows, LENGTH), generator=torch.Generator().manual_seed(1))


def test_p1_equals_the_plain_model_one_row_and_padded_rows():
    model = _model(index_topk=32)  # top-k selects: 32 of up to 120 keys
    ids = _ids(2)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        one = exact(input_ids=ids[:1], use_cache=False).logits[:, -1]
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        assert uniprefill.last_drop_report(exact).points, "the prefill went through the rewritten graph"
        report = next(r for r in uniprefill.graph_reports(exact) if r.rewritten)
        assert [str(layer.kind) for layer in report.layers] == ["full"] * 4
        assert report.counts["indexer_attention"] == 4 and report.counts["packed_visibility"] == 3
        torch.testing.assert_close(one, model(input_ids=ids[:1], use_cache=False).logits[:, -1], atol=ATOL, rtol=0)
        two = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
        torch.testing.assert_close(two, model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1],
                                   atol=ATOL, rtol=0)
    torch._dynamo.reset()


def _reference(model, ids: torch.Tensor, kept: dict[int, torch.Tensor]) -> torch.Tensor:
    """Last-token logits of DeepSeek-V3.2 run layer by layer, cutting the stream after the attention of
    each drop layer L to the ORIGINAL positions `kept[L]`: every later attention (its indexer included)
    on the live tokens, RoPE at their original positions, a causal mask in original position order."""
    h = model.model.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])
    for idx, layer in enumerate(model.model.layers):
        x = layer.input_layernorm(h)
        causal = torch.ones(pos.numel(), pos.numel(), dtype=torch.bool).tril()[None, None]
        out, _ = layer.self_attn(hidden_states=x, position_embeddings=model.model.rotary_emb(x, pos[None]),
                                 attention_mask=causal, position_ids=pos[None])
        h = h + out
        if idx in kept:
            take = torch.searchsorted(pos, kept[idx])
            assert torch.equal(pos[take], kept[idx]), "kept positions must be a subset of the live ones"
            h, pos = h[:, take], kept[idx]
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))[:, -1]


@pytest.mark.parametrize("index_topk", [16, 2048], ids=["top-k selects", "top-k keeps every key"])
def test_a_drop_runs_the_later_dsa_layers_on_the_kept_tokens_as_the_reference_does(index_topk):
    model = _model(index_topk)
    ids = _ids()
    out, kept, full = dropped_run(model, ids, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
    with torch.no_grad():
        ref = _reference(model, ids, kept)
    assert kept and min(kept) < len(model.model.layers) - 1, "a drop before a later DSA layer"
    assert all(k.numel() <= 0.6 * LENGTH for k in kept.values()), "the drops must drop tokens"
    if index_topk < LENGTH:
        assert min(k.numel() for k in kept.values()) > index_topk, "the top-k must select among the kept tokens"
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert (out - full).abs().max() > 10 * ATOL, "dropping must change the answer of a random model"


# ------------------------------------------------------------------ other top-k masks stay refused
def _causal(q, k):
    return torch.arange(k.shape[-2])[None, :] <= torch.arange(q.shape[-2])[:, None]


def _dsa_like(k_of, largest=True, fill=True):
    """The DSA form with the indexer's scores q.k; `k_of(N)` keys kept, `largest`, `fill` (the causal fill)."""
    def mask_fn(q, k):
        visible = _causal(q, k)[None, None]
        scores = (q @ k.transpose(-1, -2)).mean(1)  # [B, N, N]
        if fill:
            scores = scores.masked_fill(~visible[:, 0], float("-inf"))
        chosen = scores.topk(k_of(scores.shape[-1]), dim=-1, largest=largest).indices
        dropped = torch.ones_like(scores, dtype=torch.bool).scatter(-1, chosen, False)[:, None]
        return visible & ~dropped
    return mask_fn


@pytest.mark.parametrize("mask_fn, words", [
    (_dsa_like(lambda n: 8), "not min(constant, keys)"),  # a constant k (Doge's keep_window)
    (_dsa_like(lambda n: min(8, n), largest=False), "keeps the smallest scores"),
    (_dsa_like(lambda n: min(8, n), fill=False), "not masked by the attention's own causal mask"),
], ids=["constant k", "smallest", "no causal fill"])
def test_other_top_k_masks_stay_refused(mask_fn, words):
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    def attention(module, q, k, v, attention_mask, scaling, dropout=0.0, **kwargs):
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_fn(q, k), scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    name = "uniprefill_test_dsa_like"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)
    cfg._attn_implementation = name
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        compiled(input_ids=_ids(), use_cache=False)
    torch._dynamo.reset()
    reason = compiled.backend.graphs[-1].reason
    assert not compiled.backend.graphs[-1].rewritten and "sparse attention" in reason and words in reason, reason
