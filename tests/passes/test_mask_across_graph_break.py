"""A causal mask built in one graph and passed into the next across a graph break (CTRL: its
`forward` stores a module attribute, so dynamo breaks between the mask and the layers).

The layers' graph reads the mask as a `[rows, 1, N, N]` input (`InputRole.CAUSAL_MASK`). It is
accelerated when that input is exactly the causal mask, checked on every call; a padded batch
(its mask hides pad keys) runs the original graph with the reason. At p = 1 both equal the
plain model.
"""

from __future__ import annotations

import warnings

import torch
import torch._dynamo
from transformers import AutoModelForCausalLM

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.passes.mask_inputs import causal_view, is_causal_mask
from uniprefill.testing.census import tiny_config
from uniprefill.unaccelerated import Kind

SMALL = dict(sink=16, last_q=16, block_size=16)
ATOL = 1e-4


def _ctrl():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("ctrl"), attn_implementation="sdpa").eval()


def _ids(rows=1, length=200):
    return torch.randint(3, 128, (rows, length), generator=torch.Generator().manual_seed(1))


def test_a_causal_mask_passed_across_a_graph_break_is_accelerated():
    model = _ctrl()
    ids = _ids(2)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        one = exact(input_ids=ids[:1], use_cache=False).logits
        assert exact.backend.last_unaccelerated is None
        assert uniprefill.last_drop_report(exact).points
        torch.testing.assert_close(one, model(input_ids=ids[:1], use_cache=False).logits, atol=ATOL, rtol=0)
        padded = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
        why = exact.backend.last_unaccelerated
        assert why.kind is Kind.INPUT_NOT_MODELLED and "not the plain causal mask" in why, why
        torch.testing.assert_close(padded, model(input_ids=ids, attention_mask=mask, use_cache=False).logits,
                                   atol=ATOL, rtol=0)
        rewritten = [g for g in uniprefill.graph_reports(exact) if g.rewritten]
        assert len(rewritten) == 2  # one row, then rows with a padding mask (a recompile)
        for graph in rewritten:
            counts = graph.counts
            assert counts["drop_points"] == 4, counts
            assert counts["dense_attention"] + counts["packed_attention"] == 4, counts
            assert [r.kind for r in graph.layers] == ["full"] * 4
        torch._dynamo.reset()
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
        out = fast(input_ids=ids[:1], use_cache=False).logits
    torch._dynamo.reset()
    report = uniprefill.last_drop_report(fast)
    assert report.points and report.overall_retention < 0.6
    assert bool(torch.isfinite(out).all())


def test_only_the_exact_causal_mask_passes_the_check():
    n = 7
    for like in (torch.zeros(0, dtype=torch.bool), torch.zeros(0), torch.zeros(0, dtype=torch.bfloat16)):
        causal = causal_view(n, like)[None, None]
        assert is_causal_mask(causal) and is_causal_mask(causal.expand(3, 1, n, n))
        padded = causal.expand(2, 1, n, n).clone()
        padded[1, ..., 0] = False if like.dtype == torch.bool else torch.finfo(like.dtype).min
        assert not is_causal_mask(padded)
        if like.dtype != torch.bool:
            soft = causal.clone()
            soft[..., 0, 1] = -5.0  # a later key penalised, not hidden
            assert not is_causal_mask(soft)
            assert not is_causal_mask(torch.zeros(1, 1, n, n, dtype=like.dtype))  # every key visible


def _llama():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def test_a_4d_mask_given_by_the_caller_is_accelerated_only_when_it_is_causal():
    """The same input role serves a caller's own `[rows, 1, N, N]` mask: a causal one is
    accelerated, any other (here every key hidden from query 5 on but the first five) runs the
    original graph; both equal the plain model."""
    model = _llama()
    ids = _ids(1)
    n = ids.shape[1]
    causal = causal_view(n, torch.zeros(0, dtype=torch.bool))[None, None]
    other = causal.clone()
    other[..., 5:, 5:] = False
    other[..., torch.arange(n), torch.arange(n)] = True
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        for mask, accelerated in ((causal, True), (other, False)):
            out = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
            ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
            why = exact.backend.last_unaccelerated
            assert (why is None) == accelerated, why
            if not accelerated:
                assert why.kind is Kind.INPUT_NOT_MODELLED and "not the plain causal mask" in why, why
    torch._dynamo.reset()
