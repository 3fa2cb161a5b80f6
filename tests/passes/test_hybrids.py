"""The backend on tiny random-weight hybrids: linear/full, conv/full, Mamba2/full, sliding/full."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.models.layer_kinds import layer_kinds
from uniprefill.models.presets import build_random_model

SMALL = dict(sink=16, last_q=16, block_size=16)
HYBRIDS = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-lfm2", "tiny-granitemoehybrid", "tiny-olmo3"]


def _hybrid(name: str, lowest_id: int):
    """The preset with seeded random weights, its layer kinds, its first full layer, a 300-token prompt."""
    torch.manual_seed(0)
    model = build_random_model(name, torch.float32, "cpu")
    kinds = layer_kinds(model.config)
    ids = torch.randint(lowest_id, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(3))
    return model, kinds, kinds.index("full"), ids


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_kinds_parity_and_drop(name):
    model, kinds, first_full, ids = _hybrid(name, lowest_id=0)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits[:, -1]
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(first_full,), **SMALL))
        same = exact(input_ids=ids, use_cache=False).logits[:, -1]
        report = uniprefill.graph_reports(exact)[0]
        assert report.rewritten, report.reason
        assert [r.kind for r in report.layers] == kinds
        torch.testing.assert_close(same, ref, atol=1e-4, rtol=0)
        torch._dynamo.reset()
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=(first_full,), **SMALL))
        out = fast(input_ids=ids, use_cache=False).logits[:, -1]
    history = uniprefill.last_drop_report(fast)
    assert history.points[0].kept[0] <= 0.6 * 300
    assert torch.isfinite(out).all()
    if any(k in ("full", "sliding") for k in kinds[first_full + 1:]):
        # p = 1 reproduces the model to ~1e-7 here; dropping half the tokens must move the answer.
        # (Not when only a short convolution or a fast-decaying SSM follows the drop, as in the
        # tiny LFM2 and GraniteMoeHybrid: the last token then sees only recent, kept tokens.)
        assert (out - ref).abs().max() > 1e-5, "later layers ran on fewer tokens"


def _state_tensors(cache_layer) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every floating-point tensor a cache layer holds (states may sit in per-row
    dicts); integer counters (transformers 5.25's `cumulative_length_linear`) are bookkeeping, not states."""
    out = []
    for name, value in vars(cache_layer).items():
        values = value.values() if isinstance(value, dict) else [value]
        out += [(name, v) for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return out


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_generation_and_the_states_a_prefill_leaves(name):
    """p = 1 generation equals the uncompiled model. At p < 1 the compiled prefill writes the
    state of every linear layer: before the drop point exactly the baseline's; after it, a
    conv state still equals the baseline's (it holds the last few tokens, which are always
    kept, and a convolution is local: a packed tensor mislabelled as dense, gathered twice,
    breaks exactly this), and a recurrent state is written and finite. Full layers cache
    exactly the kept tokens."""
    from transformers import DynamicCache

    model, kinds, first_full, ids = _hybrid(name, lowest_id=3)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=4, do_sample=False)
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(first_full,), **SMALL))
        assert torch.equal(exact.generate(ids, max_new_tokens=4, do_sample=False), ref)
        base = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True).past_key_values
        torch._dynamo.reset()
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.4, drop_layers=(first_full,), **SMALL))
        cache = fast(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True).past_key_values
    history = uniprefill.last_drop_report(fast)
    checked = 0
    for layer, kind in enumerate(kinds):
        mine, theirs = _state_tensors(cache.layers[layer]), _state_tensors(base.layers[layer])
        assert [n for n, _ in mine] == [n for n, _ in theirs] and mine, f"layer {layer} ({kind})"
        if kind == "linear":
            for (state, m), (_, t) in zip(mine, theirs):
                assert m.abs().sum() > 0, f"layer {layer}: {state} never written by the prefill"
                assert torch.isfinite(m).all()
                if layer < first_full or "conv" in state:
                    rel = ((m - t).norm() / t.norm()).item()
                    assert rel < 1e-4, f"layer {layer}: {state}: {rel:.2e}"
                checked += 1
        elif kind == "full":
            assert cache.layers[layer].keys.shape[-2] == history.layer_positions(layer).numel()
    assert checked > 0 or "linear" not in kinds


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-lfm2"])
def test_hybrid_left_padded_batch_generation_equals_each_row_alone(name):
    """Linear-attention / conv states are per row too: a left-padded batch prefilled row by
    row generates, row for row, what each prompt generates alone."""
    torch.manual_seed(0)
    model = build_random_model(name, torch.float32, "cpu")
    first_full = layer_kinds(model.config).index("full")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (320, 280)]
    ids = torch.zeros((2, 320), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, 320 - p.numel():], mask[i, 320 - p.numel():] = p, 1
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.4, drop_layers=(first_full,), **SMALL))
    with torch.no_grad():
        out = fast.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert all(h is not None and h.points for h in fast.row_histories)
        for row, p in enumerate(prompts):
            alone = fast.generate(input_ids=p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
                                  max_new_tokens=4, do_sample=False)
            assert torch.equal(out[row, 320:], alone[0, p.numel():]), f"row {row}"


@pytest.mark.parametrize("name", ["qwen3-next-6", "qwen3.5-6"])
def test_gated_deltanet_layers_after_the_drops_equal_the_eager_reference(name):
    """Full attention at layers 1 and 4 of 6: the Gated DeltaNet layers after each drop point convolve and scan the
    kept tokens only, in order; the eager reference runs each module on those tokens as one sequence."""
    from uniprefill.testing.eager_reference import dropped_run, reference_last_logits
    from uniprefill.testing.fuzz import build_model

    model = build_model(name, torch.float32)
    assert layer_kinds(model.config) == ["linear", "full", "linear", "linear", "full", "linear"]
    ids = torch.randint(3, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    out, kept, full = dropped_run(model, ids, UniPrefillConfig(keep_ratio=0.5, drop_layers=(1, 4), **SMALL))
    assert sorted(kept) == [1, 4] and kept[4].numel() < kept[1].numel() < 200
    out_at_1 = [i for i in range(200) if i not in set(kept[1].tolist())]
    out_at_4 = [i for i in kept[1].tolist() if i not in set(kept[4].tolist())]
    other = sorted(set(kept[1].tolist()) - {out_at_4[0]} | {out_at_1[0]})  # one row of layer 1 swapped, 4's kept
    other = torch.tensor(other)
    with torch.no_grad():
        ref = reference_last_logits(model, ids, kept)
        swapped = reference_last_logits(model, ids, {1: other, 4: kept[4]})
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert (out - full).abs().max() > 1e-3, "the layers after the drops ran on fewer tokens"
    assert (ref - swapped).abs().max() > 1e-5, "the reference tells the kept sets apart"
