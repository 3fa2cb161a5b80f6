"""Every "ran unaccelerated" report carries a kind beside its message (`uniprefill.unaccelerated`)."""

from __future__ import annotations

import pickle
import warnings

import torch
import torch._dynamo
from transformers import AutoModelForCausalLM, LlamaConfig

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.unaccelerated import Kind, Unaccelerated, kind_of

SMALL = dict(sink=16, last_q=16, block_size=16)


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_a_reason_is_its_message_with_a_kind_and_pickles_with_it():
    reason = Unaccelerated("gradients are enabled", Kind.NOT_INFERENCE)
    assert reason == "gradients are enabled" and reason.startswith("gradients")
    again = pickle.loads(pickle.dumps(reason))
    assert again == reason and again.kind is Kind.NOT_INFERENCE
    assert reason.prefixed("graph not rewritten: ").kind is Kind.NOT_INFERENCE
    assert kind_of("a plain string") is None and kind_of(None) is None


def test_the_backend_reports_the_kind_of_each_unaccelerated_call():
    model = _llama()
    ids = torch.randint(0, 128, (1, 300))
    torch._dynamo.reset()
    fast = uniprefill.compile(model, UniPrefillConfig(p=0.5, drop_layers=(1,), min_tokens=200, **SMALL))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast(input_ids=ids[:, :100], use_cache=False)  # shorter than min_tokens
        assert fast.backend.last_unaccelerated.kind is Kind.NOTHING_TO_DROP
        positions = torch.arange(300)[None] * 2  # strided positions: not modelled
        fast(input_ids=ids, position_ids=positions, use_cache=False)
        assert fast.backend.last_unaccelerated.kind is Kind.INPUT_NOT_MODELLED
        fast(input_ids=ids, use_cache=False)
        assert fast.backend.last_unaccelerated is None  # accelerated
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graded = uniprefill.compile(model, UniPrefillConfig(p=0.5, drop_layers=(1,), **SMALL))
        graded(input_ids=ids, use_cache=False)  # gradients enabled
    reports = [g for g in uniprefill.graph_reports(graded) if not g.rewritten]
    assert reports and reports[0].reason.kind is Kind.NOT_INFERENCE
    assert graded.backend.last_unaccelerated.kind is Kind.NOT_INFERENCE
    torch._dynamo.reset()
