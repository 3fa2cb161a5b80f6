"""A mask whose structure reads as causal but whose values are not (passes/mask_meaning.py): the
layer is not rewritten, the model runs unaccelerated with the reason, and its answer is the plain
model's. Found by a review: before the check, both masks below were rewritten as causal."""

from __future__ import annotations

import warnings

import torch
import torch._dynamo
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.passes.mask_meaning import _differs

SMALL = dict(sink=16, last_q=16, block_size=16)


def _soft_mask(q, k):
    later = torch.arange(k.shape[-2], device=q.device)[None, :] > torch.arange(q.shape[-2], device=q.device)[:, None]
    return (later.to(q.dtype) * -2.0)[None, None]  # later keys penalised by -2, not hidden


def _every_key_visible(q, k):
    # a comparison (so the structure reads "causal") that no pair of positions fails
    return (torch.arange(k.shape[-2], device=q.device)[None, :] <= torch.arange(q.shape[-2], device=q.device)[:, None]
            + 10**6)[None, None]


def _sdpa_with(mask_fn):
    def attention(module, q, k, v, attention_mask, scaling, dropout=0.0, **kwargs):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_fn(q, k), scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return attention


def _run(name, fn):
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, eager_mask)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)
    cfg._attn_implementation = name
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        out = compiled(input_ids=ids, use_cache=False).logits
        ref = model(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    return uniprefill.graph_reports(compiled)[-1]


def test_a_soft_additive_mask_is_not_read_as_causal():
    report = _run("uniprefill_test_soft_mask", _sdpa_with(_soft_mask))
    assert not report.rewritten and "soft mask" in report.reason, report.reason


def test_a_comparison_that_hides_nothing_is_not_read_as_causal():
    report = _run("uniprefill_test_every_key", _sdpa_with(_every_key_visible))
    assert not report.rewritten and "does not compute the causal mask" in report.reason, report.reason


def test_the_values_compared_are_those_the_rewrite_builds():
    n = 9
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    padding = torch.ones(2, n, dtype=torch.long)
    padding[1, :3] = 0
    causal = (k <= q)[None, None] & padding.bool()[:, None, None, :]
    assert _differs(causal, n, 2, 0, padding) is None
    additive = torch.zeros(2, 1, n, n).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert _differs(additive, n, 2, 0, padding) is None
    # padded query rows are not compared; a real row that sees a padded key is
    wrong = causal.clone()
    wrong[1, 0, 0, 0] = True
    assert _differs(wrong, n, 2, 0, padding) is None
    wrong[1, 0, 5, 1] = True
    assert "does not compute the causal mask" in _differs(wrong, n, 2, 0, padding)
    windowed = causal & (q - k < 4)[None, None]
    assert _differs(windowed, n, 2, 4, padding) is None
    assert "window of 3" in _differs(windowed, n, 2, 3, padding)
