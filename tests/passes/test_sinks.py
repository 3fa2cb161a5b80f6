"""Attention with learned sinks (GPT-OSS): the ops against a naive softmax with the sink column,
the pattern recognised in the graph, and the compiled model against the plain one."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
import torch.fx as fx

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.ops import _position_mask
from uniprefill.passes.sink_attention import canonicalize_sink_attention
from uniprefill.testing.eager_reference import reference_last_logits

U = torch.ops.uniprefill
SMALL = dict(sink=16, last_q=16, block_size=16)
ATOL = 1e-5


def _naive(q, k, v, visible, scale, sinks):
    """softmax over [logits, sink] per head, sink column dropped; `visible` [B|1, 1, Q, K] boolean."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~visible, float("-inf"))
    column = sinks[None, :, None, None].expand(q.shape[0], -1, q.shape[2], 1)
    probs = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]
    return probs @ v


def _qkv(b, h, hk, n, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, n, d, generator=g), torch.randn(b, hk, n, d, generator=g),
            torch.randn(b, hk, n, d, generator=g), 2 * torch.randn(h, generator=g))


def _visible(n, window, key_valid=None):
    pos = torch.arange(n)
    vis = _position_mask(pos, pos, window)[None, None]
    if key_valid is not None:
        vis = vis & key_valid.bool()[:, None, None, :]
    return vis


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("window", [0, 7], ids=["full", "window7"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "leftpad"])
def test_dense_sink_attention_matches_naive(heads, kv_heads, window, padded):
    q, k, v, sinks = _qkv(2, heads, kv_heads, 37)
    key_valid = None
    if padded:
        key_valid = torch.ones(2, 37, dtype=torch.long)
        key_valid[1, :9] = 0
    out = U.dense_sink_attention(q, k, v, key_valid, window, 0.3, sinks)
    ref = _naive(q, k, v, _visible(37, window, key_valid), 0.3, sinks)
    rows = slice(None) if not padded else slice(9, None)  # a pad query's row is never read
    torch.testing.assert_close(out[..., rows, :], ref[..., rows, :], atol=ATOL, rtol=0)
    shared = U.dense_mask(q, key_valid, window, None if key_valid is None else key_valid.sum(1))
    torch.testing.assert_close(U.dense_sink_attention(q, k, v, key_valid, window, 0.3, sinks, shared), out)


def test_graph_form_takes_any_mask_the_model_built():
    """`sink_attention` (the pattern as one node): a boolean mask, the model's additive one
    (`where(visible, 0, most negative)`), or is_causal; GQA."""
    q, k, v, sinks = _qkv(2, 4, 2, 19, seed=2)
    visible = _visible(19, 6)
    ref = _naive(q, k, v, visible, 0.2, sinks)
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    for mask in (visible, additive):
        torch.testing.assert_close(U.sink_attention(q, k, v, mask, scale=0.2, enable_gqa=True, sinks=sinks), ref,
                                   atol=ATOL, rtol=0)
    torch.testing.assert_close(U.sink_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True, sinks=sinks),
                               _naive(q, k, v, _visible(19, 0), 0.2, sinks), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="sinks must be"):
        U.sink_attention(q, k, v, visible, scale=0.2, sinks=sinks[:2])


@pytest.mark.parametrize("window", [0, 5], ids=["full", "window5"])
def test_packed_and_decode_sink_attention_match_naive(window):
    """Two packed rows of kept tokens at ORIGINAL positions with gaps; one decode query."""
    q, k, v, sinks = _qkv(1, 4, 2, 20, seed=1)
    positions = torch.tensor([0, 2, 3, 7, 8, 9, 12, 15, 0, 1, 4, 6, 7, 10, 11, 13, 14, 16, 18, 19])
    counts = torch.tensor([8, 12])
    out = U.packed_sink_attention(q, k, v, positions, counts, window, 0.25, sinks)
    start = 0
    for c in counts.tolist():
        pos = positions[start:start + c]
        vis = _position_mask(pos, pos, window)[None, None]
        sl = slice(start, start + c)
        torch.testing.assert_close(out[:, :, sl], _naive(q[:, :, sl], k[:, :, sl], v[:, :, sl], vis, 0.25, sinks),
                                   atol=ATOL, rtol=0)
        start += c
    key_positions = positions[8:]
    one = q[:, :, -1:]
    got = U.decode_sink_attention(one, k[:, :, 8:], v[:, :, 8:], key_positions, 20, window, 0.25, sinks)
    vis = _position_mask(torch.tensor([20]), key_positions, window)[None, None]
    torch.testing.assert_close(got, _naive(one, k[:, :, 8:], v[:, :, 8:], vis, 0.25, sinks), atol=ATOL, rtol=0)
    # no visible key at all: only the sink, a zero output (not NaN)
    nothing = U.decode_sink_attention(one, k[:, :, :3], v[:, :, :3], torch.tensor([30, 31, 32]), 20, 0, 0.25, sinks)
    assert torch.equal(nothing, torch.zeros_like(nothing))


def _gpt_oss(layers=("sliding_attention", "full_attention", "sliding_attention", "full_attention"), window=64):
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=len(layers),
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=window, layer_types=list(layers),
                       max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()  # the default way: eager attention
    with torch.no_grad():
        for layer in model.model.layers:  # sinks that matter (the init leaves them near 0)
            layer.self_attn.sinks.normal_(0, 2.0)
    return model


def _prefill_then_one_step(exact, model, ids):
    """The compiled model's and the plain model's outputs of a cache-filling prefill of `ids` and of
    one decode step on that cache: (filled, step, plain, want)."""
    filled = exact(input_ids=ids, use_cache=True)
    step = exact(input_ids=torch.tensor([[5]]), past_key_values=filled.past_key_values, use_cache=True)
    plain = model(input_ids=ids, use_cache=True)
    want = model(input_ids=torch.tensor([[5]]), past_key_values=plain.past_key_values, use_cache=True)
    return filled, step, plain, want


def _ids(rows, n, seed=1):
    return torch.randint(3, 128, (rows, n), generator=torch.Generator().manual_seed(seed))


def test_pattern_becomes_one_node_per_layer_and_not_with_dropout_on():
    model = _gpt_oss()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=True)(input_ids=_ids(1, 200), use_cache=False)
    gm, count, plain = canonicalize_sink_attention(graphs[0])
    assert (count, plain) == (4, 0)  # the MoE routers' softmax is not attention
    sites = [n for n in gm.graph.nodes if n.target is U.sink_attention.default]
    assert len(sites) == 4 and all(n.kwargs["attn_mask"].meta["example_value"].dtype == torch.bool for n in sites)
    softmaxes = [sum("softmax" in str(n.target) for n in g.graph.nodes) for g in (graphs[0], gm)]
    assert softmaxes == [8, 4], "the attention's softmax is gone (the routers' stay); the original graph is unchanged"
    # negative: a dropout that is on is not the pattern
    graph = fx.Graph()
    env = {}
    graph.output(graph.graph_copy(graphs[0].graph, env))
    for node in graph.nodes:
        if "dropout" in str(node.target):
            node.update_kwarg("training", True)
            node.update_kwarg("p", 0.1)
    assert canonicalize_sink_attention(fx.GraphModule(graphs[0], graph))[1] == 0
    torch._dynamo.reset()


def test_gpt_oss_p1_prefill_equals_plain_model_batch_and_padded():
    model = _gpt_oss()
    ids = _ids(2, 240)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        one = exact(input_ids=ids[:1], use_cache=False).logits
        torch.testing.assert_close(one, model(input_ids=ids[:1], use_cache=False).logits, atol=1e-5, rtol=0)
        report = uniprefill.graph_reports(exact)[-1]
        assert report.rewritten, report.reason
        assert [r.kind for r in report.layers] == ["sliding", "full", "sliding", "full"]
        assert [r.window for r in report.layers] == [64, 0, 64, 0]
        assert report.counts["sink_attention_sites"] == 4 and report.counts["drop_points"] == 2
        assert report.counts["dense_attention"] == 2 and report.counts["packed_attention"] == 2
        assert [p.layer for p in uniprefill.last_drop_report(exact).points] == [1, 3]
        two = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(two[0], ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(two[1, 37:], ref[1, 37:], atol=1e-5, rtol=0)
    torch._dynamo.reset()


def test_gpt_oss_p1_generation_and_decode_step_equal_plain_model():
    model = _gpt_oss()
    ids = _ids(2, 200, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        # one decode step on the cache of a (p = 1) dropped prefill: the logits, not only the argmax
        filled = exact(input_ids=ids[:1], use_cache=True)
        assert uniprefill.last_drop_report(exact).points, "the prefill went through the drop points"
        step = exact(input_ids=torch.tensor([[5]]), past_key_values=filled.past_key_values, use_cache=True)
        plain = model(input_ids=ids[:1], use_cache=True)
        ref = model(input_ids=torch.tensor([[5]]), past_key_values=plain.past_key_values, use_cache=True)
        torch.testing.assert_close(step.logits, ref.logits, atol=1e-5, rtol=0)
        gen = exact.generate(input_ids=ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        assert torch.equal(gen, model.generate(input_ids=ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0))
        gen2 = exact.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        ref2 = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(gen2, ref2)
    torch._dynamo.reset()


def test_gpt_oss_dropping_matches_eager_reference():
    """p < 1: tokens are really dropped, and the rewritten model equals the model's own eager
    attention (with its sinks) run layer by layer on the kept tokens at their original positions."""
    model = _gpt_oss(window=24)
    ids = _ids(1, 260, seed=3)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=(0.5, 0.7), drop_layers="all", **SMALL))
        out = fast(input_ids=ids, use_cache=False).logits[:, -1]
        history = uniprefill.last_drop_report(fast)
        kept = {p.layer: p.kept_positions(0, 260) for p in history.points}
        ref = reference_last_logits(model, ids, kept)
        full = model(input_ids=ids, use_cache=False).logits[:, -1]
    assert [p.layer for p in history.points] == [1, 3]
    assert history.points[0].kept[0] < 0.6 * 260, "the drop must really drop tokens"
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    assert (out - full).abs().max() > 1e-3, "dropping must change the answer of a random model"
    torch._dynamo.reset()


def test_flint_same_pattern_without_the_max_and_with_upcast_scores():
    """Flint's eager attention: the same sinks, softmax straight on the concatenation, q and k cast
    with `.float()` (read after repeat_kv then), dropout after the cast: p = 1 equals the model."""
    from uniprefill.testing.census import _build

    model, _ = _build("flint")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.normal_(0, 2.0)
    ids = _ids(1, 220, seed=4)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        filled, step, plain, ref = _prefill_then_one_step(exact, model, ids)
        report = uniprefill.graph_reports(exact)[-1]
        assert report.rewritten and report.counts["sink_attention_sites"] == 4, report
    torch.testing.assert_close(filled.logits, plain.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(step.logits, ref.logits, atol=1e-5, rtol=0)
    torch._dynamo.reset()


def test_decode_refuses_a_module_with_sinks_that_passes_none():
    from uniprefill.runtime.decode_attention import _sinks

    holder = torch.nn.Module()
    holder.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(RuntimeError, match="holds attention sinks"):
        _sinks(holder, {})
    assert _sinks(holder, {"s_aux": holder.sinks}) is holder.sinks
    assert _sinks(torch.nn.Module(), {}) is None


def _eager_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_plain_eager_attention_becomes_sdpa_and_equals_the_plain_model():
    """Eager attention without sinks (a model loaded with attn_implementation="eager") is one SDPA
    call per layer after canonicalisation: at p = 1 prefill (padded batch) and greedy generation
    equal the plain model's; at p < 1 tokens are dropped."""
    model = _eager_llama()
    ids = _ids(2, 240)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    torch._dynamo.reset()
    compiled = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(1, 2), **SMALL))
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out[0], ref[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1, 37:], ref[1, 37:], atol=1e-4, rtol=0)
    report = uniprefill.graph_reports(compiled)[-1]
    assert report.rewritten and report.counts["eager_attention_sites"] == 4
    assert "sink_attention_sites" not in report.counts
    with torch.no_grad():
        want = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
        got = compiled.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    torch._dynamo.reset()
    dropping = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=(1, 2), **SMALL))
    with torch.no_grad():
        logits = dropping(input_ids=ids[:1], use_cache=False).logits
    assert torch.isfinite(logits).all()
    history = uniprefill.last_drop_report(dropping)
    assert history is not None and history.overall_retention < 0.5


def _naive_capped(q, k, v, visible, scale, cap):
    """Gemma-2's eager attention: softcap * tanh(logits / softcap), additive mask, softmax."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = torch.tanh((q @ k.transpose(-1, -2)) * scale / cap) * cap
    logits = logits + torch.zeros_like(logits).masked_fill(~visible, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, -1) @ v


@pytest.mark.parametrize("window", [0, 7], ids=["full", "window7"])
def test_softcapped_ops_without_sinks_match_naive(window):
    q, k, v, _ = _qkv(2, 4, 2, 40, seed=6)
    q = 3 * q  # logits large enough for the cap to matter
    key_valid = torch.ones(2, 40, dtype=torch.long)
    key_valid[1, :9] = 0
    want = _naive_capped(q, k, v, _visible(40, window, key_valid), 0.35, 0.8)
    got = U.dense_sink_attention(q, k, v, key_valid, window, 0.35, None, softcap=0.8)
    torch.testing.assert_close(got[0], want[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1, :, 9:], want[1, :, 9:], atol=ATOL, rtol=0)
    assert torch.isfinite(got).all(), "padding rows (no visible key) stay finite without a sink"
    uncapped = U.dense_sink_attention(q, k, v, key_valid, window, 0.35, None)
    assert (uncapped - got).abs().max() > 1e-2, "the cap changes the answer here"
    # one packed row and one decode step compute the same as the dense op
    packed = U.packed_sink_attention(q[:1], k[:1], v[:1], torch.arange(40), torch.tensor([40]), window, 0.35, None,
                                     softcap=0.8)
    torch.testing.assert_close(packed, got[:1], atol=ATOL, rtol=0)
    step = U.decode_sink_attention(q[:1, :, -1:], k[:1], v[:1], torch.arange(40), 39, window, 0.35, None, 0.8)
    torch.testing.assert_close(step, got[:1, :, -1:], atol=ATOL, rtol=0)


def test_gemma2_softcapped_eager_attention_is_accelerated_and_equals_the_plain_model():
    """Gemma-2 (soft-capped logits, eager only in transformers): one uniprefill::sink_attention per
    layer without sinks; at p = 1 prefill (padded batch), a decode step after the dropped prefill
    and greedy generation equal the plain model, in float32 and bfloat16 (softmax in float32)."""
    from uniprefill.testing.census import _build

    model, _ = _build("gemma2")
    for module in model.modules():
        if hasattr(module, "attn_logit_softcapping"):
            module.attn_logit_softcapping = 0.5  # binds: the tiny model's logits are far below 50
    ids = _ids(2, 240, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        torch._dynamo.reset()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
            out = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
            report = uniprefill.graph_reports(exact)[-1]
            assert report.rewritten, report.reason
            assert report.counts["sink_attention_sites"] == 4 and report.counts["drop_points"] == 2
            ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(out[1, 37:], ref[1, 37:], atol=1e-5, rtol=0)
            _, step, _, want = _prefill_then_one_step(exact, model, ids[:1])
            torch.testing.assert_close(step.logits, want.logits, atol=1e-5, rtol=0)
            assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
            if dtype == torch.float32:
                gen = exact.generate(input_ids=ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
                assert torch.equal(gen, model.generate(input_ids=ids[:1], max_new_tokens=6, do_sample=False,
                                                       pad_token_id=0))
                torch._dynamo.reset()
                dropping = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
                logits = dropping(input_ids=ids[:1], use_cache=False).logits
                assert torch.isfinite(logits).all()
                assert uniprefill.last_drop_report(dropping).overall_retention < 0.5
    torch._dynamo.reset()


def test_eager_attention_with_a_max_subtracted_and_without_sinks():
    """MiMo-V2-Flash's full layer: eager attention with the row max subtracted and no sink column
    (its sliding layers have sinks): an SDPA call, and p = 1 equals the plain model."""
    from uniprefill.testing.census import _build

    model, _ = _build("mimo_v2_flash")
    ids = _ids(1, 220, seed=7)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        out = exact(input_ids=ids, use_cache=False).logits
        report = uniprefill.graph_reports(exact)[-1]
        ref = model(input_ids=ids, use_cache=False).logits
    assert report.rewritten, report.reason
    assert report.counts["eager_attention_sites"] == 1 and report.counts["sink_attention_sites"] == 3
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch._dynamo.reset()


def test_plain_eager_attention_in_bfloat16_keeps_its_float32_softmax():
    """transformers' eager attention takes the softmax in float32 on bfloat16 logits, which SDPA does
    not reproduce: that site becomes uniprefill::sink_attention(upcast=True), exactly the model's."""
    model = _eager_llama().to(torch.bfloat16)
    ids = _ids(1, 200, seed=8)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(1, 2), **SMALL))
        out = exact(input_ids=ids, use_cache=False).logits
        report = uniprefill.graph_reports(exact)[-1]
        ref = model(input_ids=ids, use_cache=False).logits
    assert report.rewritten and report.counts["sink_attention_sites"] == 4, report
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch._dynamo.reset()


def test_sinks_applied_after_the_attention_granite_swa():
    """Granite-SWA scales the plain attention by sigmoid(lse(logits) - sink), the sink softmax in
    another form: one uniprefill::sink_attention per layer; at p = 1 prefill (padded batch) and a
    decode step after the dropped prefill equal the plain model, with sinks drawn from N(0, 2)."""
    from uniprefill.testing.census import _build

    model, _ = _build("granite_swa")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.normal_(0, 2.0)
    ids = _ids(2, 230, seed=9)
    mask = torch.ones_like(ids)
    mask[1, :29] = 0
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        out = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
        report = uniprefill.graph_reports(exact)[-1]
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        _, step, _, want = _prefill_then_one_step(exact, model, ids[:1])
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
    assert report.rewritten and report.counts["sink_attention_sites"] == 4, report
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1, 29:], ref[1, 29:], atol=1e-5, rtol=0)
    torch.testing.assert_close(step.logits, want.logits, atol=1e-5, rtol=0)
    torch._dynamo.reset()


def _llama_with_attention(name, fn, dtype=torch.float32):
    """The eager Llama with `fn` as its attention function (and transformers' eager masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, eager_mask)
    model = _eager_llama().to(dtype)
    model.config._attn_implementation = name
    return model


def _capped_by_attribute(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Gemma-2's pattern with the cap read from the module (a negative one: the same function) and
    not passed as `softcap`: decode steps must take the form from the prefill, not from kwargs."""
    from transformers.models.llama.modeling_llama import repeat_kv

    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    weights = torch.tanh(weights / module.cap) * module.cap
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _mask_added_with_alpha(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    from transformers.models.llama.modeling_llama import repeat_kv

    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    weights = torch.add(weights, attention_mask, alpha=1e-37)  # the mask all but switched off
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_decode_after_an_eager_prefill_computes_the_prefills_form(dtype):
    """A soft-cap the attention function reads from its module (never passed as `softcap`), negative,
    with a float32 softmax: prefill and a decode step after the dropped prefill equal the plain model."""
    model = _llama_with_attention("uniprefill_test_capped", _capped_by_attribute, dtype)
    for layer in model.model.layers:
        layer.self_attn.cap = -0.05
    ids = _ids(1, 200, seed=10)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(1, 2), **SMALL))
        filled, step, plain, want = _prefill_then_one_step(exact, model, ids)
        report = uniprefill.graph_reports(exact)[-1]
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
    assert report.rewritten and report.counts["sink_attention_sites"] == 4, report
    assert uniprefill.last_drop_report(exact).attention[1] == (-0.05, dtype == torch.bfloat16, False)
    torch.testing.assert_close(filled.logits, plain.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(step.logits, want.logits, atol=1e-5, rtol=0)
    torch._dynamo.reset()


def test_a_mask_added_with_alpha_is_not_the_pattern():
    model = _llama_with_attention("uniprefill_test_alpha", _mask_added_with_alpha)
    ids = _ids(1, 200, seed=11)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(1, 2), **SMALL))
        out = exact(input_ids=ids, use_cache=False).logits
        report = uniprefill.graph_reports(exact)[-1]
        ref = model(input_ids=ids, use_cache=False).logits
    assert not report.rewritten and "no full-attention" in report.reason, report
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch._dynamo.reset()
