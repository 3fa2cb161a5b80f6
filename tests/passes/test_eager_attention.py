"""Eager attention written out by hand (no SDPA path in transformers): the batched-matmul forms
(`passes/eager_attention_forms.py`) and ALiBi as a per-key bias (`sink_ops`, `key_bias`), against
the plain model: p = 1 prefill (one row and a left-padded batch) and greedy generation equal it,
forced drops give finite logits, and the rewrite counts are exact."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch._dynamo

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill import sink_ops  # noqa: F401  (registers the sink ops)
from uniprefill.ops import _position_mask

U = torch.ops.uniprefill
SMALL = dict(sink=16, last_q=16, block_size=16)
ATOL = 1e-5


def _ids(rows, n, seed=1):
    return torch.randint(3, 128, (rows, n), generator=torch.Generator().manual_seed(seed))


def _bloom():
    from transformers import AutoModelForCausalLM, BloomConfig

    cfg = BloomConfig(vocab_size=128, hidden_size=64, n_layer=4, n_head=4, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _xglm():
    from transformers import AutoModelForCausalLM, XGLMConfig

    cfg = XGLMConfig(vocab_size=128, d_model=64, ffn_dim=128, num_layers=4, attention_heads=4,
                     max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _gpt_neox_japanese():
    from transformers import AutoModelForCausalLM, GPTNeoXJapaneseConfig

    cfg = GPTNeoXJapaneseConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                intermediate_multiple_size=2, max_position_embeddings=4096, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _mpt():
    from transformers import AutoModelForCausalLM, MptConfig

    cfg = MptConfig(vocab_size=128, d_model=64, n_layers=4, n_heads=4, max_seq_len=4096, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _naive_biased(q, k, v, visible, scale, bias):
    """softmax(q k^T * scale + bias[key], hidden keys at the most negative float) v; `bias` [B|1, H, 1, K]."""
    logits = (q @ k.transpose(-1, -2)) * scale + bias
    logits = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, -1) @ v


def test_packed_attention_reads_the_per_key_bias_at_original_positions():
    """After a drop each kept key keeps the bias the model gave it (ALiBi's slope * its position):
    the packed op on the kept keys equals attention over those keys with their original bias."""
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 4, 41, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    bias = (slopes[:, None, None] * torch.arange(n)).repeat(b, 1, 1)  # Bloom's [B * H, 1, N]
    bias[h:] += 3.0  # another row, another bias: each row reads its own
    kept = [torch.tensor([0, 3, 4, 9, 17, 30, 40]), torch.tensor([1, 2, 8, 20, 39, 40])]
    pack = lambda x: torch.cat([x[r:r + 1, :, kept[r]] for r in range(b)], dim=2)  # noqa: E731
    positions = torch.cat(kept)
    counts = torch.tensor([len(kept[0]), len(kept[1])])
    out = U.packed_sink_attention(pack(q), pack(k), pack(v), positions, counts, 0, 0.3, None,
                                  key_bias=bias, bias_scale=1.0)
    start = 0
    for r in range(b):
        idx = kept[r]
        visible = _position_mask(idx, idx, 0)[None, None]
        row_bias = bias.view(b, h, 1, n)[r:r + 1, :, :, idx]
        want = _naive_biased(q[r:r + 1, :, idx], k[r:r + 1, :, idx], v[r:r + 1, :, idx], visible, 0.3, row_bias)
        torch.testing.assert_close(out[:, :, start:start + len(idx)], want, atol=ATOL, rtol=0)
        start += len(idx)
    dense = U.dense_sink_attention(q, k, v, None, 0, 0.3, None, key_bias=bias, bias_scale=2.0)
    want = _naive_biased(q, k, v, _position_mask(torch.arange(n), torch.arange(n), 0)[None, None], 0.3,
                         2.0 * bias.view(b, h, 1, n))
    torch.testing.assert_close(dense, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("build, sites_key, sites", [
    (_bloom, "sink_attention_sites", 4),  # ALiBi: the sink op with key_bias
    (_mpt, "sink_attention_sites", 4),  # ALiBi sliced from a table in each layer, masked_fill: key_bias on all tokens
    (_xglm, "eager_attention_sites", 4),  # bmm form, clamped logits: an SDPA call
    (_gpt_neox_japanese, "eager_attention_sites", 4),  # baddbmm on zeros: an SDPA call
], ids=["bloom", "mpt", "xglm", "gpt_neox_japanese"])
def test_eager_forms_are_accelerated_and_equal_the_plain_model(build, sites_key, sites):
    model = build()
    ids = _ids(2, 240)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        one = exact(input_ids=ids[:1], use_cache=False).logits
        torch.testing.assert_close(one, model(input_ids=ids[:1], use_cache=False).logits, atol=ATOL, rtol=0)
        report = uniprefill.graph_reports(exact)[-1]
        assert report.rewritten, report.reason
        assert [r.kind for r in report.layers] == ["full"] * 4
        assert report.counts[sites_key] == sites and report.counts["drop_points"] == 4
        assert report.counts["dense_attention"] == 1 and report.counts["packed_attention"] == 3
        assert [p.layer for p in uniprefill.last_drop_report(exact).points] == [0, 1, 2, 3]
        two = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(two[0], ref[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(two[1, 37:], ref[1, 37:], atol=ATOL, rtol=0)
        # these models compute attention themselves (no attention interface): a call that fills a
        # cache runs the plain model, so generation equals it and says why (MPT's config generates
        # without a cache: every step is a prefill, accelerated)
        gen = exact.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(gen, model.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0))
        if model.config.use_cache:
            assert "attention interface" in str(exact.backend.last_unaccelerated)
        else:
            assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        torch._dynamo.reset()
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
        logits = fast(input_ids=ids[:1], use_cache=False).logits
        assert fast.backend.last_unaccelerated is None, fast.backend.last_unaccelerated  # the rewritten graph ran
    assert torch.isfinite(logits).all()
    history = uniprefill.last_drop_report(fast)
    assert history is not None and history.points and history.overall_retention < 0.75
    torch._dynamo.reset()


def _captured(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(*args)
    torch._dynamo.reset()
    return graphs[0]


def _bloom_like(q, k, v, bias, mask):
    """Bloom's attention: heads merged into the batch axis, the bias added by baddbmm."""
    b, h, n, d = q.shape
    scores = bias.baddbmm(q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(-1, -2), beta=1.0, alpha=0.25)
    probs = torch.softmax(scores.view(b, h, n, -1) + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs.view(b * h, n, -1), v.reshape(b * h, n, d)).view(b, h, n, d)


@pytest.mark.parametrize("per_key", [True, False], ids=["per_key_bias", "full_bias"])
def test_only_a_per_key_bias_is_read_as_alibi(per_key):
    """A bias with one value per key (`[B * H, 1, N]`) becomes `key_bias`; one that differs per query
    (`[B * H, N, N]`) is not a per-key bias, and the pattern is left alone."""
    from uniprefill.passes.sink_attention import canonicalize_sink_attention

    b, h, n, d = 1, 4, 24, 8
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    bias = torch.randn(b * h, 1 if per_key else n, n)
    mask = torch.zeros(b, 1, n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    gm = _captured(_bloom_like, q, k, v, bias, mask)
    new, with_op, plain = canonicalize_sink_attention(gm)
    assert (with_op, plain) == ((1, 0) if per_key else (0, 0))
    if per_key:
        site = next(n for n in new.graph.nodes if n.target is U.sink_attention.default)
        assert site.kwargs["key_bias"] is not None and site.kwargs["scale"] == 0.25
        torch.testing.assert_close(U.sink_attention(q, k, v, mask, scale=0.25, key_bias=bias),
                                   _bloom_like(q, k, v, bias, mask), atol=ATOL, rtol=0)


def _eager_mask_of_transformers_5_17(*args, dtype=torch.float32, **kwargs):
    """transformers 5.17's `eager_mask`: SDPA's boolean mask made additive with a `torch.tensor(0.0)` zero (later
    releases build the zero with `torch.zeros(())`)."""
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("allow_is_causal_skip", None)
    mask = sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)
    if mask is not None:
        mask = torch.where(mask, torch.tensor(0.0, device=mask.device, dtype=dtype), torch.finfo(dtype).min)
    return mask


@pytest.mark.parametrize("arch", ["llama-eager", "gemma2", "gpt-oss"])
def test_eager_masks_of_transformers_5_17_are_read(arch, monkeypatch):
    """On transformers 5.17 (the oldest supported) no eager-attention model was accelerated: its eager masks put a
    `torch.tensor(0.0)` node where the mask reader expected `torch.zeros(())` (the fuzzer on the GPU box's
    transformers 5.17, 2026-12-05). With 5.17's mask patched in: the model drops, and at p = 1 equals the plain
    model, one row and a left-padded batch."""
    from transformers.masking_utils import AttentionMaskInterface

    from uniprefill.testing.fuzz import build_model

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "eager", _eager_mask_of_transformers_5_17)
    model = build_model(arch, torch.float32)
    ids = _ids(2, 150)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        got = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        assert uniprefill.last_drop_report(exact).points
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(got[0], ref[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(got[1, 23:], ref[1, 23:], atol=ATOL, rtol=0)
        torch._dynamo.reset()
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
        fast(input_ids=ids[:1], use_cache=False)
        assert fast.backend.last_unaccelerated is None, fast.backend.last_unaccelerated
        assert uniprefill.last_drop_report(fast).overall_retention < 0.75
    torch._dynamo.reset()


def _gptj_like(q, k, v, mask, scale_attn):
    """transformers 5.17's GPT-J `_attn`: float32 logits divided by a float attribute, then the additive mask."""
    logits = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2)) / scale_attn + mask
    probs = torch.nn.functional.softmax(logits, dim=-1).to(v.dtype)
    return torch.matmul(torch.nn.functional.dropout(probs, 0.0, False), v)


def test_logits_divided_by_a_float_dynamo_made_an_input_are_one_attention_node():
    """Under `capture_scalar_outputs` (the backend's setting) dynamo turns a float the logits are divided by
    (GPT-J's `scale_attn` on transformers 5.17) into a SymFloat graph input; the site's scale is its reciprocal,
    computed in the graph. Before, the pattern was left as plain ops and the model ran unaccelerated."""
    from uniprefill.passes.sink_attention import canonicalize_sink_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 37, 16, generator=g) for _ in range(3))
    visible = torch.ones(37, 37, dtype=torch.bool).tril()[None, None]
    mask = torch.where(visible, torch.zeros(()), torch.finfo(torch.float32).min)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # dynamic, as the backend's restarted trace
        torch.compile(_gptj_like, backend=capture, dynamic=True)(q, k, v, mask, 4.0)
    torch._dynamo.reset()
    gm, example_inputs = graphs[0]
    divisors = [n for n in gm.graph.nodes if n.target is operator.truediv]
    assert divisors and isinstance(divisors[0].args[1], torch.fx.Node), "the divisor was not made a graph input"
    new, with_op, plain = canonicalize_sink_attention(gm)
    assert (with_op, plain) == (0, 1)
    site = next(n for n in new.graph.nodes if "scaled_dot_product_attention" in str(n.target))
    assert isinstance(site.kwargs["scale"], torch.fx.Node) and site.kwargs["scale"].target is operator.truediv
    torch.testing.assert_close(new(*example_inputs)[0], _gptj_like(q, k, v, mask, 4.0), atol=ATOL, rtol=0)
