"""Generation after a dropped prefill (runtime issue): UniPrefillModel.generate and decode steps."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch._dynamo
from transformers import DynamicCache

import uniprefill
from uniprefill import UniPrefillConfig

from uniprefill.testing.eager_reference import reference_last_logits
from ..passes.test_backend import MODELS, SMALL, _ids

NEW_TOKENS = 5


@pytest.mark.parametrize("policy", ["cumulative", "suspend"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_p1_generation_equals_uncompiled(arch, policy):
    build, drops = MODELS[arch]
    model = build()
    ids = _ids(1, 300)
    fast = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=drops, policy=policy, **SMALL))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out = fast.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out, ref)
    history = uniprefill.last_drop_report(fast)
    assert history.decoded == NEW_TOKENS - 1 and [p.layer for p in history.points] == list(drops)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_generation_after_drop_matches_recompute_reference(arch):
    """Greedy tokens equal a from-scratch recompute in which every layer sees the same kept
    prompt tokens plus all generated tokens (equivalent to decoding on compacted caches)."""
    build, drops = MODELS[arch]
    model = build()
    ids = _ids(1, 337)
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.4, drop_layers=drops, **SMALL))
    with torch.no_grad():
        out = fast.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        history = uniprefill.last_drop_report(fast)
        seq = _recompute_greedy(model, ids, history)
    assert history.points[0].kept[0] < 0.5 * 337
    assert torch.equal(out, seq)


def _recompute_greedy(model, ids, history, window_positions="original"):
    """NEW_TOKENS greedy tokens, each from a from-scratch eager recompute in which every layer
    after a drop sees the kept prompt tokens plus all generated ones."""
    prompt = ids.shape[1]
    kept = {p.layer: p.kept_positions(0, prompt) for p in history.points}
    seq = ids
    for _ in range(NEW_TOKENS):
        extended = {layer: torch.cat([pos, torch.arange(prompt, seq.shape[1])]) for layer, pos in kept.items()}
        nxt = reference_last_logits(model, seq, extended, window_positions).argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def test_generation_with_windows_over_compacted_indices_matches_its_reference():
    """window_positions="compacted": decode steps of a sliding layer after a drop see every
    cached key (its cache holds the last window of kept tokens), as a recompute with the
    index-space window does."""
    build, drops = MODELS["gemma3"]
    model = build()
    ids = _ids(1, 337)
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.4, drop_layers=drops,
                                                      window_positions="compacted", **SMALL))
    with torch.no_grad():
        out = fast.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        seq = _recompute_greedy(model, ids, uniprefill.last_drop_report(fast), "compacted")
    assert torch.equal(out, seq)


def test_cache_lengths_follow_the_history():
    build, drops = MODELS["gemma3"]
    model = build()
    ids = _ids(1, 320)
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=drops, **SMALL))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        fast(input_ids=ids, cache=cache, use_cache=True)
    history = uniprefill.last_drop_report(fast)
    window = model.config.sliding_window
    for layer, cache_layer in enumerate(cache.layers):
        held = history.layer_positions(layer).numel()
        if model.config.layer_types[layer] == "sliding_attention":
            held = min(held, window - 1)
        assert cache_layer.keys.shape[-2] == held, f"layer {layer}"
    assert cache.layers[-1].keys.shape[-2] < cache.layers[0].keys.shape[-2] or window - 1 < 320


def test_key_positions_are_the_last_cached_of_prompt_then_decoded_positions():
    """A decode step's key positions: the layer's kept prompt positions followed by the
    decoded ones, of which a sliding cache holds the last `cached` (built without copying
    the whole prompt's positions)."""
    from uniprefill.runtime.history import DropHistory, DropPoint

    kept = torch.tensor([0, 1, 2, 7, 8, 20, 21, 22, 29])
    history = DropHistory(1, 30, [DropPoint(1, (30,), (kept.numel(),), kept)])
    for decoded in (0, 1, 5, 12):
        history.decoded = decoded
        every = torch.cat([kept, torch.arange(30, 30 + decoded)])
        for cached in range(1, every.numel() + 1):
            assert torch.equal(history.key_positions(3, cached), every[every.numel() - cached:])
        with pytest.raises(RuntimeError, match="does not belong"):
            history.key_positions(3, every.numel() + 1)
    assert torch.equal(history.key_positions(0, 31), torch.arange(0, 42)[-31:])  # before the drop: every token


def test_decode_steps_leave_cudnn_attention_out():
    """cuDNN's SDPA re-plans for every new key length (every decode step) on the H200."""
    build, drops = MODELS["gemma3"]
    model = build()
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=drops, **SMALL))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = fast(input_ids=_ids(1, 320), cache=cache, use_cache=True)
        assert uniprefill.last_drop_report(fast).points
        seen = []  # hooked after the prefill: a hook inside the compiled region would break its graph
        model.model.layers[-1].self_attn.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(
                (kwargs.get("uniprefill_decode") is not None, torch.backends.cuda.cudnn_sdp_enabled())),
            with_kwargs=True)
        for _ in range(2):
            out = fast(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert seen == [(True, False), (True, False)]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each step


def _prefill(arch="llama", length=300):
    build, drops = MODELS[arch]
    model = build()
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=drops, **SMALL))
    ids = _ids(1, length)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = fast(input_ids=ids, cache=cache, use_cache=True)
    return model, fast, cache, out.logits[:, -1:].argmax(-1)


def test_corrupted_history_raises():
    model, fast, cache, tok = _prefill()
    history = uniprefill.last_drop_report(fast)
    point = history.points[0]
    history.points[0] = dataclasses.replace(point, kept_flat=point.kept_flat[1:])
    with pytest.raises(RuntimeError, match="does not belong"), torch.no_grad():
        fast(input_ids=tok, cache=cache, use_cache=True)


def test_cache_no_drop_compacted_continues_as_the_plain_model():
    """A cache that no dropped prefill filled (here the plain model's) holds every token:
    continuing it through the compiled model is the plain model's continuation, even
    right after a dropped prefill of another prompt."""
    model, fast, cache, tok = _prefill()
    other, twin = DynamicCache(config=model.config), DynamicCache(config=model.config)
    prompt = _ids(1, 300, seed=5)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=other, use_cache=True)  # read by 5.17 and 5.24
        model(input_ids=prompt, past_key_values=twin, use_cache=True)
        out = fast(input_ids=tok, cache=other, use_cache=True).logits
        ref = model(input_ids=tok, past_key_values=twin, use_cache=True).logits
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_an_earlier_dropped_cache_still_decodes_with_its_own_history():
    """Each dropped cache keeps its own history: a prefill of another prompt in between
    does not change how the first cache decodes."""
    model, fast, cache, tok = _prefill()
    with torch.no_grad():
        alone = fast(input_ids=tok, cache=copy.deepcopy(cache), use_cache=True).logits
        fast(input_ids=_ids(1, 333, seed=9), cache=DynamicCache(config=model.config), use_cache=True)
        assert uniprefill.last_drop_report(fast).seq_len == 333
        after_other = fast(input_ids=tok, cache=cache, use_cache=True).logits
    torch.testing.assert_close(after_other, alone, atol=0, rtol=0)


def test_many_compiled_models_in_one_process_all_drop():
    """Compiled models share dynamo's cache of transformers' code objects; past dynamo's
    recompile limit a model would run eagerly and, worse, leave the previous model's drop
    history behind. Prefills raise the limit, and every prefill starts a fresh history."""
    build, drops = MODELS["llama"]
    model = build()
    ids = _ids(1, 300)
    retentions = []
    with torch._dynamo.config.patch(recompile_limit=1):
        for ratio in (0.5, 0.3, 0.7):
            fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=ratio, drop_layers=drops, **SMALL))
            with torch.no_grad():
                fast(input_ids=ids, use_cache=False)
            history = uniprefill.last_drop_report(fast)
            assert history is not None and [p.layer for p in history.points] == list(drops)
            retentions.append(history.points[0].retention)
    assert retentions[0] < 0.6 and retentions[1] < retentions[0] < retentions[2]


def test_a_prefill_that_never_reaches_the_graph_leaves_no_stale_history():
    build, drops = MODELS["llama"]
    model = build()
    ids = _ids(1, 300)
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=drops, **SMALL))
    with torch.no_grad():
        fast(input_ids=ids, use_cache=False)
        assert uniprefill.last_drop_report(fast).points
        with torch.compiler.set_stance("force_eager"):
            with pytest.warns(UserWarning, match="ran outside the compiled graph"):
                fast(input_ids=ids, use_cache=False)
    assert uniprefill.last_drop_report(fast) is None


def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(r.numel() for r in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, length - r.numel():] = r
        mask[i, length - r.numel():] = 1
    return ids, mask


def _prompts(vocab: int):
    gen = torch.Generator().manual_seed(11)
    # no pad-id tokens inside a prompt: generate() would infer holes in the mask from them
    return [torch.randint(3, vocab, (n,), generator=gen) for n in (337, 290)]


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_left_padded_batch_generation_after_drop_equals_each_row_alone(arch):
    build, drops = MODELS[arch]
    model = build()
    prompts = _prompts(model.config.vocab_size)
    ids, mask = _left_padded(prompts)
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.4, drop_layers=drops, **SMALL))
    with torch.no_grad():
        out = fast.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        histories = fast.row_histories
        alone = [fast.generate(input_ids=p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False)[0, p.numel():] for p in prompts]
    assert [h.seq_len for h in histories] == [p.numel() for p in prompts]
    assert all(h.points and h.points[0].kept[0] < 0.5 * h.seq_len for h in histories)
    assert all(h.decoded == NEW_TOKENS - 1 for h in histories)
    for row, tokens in enumerate(alone):
        assert torch.equal(out[row, ids.shape[1]:], tokens), f"row {row}"


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_left_padded_batch_generation_at_p1_equals_uncompiled(arch):
    build, drops = MODELS[arch]
    model = build()
    ids, mask = _left_padded(_prompts(model.config.vocab_size))
    fast = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=drops, **SMALL))
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        out = fast.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out, ref)


def test_batch_that_is_not_left_padded_runs_unaccelerated_and_says_why():
    build, drops = MODELS["llama"]
    model = build()
    ids = _ids(2, 300)
    mask = torch.ones_like(ids)
    mask[1, -10:] = 0  # right padding
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.4, drop_layers=drops, **SMALL))
    with torch.no_grad(), pytest.warns(UserWarning, match="not left-padded"):
        out = fast(input_ids=ids, attention_mask=mask, use_cache=True).logits
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, use_cache=True).logits
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    strict = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.4, drop_layers=drops, strict=True, **SMALL))
    with torch.no_grad(), pytest.raises(RuntimeError, match="not left-padded"):
        strict(input_ids=ids, attention_mask=mask, use_cache=True)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_sampling_at_p1_equals_uncompiled(arch, rows):
    """Sampling goes through the same forward: at p = 1, with the same seed, the same draws."""
    build, drops = MODELS[arch]
    model = build()
    ids, mask = _left_padded(_prompts(model.config.vocab_size)[:rows])
    fast = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=drops, **SMALL))
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20, temperature=1.5)
    with torch.no_grad():
        torch.manual_seed(7)
        ref = model.generate(input_ids=ids, attention_mask=mask, **settings)
        torch.manual_seed(7)
        out = fast.generate(input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(out, ref)
    assert uniprefill.last_drop_report(fast).points  # it really ran through the drop points


def test_a_drop_at_the_last_layer_changes_no_generated_token():
    """Gemma-3-270M's last layer (17) is full attention, so its drop_layers "all" (5, 11, 17)
    and "auto" (5, 11) differ only by a drop after the last attention: that layer's KV is
    written before the drop, and only the last token's row reaches the logits. Greedy
    generations must therefore be identical (docs/benchmarks.md cites this for "all" vs "auto")."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
                           max_position_embeddings=4096,
                           layer_types=["sliding_attention", "full_attention"] * 3)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert model.model.layers[-1].self_attn.sliding_window is None
    ids = _ids(1, 337)
    outs, histories = [], []
    for drops in ((1, 3, 5), (1, 3)):
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.4, drop_layers=drops, **SMALL))
        with torch.no_grad():
            outs.append(fast.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False))
        histories.append(uniprefill.last_drop_report(fast))
        torch._dynamo.reset()
    assert [p.layer for p in histories[0].points] == [1, 3, 5]
    assert histories[0].points[-1].kept[0] < histories[0].points[-1].entering[0]
    assert [p.kept for p in histories[0].points[:2]] == [p.kept for p in histories[1].points]
    assert torch.equal(outs[0], outs[1])


def test_cache_keyword_follows_the_transformers_version():
    """transformers 5.17 reads only past_key_values= (cache= would be ignored silently: seen on
    the H200 box); 5.24 reads cache=. The wrapper passes the cache under the name read."""
    from uniprefill.runtime.generation import _cache_keyword_for

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, past_key_values=None, **kwargs): ...

    cache = object()
    assert _cache_keyword_for(Old(), {"cache": cache, "use_cache": True}) == {"past_key_values": cache, "use_cache": True}
    assert _cache_keyword_for(New(), {"cache": cache}) == {"cache": cache}
    assert _cache_keyword_for(Old(), {"past_key_values": cache}) == {"past_key_values": cache}
    with pytest.raises(TypeError, match="once"):
        _cache_keyword_for(New(), {"cache": cache, "past_key_values": cache})
