"""Doors of `generate` around a drop (`runtime.continuation`): a fixed-size cache and assisted generation run
the plain model, unaccelerated, saying why (the answer is the plain model's, at p = 1 and where the config would
drop); several new tokens on a compacted cache (a chat's next turn) run as one-token decode steps. Before, each
raised mid-generation."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.runtime.continuation import multi_token_generation
from uniprefill.runtime.generation import HISTORY_ATTRIBUTE
from uniprefill.unaccelerated import Kind

from ..passes.test_backend import MODELS, SMALL, _ids

SETTINGS = {"p1": dict(p=1.0), "drops": dict(keep_ratio=0.4)}


def _compiled(arch: str, setting: str):
    build, drops = MODELS[arch]
    model = build()
    return model, uniprefill.compile(model, UniPrefillConfig(drop_layers=drops, **SETTINGS[setting], **SMALL))


def _prompt_with_repeats(length=300):
    ids = _ids(1, length)
    ids[0, 200:240] = ids[0, 40:80]  # n-grams the prompt-lookup candidates find
    return ids


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("door", [dict(cache_implementation="static"), dict(prompt_lookup_num_tokens=3),
                                  "assistant_model"], ids=["static-cache", "prompt-lookup", "assistant-model"])
def test_generate_doors_that_cannot_continue_a_drop_run_the_plain_model_and_say_why(door, setting):
    model, fast = _compiled("llama", setting)
    door = dict(assistant_model=model) if door == "assistant_model" else door
    ids = _prompt_with_repeats()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, **door)
    with torch.no_grad(), pytest.warns(UserWarning, match="runs unaccelerated"):
        out = fast.generate(ids, **kwargs)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    why = fast.backend.last_unaccelerated
    assert why is not None and why.kind is Kind.CACHE_NOT_DECODABLE
    assert ("fixed-size cache" in why) if "cache_implementation" in door else ("assisted generation" in why)


def test_a_static_cache_passed_to_forward_is_filled_by_the_plain_model():
    model, fast = _compiled("gemma3", "drops")
    ids = _ids(1, 300)
    mine, theirs = (StaticCache(config=model.config, max_cache_len=320) for _ in range(2))
    with torch.no_grad(), pytest.warns(UserWarning, match="fixed-size cache"):
        out = fast(input_ids=ids, past_key_values=mine, use_cache=True).logits
    with torch.no_grad():
        ref = model(input_ids=ids, past_key_values=theirs, use_cache=True).logits
        step = out[:, -1:].argmax(-1)
        nxt = fast(input_ids=step, past_key_values=mine, use_cache=True).logits  # no history: the plain model's
        nxt_ref = model(input_ids=step, past_key_values=theirs, use_cache=True).logits
    assert torch.equal(out, ref) and torch.equal(nxt, nxt_ref)
    assert fast.history is None  # nothing was dropped, nothing recorded


def test_several_tokens_after_a_prefill_that_kept_everything_continue_as_the_plain_model():
    """At p = 1 the caches are whole: a continuation of several tokens (a user's chunked continuation,
    a verification step) runs the plain model, and one-token steps after it still decode through the
    runtime with the right positions (the history counts the tokens)."""
    model, fast = _compiled("gemma3", "p1")
    ids = _ids(1, 300)
    mine, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    chunk, token = _ids(1, 4, seed=7), _ids(1, 1, seed=8)
    with torch.no_grad():
        fast(input_ids=ids, cache=mine, use_cache=True)
        model(input_ids=ids, past_key_values=theirs, use_cache=True)
        history = fast.history
        assert history is not None and history.points
        got = fast(input_ids=chunk, cache=mine, use_cache=True).logits
        ref = model(input_ids=chunk, past_key_values=theirs, use_cache=True).logits
        assert torch.equal(got, ref) and history.decoded == 4
        got = fast(input_ids=token, cache=mine, use_cache=True).logits
        ref = model(input_ids=token, past_key_values=theirs, use_cache=True).logits
    assert history.decoded == 5  # this step ran the runtime's decode
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_a_chat_turn_on_a_compacted_cache_equals_feeding_its_tokens_one_at_a_time(arch):
    """The next turn of a chat reusing the cache a dropping generate returned: the new tokens (several per
    forward) run as one-token decode steps, so the turn's tokens are those of feeding them one at a time.
    Before, the first forward of the turn raised NotImplementedError."""
    model, fast = _compiled(arch, "drops")
    ids = _ids(1, 300).clamp(min=1)  # no pad token (0) inside: generate masks those
    turn = _ids(1, 6, seed=3).clamp(min=1)
    with torch.no_grad():
        first = fast.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        assert sum(fast.history.points[0].kept) < 300
        cache = first.past_key_values
        twin = copy.deepcopy(cache)
        prompt = torch.cat([first.sequences, turn], dim=1)
        second = fast.generate(prompt, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0,
                               eos_token_id=None)  # tiny Gemma-3's eos (1) would end the turn at once
        # the same tokens one at a time: the last generated token of turn 1 is not in the cache yet
        pending, tokens = prompt[:, first.sequences.shape[1] - 1:], []
        for i in range(pending.shape[1]):
            logits = fast(input_ids=pending[:, i:i + 1], cache=twin, use_cache=True).logits
        for _ in range(4):
            tokens.append(logits[:, -1:].argmax(-1))
            logits = fast(input_ids=tokens[-1], cache=twin, use_cache=True).logits
    assert torch.equal(second, torch.cat([prompt] + tokens, dim=1))


def test_several_tokens_on_a_compacted_cache_give_every_tokens_logits_and_refuse_what_steps_cannot_take():
    model, fast = _compiled("gemma3", "drops")
    cache, twin = DynamicCache(config=model.config), DynamicCache(config=model.config)
    new = _ids(1, 5, seed=4)
    with torch.no_grad():
        fast(input_ids=_ids(1, 300), cache=cache, use_cache=True)
        fast(input_ids=_ids(1, 300), cache=twin, use_cache=True)
        together = fast(input_ids=new, cache=cache, use_cache=True).logits
        alone = torch.cat([fast(input_ids=new[:, i:i + 1], cache=twin, use_cache=True).logits for i in range(5)], 1)
        assert torch.equal(together, alone)
        assert getattr(cache, HISTORY_ATTRIBUTE).decoded == getattr(twin, HISTORY_ATTRIBUTE).decoded == 5
        with pytest.raises(NotImplementedError, match="output_hidden_states"):
            fast(input_ids=new, cache=cache, use_cache=True, output_hidden_states=True)


def test_which_generate_calls_feed_several_tokens_per_step():
    model, _ = _compiled("llama", "p1")
    assert multi_token_generation(model, {"max_new_tokens": 4}) is None
    assert "prompt_lookup_num_tokens" in multi_token_generation(model, {"prompt_lookup_num_tokens": 2})
    assert "assistant_model" in multi_token_generation(model, {"assistant_model": model})
    config = model.generation_config.__class__(prompt_lookup_num_tokens=2)
    assert "prompt_lookup_num_tokens" in multi_token_generation(model, {"generation_config": config})
    # transformers runs beam search with an assistant as plain beam search (one token a step): accelerated
    assert multi_token_generation(model, {"assistant_model": model, "num_beams": 2}) is None


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_several_tokens_after_a_left_padded_prefill_at_p1_equal_the_plain_model(arch):
    """At p = 1 a padded prompt's caches are still not the plain model's: the first drop point keeps real tokens
    only, so the layers after it hold no pad entries. Several tokens then run as decode steps (which hide the
    history's pads), not as the plain model on that uneven cache (which raised a shape error; found by a review and
    by the fuzzer's several-token decode steps)."""
    model, fast = _compiled(arch, "p1")
    ids, chunk = _ids(1, 300), _ids(1, 4, seed=7)
    mask = torch.ones_like(ids)
    mask[0, :20] = 0
    longer = torch.cat([mask, torch.ones_like(chunk)], dim=1)
    mine, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        fast(input_ids=ids, attention_mask=mask, cache=mine, use_cache=True)
        model(input_ids=ids, attention_mask=mask, past_key_values=theirs, use_cache=True)
        got = fast(input_ids=chunk, attention_mask=longer, cache=mine, use_cache=True).logits
        ref = model(input_ids=chunk, attention_mask=longer, past_key_values=theirs, use_cache=True).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert getattr(mine, HISTORY_ATTRIBUTE).decoded == 4  # the runtime's decode steps ran


def test_a_mask_over_the_new_tokens_of_a_continuation_is_refused_not_ignored():
    """Decode steps hide the prompt's pads only: a 4-D mask (a tree of candidates) or a zero over a new token would be
    ignored, so such a continuation of a compacted cache raises (a review's finding: it returned the unmasked
    logits)."""
    model, fast = _compiled("llama", "drops")
    cache = DynamicCache(config=model.config)
    new = _ids(1, 4, seed=4)
    tree = torch.ones(1, 1, 4, 304, dtype=torch.bool).tril(300)
    tree[0, 0, 3, 301:303] = False
    hole = torch.ones(1, 304, dtype=torch.long)
    hole[0, 301] = 0
    with torch.no_grad():
        fast(input_ids=_ids(1, 300), cache=cache, use_cache=True)
        for mask in (tree, hole):
            with pytest.raises(NotImplementedError, match="last 4 columns are ones"):
                fast(input_ids=new, cache=cache, use_cache=True, attention_mask=mask)
        with pytest.raises(NotImplementedError, match="last 1 columns are ones"):  # a one-token step alike
            fast(input_ids=new[:, :1], cache=cache, use_cache=True, attention_mask=hole[:, :302])


@pytest.mark.parametrize("arch", ["tiny-jamba", "tiny-qwen3-next", "tiny-lfm2"])
def test_several_tokens_on_a_compacted_cache_of_a_model_with_recurrent_layers_run_as_one_token_steps(arch):
    """A padded prompt at p = 1 leaves the layers after a drop point without its pads (a compacted cache); a chat's
    next turn of several tokens on it runs as one-token decode steps: what the plain model fed the same tokens one at
    a time gives, and its forward over the whole sequence. The plain model's own several-token step agrees with both
    on tiny Qwen3-Next and LFM2; tiny Jamba's, through its cached Mamba state, does not (about 2e-4). Before
    2026-12-05 such a continuation raised NotImplementedError on every model with recurrent layers."""
    from uniprefill.runtime.continuation import recurrent_layers
    from uniprefill.testing.fuzz import build_model

    from uniprefill.models.layer_kinds import LayerKind, layer_kinds

    model = build_model(arch, torch.float32)
    assert recurrent_layers(model)
    drops = [i for i, kind in enumerate(layer_kinds(model.config)) if kind == LayerKind.FULL][:1]
    fast = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=drops, **SMALL))
    ids = _ids(1, 120).clamp(min=3)
    mask = torch.ones_like(ids)
    mask[0, :10] = 0  # padded: the layers after a drop point hold no pad entries, the plain model's do
    new = _ids(1, 5, seed=2).clamp(min=3)
    longer = torch.cat([mask, torch.ones_like(new)], dim=1)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        fast(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        assert getattr(cache, HISTORY_ATTRIBUTE) is not None  # compacted: the several tokens go one at a time
        got = fast(input_ids=new, attention_mask=longer, cache=cache, use_cache=True).logits
        plain = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        steps = torch.cat([model(input_ids=new[:, i:i + 1], attention_mask=longer[:, :longer.shape[1] - 4 + i],
                                 past_key_values=plain, use_cache=True).logits for i in range(5)], dim=1)
        whole = model(input_ids=torch.cat([ids, new], dim=1), attention_mask=longer, use_cache=False).logits[:, -5:]
        plain = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        at_once = model(input_ids=new, attention_mask=longer, past_key_values=plain, use_cache=True).logits
        token = got[:, -1:].argmax(-1)  # and one more token on the cache the steps filled
        after = fast(input_ids=token, attention_mask=torch.cat([longer, torch.ones_like(token)], dim=1), cache=cache,
                     use_cache=True).logits
        plain_after = model(input_ids=torch.cat([ids, new, token], dim=1), use_cache=False,
                            attention_mask=torch.cat([longer, torch.ones_like(token)], dim=1)).logits[:, -1:]
    torch.testing.assert_close(got, steps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, plain_after, atol=1e-5, rtol=1e-5)
    if arch == "tiny-jamba":
        assert (at_once - whole).abs().max() > 1e-5  # the plain several-token step is the odd one out there
    else:
        torch.testing.assert_close(got, at_once, atol=1e-5, rtol=1e-5)


def _padded_batch():
    ids = _ids(2, 300).clamp(min=1)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0  # row 1 left-padded
    return ids, mask


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_several_tokens_on_a_batch_prefilled_row_by_row_at_p1_equal_the_plain_model(arch):
    """A batched forward that fills a cache (no cache object passed: the batch is prefilled row by row into
    `RowCaches`), then the next turn of every row at once (several tokens), then one more token: at p = 1 each
    equals the plain model. Before, the several-token turn raised NotImplementedError at p = 1 too."""
    model, fast = _compiled(arch, "p1")
    ids, mask = _padded_batch()
    new = _ids(2, 3, seed=5).clamp(min=1)
    longer = torch.cat([mask, torch.ones_like(new)], dim=1)
    with torch.no_grad():
        mine = fast(input_ids=ids, attention_mask=mask, use_cache=True)
        theirs = model(input_ids=ids, attention_mask=mask, use_cache=True)
        got = fast(input_ids=new, attention_mask=longer, past_key_values=mine.past_key_values, use_cache=True)
        ref = model(input_ids=new, attention_mask=longer, past_key_values=theirs.past_key_values, use_cache=True)
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
        token = ref.logits[:, -1:].argmax(-1)
        last = torch.cat([longer, torch.ones_like(token)], dim=1)
        got = fast(input_ids=token, attention_mask=last, past_key_values=got.past_key_values, use_cache=True)
        ref = model(input_ids=token, attention_mask=last, past_key_values=ref.past_key_values, use_cache=True)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert type(mine.past_key_values).__name__ == "RowCaches" and mine.past_key_values.get_seq_length() == 304


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_several_tokens_on_a_batch_prefilled_row_by_row_that_dropped_equal_each_row_alone(arch):
    """Where the rows dropped, each row's several-token turn is what the same row gives alone: its prompt without
    the pads into a cache of its own, then the same tokens (one-token decode steps on the compacted cache)."""
    model, fast = _compiled(arch, "drops")
    ids, mask = _padded_batch()
    new = _ids(2, 3, seed=5).clamp(min=1)
    with torch.no_grad():
        out = fast(input_ids=ids, attention_mask=mask, use_cache=True)
        rows = out.past_key_values.rows
        assert all(row.history is not None and sum(row.history.points[0].kept) < 280 for row in rows)
        got = fast(input_ids=new, attention_mask=torch.cat([mask, torch.ones_like(new)], dim=1),
                   past_key_values=out.past_key_values, use_cache=True).logits
        for r, pads in enumerate((0, 23)):
            cache = DynamicCache(config=model.config)
            fast(input_ids=ids[r:r + 1, pads:], cache=cache, use_cache=True)
            alone = fast(input_ids=new[r:r + 1], cache=cache, use_cache=True).logits
            torch.testing.assert_close(got[r:r + 1], alone, atol=1e-6, rtol=1e-6)
            assert rows[r].history.decoded == getattr(cache, HISTORY_ATTRIBUTE).decoded == 3


def test_several_tokens_on_a_row_by_row_batch_refuse_a_mask_over_them_and_go_one_at_a_time_through_recurrent_states():
    """A mask with a zero over the new tokens raises; on tiny Jamba, whose rows dropped, the several tokens give what
    the same tokens fed one at a time give (they raised NotImplementedError before 2026-12-05)."""
    from uniprefill.testing.fuzz import build_model

    model, fast = _compiled("llama", "drops")
    ids, mask = _padded_batch()
    new = _ids(2, 3, seed=5).clamp(min=1)
    hole = torch.cat([mask, torch.ones_like(new)], dim=1)
    hole[0, -2] = 0
    with torch.no_grad():
        out = fast(input_ids=ids, attention_mask=mask, use_cache=True)
        with pytest.raises(NotImplementedError, match="last 3 columns are ones"):
            fast(input_ids=new, attention_mask=hole, past_key_values=out.past_key_values, use_cache=True)
    jamba = build_model("tiny-jamba", torch.float32)
    fast = uniprefill.compile(jamba, UniPrefillConfig(keep_ratio=0.4, **SMALL))
    ids = _ids(2, 120).clamp(min=3)
    with torch.no_grad():
        out = fast(input_ids=ids, use_cache=True)
        assert any(row.history is not None for row in out.past_key_values.rows)
        caches = copy.deepcopy(out.past_key_values)
        new = new.clamp(min=3)
        at_once = fast(input_ids=new, past_key_values=out.past_key_values, use_cache=True).logits
        one_at_a_time = torch.cat([fast(input_ids=new[:, i:i + 1], past_key_values=caches, use_cache=True).logits
                                   for i in range(new.shape[1])], dim=1)
    torch.testing.assert_close(at_once, one_at_a_time, atol=1e-5, rtol=1e-5)


TINY_BLOCKS = dict(sink=4, last_q=4, block_size=4, min_tokens=8)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_a_prompt_shorter_than_the_sliding_window_decodes_past_it(setting):
    """Gemma-3 builds its sliding mask only for prompts longer than the window, so the graph of a shorter prompt
    reads every layer as unbounded; decode steps past the window then raised ("layer 0 holds 24 cached keys but the
    last dropped prefill predicts 25") at p = 1 too. Decode takes the window the model passes its attention
    function: at p = 1 the plain model's tokens and logits; with drops, the tokens of an engine whose earlier long
    prompt had shown it the window."""
    build, drops = MODELS["gemma3"]
    model = build()
    window = model.config.sliding_window
    settings = dict(drop_layers=drops, **SETTINGS[setting], **TINY_BLOCKS)
    fast = uniprefill.compile(model, UniPrefillConfig(**settings))
    ids = _ids(1, window - 4).clamp(min=1)
    kwargs = dict(max_new_tokens=2 * window, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_logits=True)
    with torch.no_grad():
        out = fast.generate(ids, **kwargs)
        assert fast.history is not None and fast.history.points
        if setting == "p1":
            ref = model.generate(ids, **kwargs)
            assert torch.equal(out.sequences, ref.sequences)
            torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-5, rtol=1e-5)
        else:
            seen = uniprefill.compile(model, UniPrefillConfig(**settings))
            seen.generate(_ids(1, 3 * window).clamp(min=1), max_new_tokens=1, do_sample=False, pad_token_id=0)
            assert seen.backend.layer_windows()[0] == window
            assert torch.equal(seen.generate(ids, **kwargs).sequences, out.sequences)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_a_batch_whose_last_row_is_too_short_to_drop_decodes(setting):
    """Row by row, a short last row's prefill compiled the latest graph, which (shorter than the window) read every
    layer as unbounded: the windows were read from the latest graph only, so the batch's first decode step raised
    (a review's finding). At p = 1 the plain model's tokens."""
    model, fast = _compiled("gemma3", setting)
    ids = _ids(2, 160).clamp(min=1)
    mask = torch.ones_like(ids)
    mask[1, :145] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = fast.generate(ids, **kwargs)
        assert fast.row_histories[0] is not None and fast.row_histories[1] is None
        if setting == "p1":
            assert torch.equal(out, model.generate(ids, **kwargs))


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("convention", ["counted-from-pads", "counted-from-real-tokens"])
def test_position_ids_of_a_row_by_row_batch_continuation_are_the_plain_models(convention, width):
    """The next tokens of a row-by-row batch with explicit position ids, in either convention a user may follow: the
    plain model's default (positions counted from the first column, pads included; the prefill got none) or
    generate's (counted from each row's first real token, given to the prefill too). A row's cache counts from its
    first real token, so the batch's ids are shifted by the row's pads in the first convention. Before, a compacted
    row's several-token continuation took the first convention's ids unshifted (a review's finding: 1.2e-3 off)."""
    model, fast = _compiled("llama", "p1")
    ids, mask = _padded_batch()
    new = _ids(2, width, seed=5).clamp(min=1)
    longer = torch.cat([mask, torch.ones_like(new)], dim=1)
    if convention == "counted-from-pads":
        prefill, positions = {}, torch.arange(300, 300 + width).expand(2, -1)
    else:
        prefill, positions = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, (longer.cumsum(-1) - 1)[:, -width:]
    with torch.no_grad():
        mine = fast(input_ids=ids, attention_mask=mask, use_cache=True, **prefill).past_key_values
        theirs = model(input_ids=ids, attention_mask=mask, use_cache=True, **prefill).past_key_values
        got = fast(input_ids=new, attention_mask=longer, past_key_values=mine, position_ids=positions).logits
        ref = model(input_ids=new, attention_mask=longer, past_key_values=theirs, position_ids=positions).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_generate_from_a_left_padded_batch_of_inputs_embeds_is_prefilled_row_by_row_and_equals_the_plain_model(arch):
    """`generate(inputs_embeds=...)` on a batch of several rows: each row's embeddings, pads stripped, drop in a
    prefill of their own (as a batch of input_ids does). Before, such a batch ran unaccelerated, and its reason
    told the user to use uniprefill.compile, which they were using."""
    model, fast = _compiled(arch, "p1")
    ids, mask = _padded_batch()
    embeds = model.get_input_embeddings()(ids).detach()
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(**kwargs)
        got = fast.generate(**kwargs)
    assert torch.equal(got, ref)
    assert fast.row_histories is not None and all(h is not None and h.points for h in fast.row_histories)
    assert fast.backend.last_unaccelerated is None or fast.backend.last_unaccelerated.kind is Kind.NOTHING_TO_DROP


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_steps_given_as_inputs_embeds_continue_a_cache_as_the_same_tokens_given_as_input_ids(arch, setting):
    """One token, then three, as embeddings (a soft prompt, a multimodal turn) on the cache of a prefill, alone and
    on a batch prefilled row by row: the logits of the same tokens given as input_ids, and at p = 1 the plain
    model's. Before, every such step raised NotImplementedError, at p = 1 too."""
    model, fast = _compiled(arch, setting)
    embed = model.get_input_embeddings()
    one, three = _ids(1, 1, seed=3).clamp(min=1), _ids(1, 3, seed=4).clamp(min=1)
    with torch.no_grad():
        filled = fast(input_ids=_ids(1, 300).clamp(min=1), use_cache=True).past_key_values
        twin = copy.deepcopy(filled)
        for new in (one, three):
            got = fast(inputs_embeds=embed(new), past_key_values=filled, use_cache=True).logits
            torch.testing.assert_close(got, fast(input_ids=new, past_key_values=twin, use_cache=True).logits,
                                       atol=0, rtol=0)
        ids, mask = _padded_batch()
        rows = fast(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        plain = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        for new in (_ids(2, 3, seed=5).clamp(min=1), _ids(2, 1, seed=6).clamp(min=1)):
            mask = torch.cat([mask, torch.ones_like(new)], dim=1)
            got = fast(inputs_embeds=embed(new), attention_mask=mask, past_key_values=rows, use_cache=True).logits
            ref = model(inputs_embeds=embed(new), attention_mask=mask, past_key_values=plain, use_cache=True).logits
            if setting == "p1":
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            assert got.shape == ref.shape and torch.isfinite(got).all()
