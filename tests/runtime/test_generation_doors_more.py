"""More doors of `generate` around a drop: chunked prefill (`prefill_chunk_size`), transformers' continuous
batching (`generate_batch`), assisted generation on a cache a prefill already filled, and the reports after a call
that ran unaccelerated. Before: chunked prefill dropped on the first chunk alone and ran every later chunk as
one-token steps (40x slower than the unchunked call, nothing said); `generate_batch` ran the plain model without a
word; assisted generation on a compacted cache failed inside the attention with a size mismatch; a whole (p = 1)
cache that assisted generation extended raised on the next step; `last_drop_report` kept the previous call's drop."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from uniprefill.unaccelerated import Kind

from ..passes.test_backend import _ids
from .test_generation_doors import SETTINGS, _compiled, _prompt_with_repeats


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("by", ["keyword", "generation_config"])
def test_chunked_prefill_shorter_than_the_prompt_runs_the_plain_model_and_says_why(setting, by):
    model, fast = _compiled("llama", setting)
    ids = _ids(1, 300)
    base = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    chunked = dict(prefill_chunk_size=64) if by == "keyword" else dict(
        generation_config=GenerationConfig(prefill_chunk_size=64, **base))
    with torch.no_grad():
        fast.generate(ids, **base)  # a call that prefills through the backend first: its report must not linger
        assert fast.history is not None and fast.history.points
        with pytest.warns(UserWarning, match="chunked prefill"):
            out = fast.generate(ids, **(base if by == "keyword" else {}), **chunked)
        ref = model.generate(ids, **(base if by == "keyword" else {}), **chunked)
    assert torch.equal(out, ref)
    why = fast.backend.last_unaccelerated
    assert why is not None and why.kind is Kind.CACHE_NOT_DECODABLE and "prefill_chunk_size=64" in why
    assert fast.history is None and fast.row_histories is None  # this call dropped nothing


def test_chunked_prefill_no_shorter_than_the_prompt_is_one_forward_and_drops():
    model, fast = _compiled("llama", "drops")
    ids = _ids(1, 300)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        fast.generate(ids, prefill_chunk_size=300, **kwargs)
        history = fast.history
        out = fast.generate(ids, **kwargs)  # the same call without the setting
    assert fast.backend.last_unaccelerated is None and history is not None and history.points
    assert torch.equal(out, fast.generate(ids, prefill_chunk_size=512, **kwargs))


def test_assisted_generation_on_a_cache_a_drop_compacted_raises_a_clear_error():
    model, fast = _compiled("llama", "drops")
    ids = _prompt_with_repeats()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        fast(input_ids=ids, past_key_values=cache, use_cache=True)
        assert fast.history.points and fast.history.points[0].kept[0] < 300  # it dropped
        more = torch.cat([ids, _ids(1, 6, seed=9)], dim=1)
        with pytest.raises(ValueError, match="cannot continue a cache a dropped prefill compacted"):
            fast.generate(more, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0,
                          prompt_lookup_num_tokens=3)
        # without assistance, the same cache continues (the new tokens as one-token steps)
        fast.generate(more, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_whole_cache_that_assisted_generation_extended_continues_as_the_plain_model(arch):
    """At p = 1 the prefill's cache is whole; assisted generation (the plain model's, since it checks several
    tokens per step) extends it past what the drop history counts: the next steps are the plain model's."""
    model, fast = _compiled(arch, "p1")
    ids = _prompt_with_repeats()
    mine, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    more = torch.cat([ids, _ids(1, 6, seed=9)], dim=1)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=3)
    with torch.no_grad():
        fast(input_ids=ids, past_key_values=mine, use_cache=True)
        model(input_ids=ids, past_key_values=theirs, use_cache=True)
        with pytest.warns(UserWarning, match="assisted generation"):
            out = fast.generate(more, past_key_values=mine, **kwargs)
        assert torch.equal(out, model.generate(more, past_key_values=theirs, **kwargs))
        token = out[:, -1:]
        mask = torch.ones(1, theirs.get_seq_length() + 1, dtype=torch.long)
        got = fast(input_ids=token, past_key_values=mine, attention_mask=mask, use_cache=True).logits
        ref = model(input_ids=token, past_key_values=theirs, attention_mask=mask, use_cache=True).logits
    assert torch.equal(got, ref)


def test_continuous_batching_runs_the_plain_model_and_says_why():
    model, fast = _compiled("llama", "drops")
    prompts = [_ids(1, 300)[0].tolist(), _ids(1, 180, seed=4)[0].tolist()]
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        fast.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        with pytest.warns(UserWarning, match="continuous batching"):
            out = fast.generate_batch(inputs=prompts, generation_config=config, warmup=False)
        ref = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=3, do_sample=False, pad_token_id=0)[0, len(p):] for p in prompts]
    assert [list(o.generated_tokens) for o in out.values()] == [r.tolist() for r in ref]
    why = fast.backend.last_unaccelerated
    assert why is not None and why.kind is Kind.CACHE_NOT_DECODABLE and fast.history is None
