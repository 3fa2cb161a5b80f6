"""A per-key bias computed from each key's own values (Doge's dynamic mask): the packed op against
the dense one on the kept keys, the pattern recognised in the graph, the compiled model against
the plain one (p = 1) and against the model's own layers run on the kept tokens (p < 1), and the
forms that must stay refused.

Doge's tiny random model has `A = 0`, so its bias is the constant 1 and cannot tell a right bias
from a wrong one: `_doge` sets `A`, `dt_proj` and the residual scales to random non-zero values."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.passes.kept_key_bias import NO_DECODE_REASON
from uniprefill.passes.sink_attention import canonicalize_sink_attention
from uniprefill.sink_ops import sink_attention_reference
from uniprefill.unaccelerated import Kind

transformers = pytest.importorskip("transformers")
doge = pytest.importorskip("transformers.models.doge.modeling_doge")

U = torch.ops.uniprefill
SMALL = dict(sink=16, last_q=16, block_size=16)
LAYERS = 4


def _doge():
    config = transformers.DogeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                     num_attention_heads=4, num_key_value_heads=2, keep_window_size=2048,
                                     max_position_embeddings=4096, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.A.copy_(torch.randn(attn.A.shape, generator=g))
            attn.dt_proj.weight.copy_(2 * torch.randn(attn.dt_proj.weight.shape, generator=g))
            layer.input_residual.copy_(1 + 0.3 * torch.randn(layer.input_residual.shape, generator=g))
            layer.post_attention_residual.copy_(1 + 0.3 * torch.randn(layer.post_attention_residual.shape, generator=g))
    return model


def _ids(rows, n, seed=1):
    return torch.randint(3, 128, (rows, n), generator=torch.Generator().manual_seed(seed))


def _reference(model, ids, kept):
    """Last-token logits of Doge's layers run on the live tokens at their ORIGINAL positions (RoPE,
    causal mask), the residual stream cut to `kept[L]` after layer L's attention."""
    h = model.model.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])
    for idx, layer in enumerate(model.model.layers):
        cos_sin = model.model.rotary_emb(h, pos[None])
        visible = (pos[:, None] >= pos[None, :])[None, None]
        attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), position_embeddings=cos_sin,
                                  attention_mask=visible)
        h = layer.input_residual * h + attn
        if idx in kept:
            take = torch.searchsorted(pos, kept[idx])
            h, pos = h[:, take], kept[idx]
        h = layer.post_attention_residual * h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h)[:, -1:])[:, -1]


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa2"])
def test_packed_op_with_a_following_bias_equals_attention_on_the_kept_keys(heads, kv_heads):
    """Two rows keep different tokens; each row's packed attention equals plain causal attention
    over that row's kept tokens with the bias the layer computed for those keys."""
    g = torch.Generator().manual_seed(3)
    n, d = 40, 8
    q, k, v = (torch.randn(2, h, n, d, generator=g) for h in (heads, kv_heads, kv_heads))
    bias = torch.randn(2, kv_heads, 1, n, generator=g).exp()
    kept = [torch.tensor([0, 3, 4, 9, 17, 30, 39]), torch.arange(0, n, 3)]

    def pack(x):
        return torch.cat([x[r:r + 1, ..., kept[r], :] for r in range(2)], dim=2)

    packed_bias = torch.cat([bias[r:r + 1, ..., kept[r]] for r in range(2)], dim=-1)
    positions = torch.cat(kept)
    counts = torch.tensor([len(kept[0]), len(kept[1])])
    out = U.packed_sink_attention(pack(q), pack(k), pack(v), positions, counts, 0, 0.3, None, None,
                                  key_bias=packed_bias, bias_follows=True)
    start = 0
    for r in range(2):
        sub = [x[r:r + 1, ..., kept[r], :] for x in (q, k, v)]
        ref = sink_attention_reference(*sub, None, 0.3, None, causal=True, key_bias=bias[r:r + 1, ..., kept[r]])
        torch.testing.assert_close(out[:, :, start:start + len(kept[r])], ref, atol=1e-6, rtol=0)
        start += len(kept[r])
    # the dense op on all keys computes the same as the model's own form: the bias added to the logits
    dense = U.dense_sink_attention(q, k, v, None, 0, 0.3, None, None, key_bias=bias)
    groups = heads // kv_heads
    logits = (q @ k.repeat_interleave(groups, 1).transpose(-1, -2)) * 0.3 + bias.repeat_interleave(groups, 1)
    logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), torch.finfo(q.dtype).min)
    torch.testing.assert_close(dense, logits.softmax(-1) @ v.repeat_interleave(groups, 1), atol=1e-6, rtol=0)


def test_the_dynamic_mask_becomes_one_node_per_layer():
    model = _doge()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=True)(input_ids=_ids(1, 64), use_cache=False)
    gm, count, plain = canonicalize_sink_attention(graphs[0])
    assert (count, plain) == (LAYERS, 0)
    sites = [n for n in gm.graph.nodes if n.target is U.sink_attention.default]
    assert len(sites) == LAYERS and all(n.kwargs["bias_follows"] for n in sites)
    assert all(n.kwargs["attn_mask"].meta["example_value"].dtype == torch.bool for n in sites)
    assert all(list(n.kwargs["key_bias"].meta["example_value"].shape)[1:3] == [2, 1] for n in sites)  # [B, Hk, 1, N]
    assert not any("masked_fill" in str(n.target) for n in gm.graph.nodes), "the dynamic masks are gone"
    torch._dynamo.reset()


def test_doge_p1_equals_plain_model_and_generation_runs_unaccelerated():
    model = _doge()
    ids = _ids(2, 96)
    mask = torch.ones_like(ids)
    mask[1, :29] = 0
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        one = exact(input_ids=ids[:1], use_cache=False).logits
        torch.testing.assert_close(one, model(input_ids=ids[:1], use_cache=False).logits, atol=1e-5, rtol=0)
        report = next(r for r in uniprefill.graph_reports(exact) if r.rewritten)
        assert report.counts["sink_attention_sites"] == LAYERS and report.counts["bias_of_kept_keys"] == LAYERS
        assert report.counts["drop_points"] == LAYERS
        assert [p.layer for p in uniprefill.last_drop_report(exact).points] == list(range(LAYERS))
        two = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(two[0], ref[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(two[1, 29:], ref[1, 29:], atol=1e-5, rtol=0)
        # a call that fills a cache runs the original graph, with the reason, before anything runs
        filled = exact(input_ids=ids[:1], use_cache=True)
        why = exact.backend.last_unaccelerated
        assert why is not None and why.kind is Kind.CACHE_NOT_DECODABLE and str(why) == NO_DECODE_REASON
        torch.testing.assert_close(filled.logits, one, atol=1e-5, rtol=0)
        gen = exact.generate(input_ids=ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(gen, model.generate(input_ids=ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0))
        gen2 = exact.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        ref2 = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(gen2, ref2)
    torch._dynamo.reset()


def test_doge_dropping_matches_its_layers_on_the_kept_tokens():
    """p < 1: each kept key keeps the bias its own values give it; a bias read at original positions
    (the ALiBi reading) or left out would not match."""
    model = _doge()
    ids = _ids(1, 200, seed=3)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=(0.5, 0.7), drop_layers=(1, 2), **SMALL))
        out = fast(input_ids=ids, use_cache=False).logits[:, -1]
        history = uniprefill.last_drop_report(fast)
        kept = {p.layer: p.kept_positions(0, 200) for p in history.points}
        ref = _reference(model, ids, kept)
        full = model(input_ids=ids, use_cache=False).logits[:, -1]
        assert torch.allclose(_reference(model, ids, {}), full, atol=1e-5, rtol=0), "the reference is Doge's math"
    assert [p.layer for p in history.points] == [1, 2]
    assert history.points[0].kept[0] < 0.6 * 200, "the drop must really drop tokens"
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    assert (out - full).abs().max() > 1e-3, "dropping must change the answer of a random model"
    torch._dynamo.reset()


def _query_key_bias(self, hidden_states, dt_states, keep_window_size=2048, attention_mask=None):
    """A bias per (query, key): each query scales the keys' bias by its own."""
    min_dtype = torch.finfo(hidden_states.dtype).min
    mask = dt_states[:, :, None, :] * dt_states[:, :, :, None]
    visible = torch.where(attention_mask, 0.0, min_dtype)
    return mask.masked_fill(visible != 0, min_dtype)


def _mixed_key_bias(self, hidden_states, dt_states, keep_window_size=2048, attention_mask=None):
    """A bias per key that mixes tokens (a running sum over the keys): per key, not per token."""
    return _ORIGINAL_MASK(self, hidden_states, dt_states.cumsum(-1), keep_window_size, attention_mask)


_ORIGINAL_MASK = doge.DogeAttention.prepare_dynamic_mask


@pytest.mark.parametrize("form", [_query_key_bias, _mixed_key_bias], ids=["per_query_and_key", "mixes_tokens"])
def test_other_data_dependent_masks_stay_refused(monkeypatch, form):
    model = _doge()
    monkeypatch.setattr(doge.DogeAttention, "prepare_dynamic_mask", form)
    ids = _ids(1, 96, seed=4)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
        out = fast(input_ids=ids, use_cache=False).logits
        why = fast.backend.last_unaccelerated
        ref = model(input_ids=ids, use_cache=False).logits
    assert not any(r.rewritten for r in uniprefill.graph_reports(fast))
    assert why is not None and "data-dependent mask" in str(why), why
    assert uniprefill.last_drop_report(fast) is None or not uniprefill.last_drop_report(fast).points
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch._dynamo.reset()


def test_doge_dropping_two_rows_each_matches_its_layers_on_its_kept_tokens():
    model = _doge()
    ids = _ids(2, 160, seed=5)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=(1,), **SMALL))
        out = fast(input_ids=ids, use_cache=False).logits[:, -1]
        history = uniprefill.last_drop_report(fast)
        assert [p.layer for p in history.points] == [1]
        for row in range(2):
            kept = {1: history.points[0].kept_positions(row, 160)}
            torch.testing.assert_close(out[row:row + 1], _reference(model, ids[row:row + 1], kept), atol=1e-4, rtol=0)
    torch._dynamo.reset()


def test_above_the_keep_window_the_top_k_mask_runs_the_original_graph():
    """Doge picks the top `keep_window_size` keys per query above that length: dynamo traces that
    program again, and the pass refuses it as sparse attention (its plain answer), while shorter
    prompts keep their rewritten graph."""
    model = _doge()
    model.config.keep_window_size = 300
    for layer in model.model.layers:
        layer.self_attn.keep_window_size = 300
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
        fast(input_ids=_ids(1, 120), use_cache=False)
        assert uniprefill.last_drop_report(fast).points, "a prompt within the window drops"
        ids = _ids(1, 320, seed=6)
        out = fast(input_ids=ids, use_cache=False).logits
        why = fast.backend.last_unaccelerated
        ref = model(input_ids=ids, use_cache=False).logits
        fast(input_ids=_ids(1, 130), use_cache=False)
        assert uniprefill.last_drop_report(fast).points, "the shorter prompt's graph is still rewritten"
    assert why is not None and "sparse attention" in str(why), why
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch._dynamo.reset()
