"""The "uniprefill" torch.compile backend on tiny random-weight Hugging Face models."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

import uniprefill
from uniprefill import UniPrefillConfig

from uniprefill.testing.eager_reference import reference_last_logits

SMALL = dict(sink=16, last_q=16, block_size=16)
ATOL = 1e-4


def _llama(layers=4):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _gemma3():
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
                           max_position_embeddings=4096)
    cfg.layer_types = ["sliding_attention", "full_attention", "sliding_attention",
                       "full_attention", "sliding_attention", "sliding_attention"]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


MODELS = {"llama": (_llama, (1, 2)), "gemma3": (_gemma3, (1, 3))}


def _ids(rows=1, length=300, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (rows, length), generator=gen)


@pytest.mark.parametrize("policy", ["cumulative", "suspend"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_p1_equals_uncompiled_model(arch, policy):
    build, drops = MODELS[arch]
    model = build()
    ids = _ids(2)
    mask = torch.ones_like(ids)
    mask[1, :29] = 0
    compiled = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=drops, policy=policy, **SMALL))
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert out.shape == ref.shape
    torch.testing.assert_close(out[:, -1], ref[:, -1], atol=ATOL, rtol=0)
    report = uniprefill.graph_reports(compiled)[-1]
    assert report.rewritten, report.reason
    assert report.counts["drop_points"] == len(drops)
    history = uniprefill.last_drop_report(compiled)
    assert [p.layer for p in history.points] == list(drops)
    assert history.points[0].entering == (300, 271)
    assert history.overall_retention == 1.0


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_dropping_matches_eager_reference(arch):
    build, drops = MODELS[arch]
    model = build()
    ids = _ids(1, 333)
    compiled = uniprefill.compile(model, UniPrefillConfig(keep_ratio=(0.6, 0.7), drop_layers=drops, **SMALL))
    with torch.no_grad():
        out = compiled(input_ids=ids, use_cache=False).logits[:, -1]
        history = uniprefill.last_drop_report(compiled)
        kept = {p.layer: p.kept_positions(0, 333) for p in history.points}
        ref = reference_last_logits(model, ids, kept)
        full = model(input_ids=ids, use_cache=False).logits[:, -1]
    assert history.points[0].kept[0] < 0.7 * 333, "the drop must really drop tokens"
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert (out - full).abs().max() > 10 * ATOL, "dropping must change the answer of a random model"


def test_content_selection_keeps_a_superset_and_matches_the_reference():
    """selection="content": at one drop point it needs p of the free blocks' score from free
    blocks alone, so it keeps every block the paper's rule keeps, and more wherever the sink
    and window hold any score; the rewritten model equals the eager reference on its kept set."""
    model = _llama()
    ids = _ids(1, 333)
    kept = {}
    with torch.no_grad():
        for rule in ("paper", "content"):
            compiled = uniprefill.compile(model, UniPrefillConfig(p=0.5, drop_layers=(1,), selection=rule, **SMALL))
            out = compiled(input_ids=ids, use_cache=False).logits[:, -1]
            kept[rule] = uniprefill.last_drop_report(compiled).points[0].kept_positions(0, 333)
            torch.testing.assert_close(out, reference_last_logits(model, ids, {1: kept[rule]}), atol=ATOL, rtol=0)
    assert set(kept["paper"].tolist()) < set(kept["content"].tolist())
    assert kept["content"].numel() < 333, "content at p = 0.5 still drops"


def test_sliding_window_is_over_original_positions():
    model = _gemma3()
    ids = _ids(1, 320)
    # Drop at layer 1, then sliding layers 2, 4, 5 run on kept tokens with a 24-token window.
    compiled = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.4, drop_layers=(1,), **SMALL))
    with torch.no_grad():
        out = compiled(input_ids=ids, use_cache=False).logits[:, -1]
        kept = {1: uniprefill.last_drop_report(compiled).points[0].kept_positions(0, 320)}
        ref = reference_last_logits(model, ids, kept)
    gaps = kept[1][1:] - kept[1][:-1]
    assert gaps.max() > 1, "some tokens must have been dropped inside the sequence"
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_window_over_compacted_indices_is_an_ablation_that_changes_the_answer():
    """window_positions="compacted" (the released code's rule): sliding layers after a drop
    see the last `window` KEPT tokens; it matches an eager reference with that rule, and
    differs from the default over original positions."""
    model = _gemma3()
    ids = _ids(1, 320)
    compiled = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.4, drop_layers=(1,),
                                                          window_positions="compacted", **SMALL))
    with torch.no_grad():
        out = compiled(input_ids=ids, use_cache=False).logits[:, -1]
        kept = {1: uniprefill.last_drop_report(compiled).points[0].kept_positions(0, 320)}
        ref = reference_last_logits(model, ids, kept, window_positions="compacted")
        original = reference_last_logits(model, ids, kept)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert (out - original).abs().max() > 10 * ATOL, "the two window rules must differ on this prompt"
    with pytest.raises(ValueError, match="window_positions='kept'"):
        UniPrefillConfig(window_positions="kept")
    default = UniPrefillConfig()
    assert default.stable_hash() == UniPrefillConfig(window_positions="original").stable_hash()
    assert default.stable_hash() != UniPrefillConfig(window_positions="compacted").stable_hash()


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_batch_rows_equal_rows_run_alone(arch):
    build, drops = MODELS[arch]
    model = build()
    ids = _ids(2, 310)
    mask = torch.ones_like(ids)
    mask[0, :45] = 0
    compiled = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=drops, **SMALL))
    with torch.no_grad():
        both = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
        counts = uniprefill.last_drop_report(compiled).points[0].kept
        first = compiled(input_ids=ids[:1, 45:], use_cache=False).logits[:, -1]
        second = compiled(input_ids=ids[1:], use_cache=False).logits[:, -1]
    assert counts[0] != counts[1], "rows of different lengths keep different numbers of tokens"
    torch.testing.assert_close(both[0], first[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(both[1], second[0], atol=ATOL, rtol=0)


def test_sliding_layers_share_one_mask_per_layout():
    model = _gemma3()  # sliding layers 0 and 2 before the drop at 3, full layer 1
    compiled = uniprefill.compile(model, UniPrefillConfig(p=0.9, drop_layers=(3,), **SMALL))
    ids = _ids(2, 300)
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # padding: a padded mask too, and still one per window
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    counts = uniprefill.graph_reports(compiled)[0].counts
    assert counts["dense_attention"] == 4 and counts["dense_masks"] == 2  # sliding and full
    assert counts["packed_attention"] == 2 and counts["packed_masks"] == 1  # sliding 4 and 5
    # rows agree where nothing was dropped yet: the last token's logits come after the drop,
    # so compare an undropped model instead
    full = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(3,), **SMALL))
    with torch.no_grad():
        same = full(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.allclose(same[0], want[0], atol=ATOL) and torch.allclose(same[1, 17:], want[1, 17:], atol=ATOL)
    assert got.shape == want.shape


def test_the_models_own_mask_building_is_dead_code_after_the_rewrite(monkeypatch):
    """transformers builds N x N masks with `&` (operator.and_); our attention ops build their
    own, so the model's must not survive dead-code elimination (they once did: and_'s trailing
    underscore read as an in-place write, and two unused N x N masks were built per prefill)."""
    import operator

    from uniprefill.passes import graph_calls, token_drop

    graphs = []
    run = token_drop.TokenDropPass.run
    monkeypatch.setattr(token_drop.TokenDropPass, "run", lambda self: graphs.append(run(self)) or graphs[-1])
    compiled = uniprefill.compile(_gemma3(), UniPrefillConfig(p=0.9, drop_layers=(3,), **SMALL))
    ids = _ids(1, 300)
    with torch.no_grad():
        compiled(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    (result,) = graphs
    targets = [n.target for n in result.graph_module.graph.nodes if n.op == "call_function"]
    assert operator.and_ not in targets and operator.le not in targets
    assert not graph_calls.writes_in_place(_call_node(operator.and_))
    assert graph_calls.writes_in_place(_call_node(operator.iand))
    assert graph_calls.writes_in_place(_call_node(operator.setitem))
    # everything the rewrite inserts is a torch.library op: no Python helper of ours, no object attribute
    ours = [n.name for n in result.graph_module.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("uniprefill")]
    assert ours == [], ours
    assert not any(n.op == "get_attr" and "uniprefill" in str(n.target) for n in result.graph_module.graph.nodes)
    inserted = {str(n.target) for n in result.graph_module.graph.nodes if str(n.target).startswith("uniprefill.")}
    assert {"uniprefill.begin_prefill.default", "uniprefill.live_tokens.default", "uniprefill.score_select.default",
            "uniprefill.record_drop.default"} <= inserted, inserted
    history = uniprefill.last_drop_report(compiled)
    assert history is not None and [p.layer for p in history.points] == [3], "the recorder ops wrote the history"


def _call_node(target):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    return graph.call_function(target, (x, x))


def test_dense_masks_leave_out_padding_that_pads_nothing():
    """With host counts showing no padding, a causal mask is not built (SDPA runs is_causal,
    as the plain model does) and a sliding mask has no padding term; with padding, both are
    built in full."""
    from uniprefill import ops  # noqa: F401  (registers the ops)

    n = 40
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 16, generator=gen) for _ in range(3))
    valid = torch.ones(2, n, dtype=torch.long)
    full_rows = torch.tensor([n, n])
    causal = torch.ops.uniprefill.dense_mask(q, valid, 0, full_rows)
    assert causal.numel() == 0
    out = torch.ops.uniprefill.dense_attention(q, k, v, valid, 0, 0.25, False, causal)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    assert torch.allclose(out, want, atol=1e-6)
    sliding = torch.ops.uniprefill.dense_mask(q, valid, 8, full_rows)  # additive: 0 visible, -inf not
    pos = torch.arange(n)
    assert sliding.dtype == q.dtype and set(sliding.unique().tolist()) == {0.0, float("-inf")}
    assert torch.equal(sliding[0, 0] == 0, (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 8))
    valid[1, :5] = 0
    padded = torch.ops.uniprefill.dense_mask(q, valid, 0, torch.tensor([n, n - 5]))
    assert padded.shape == (2, 1, n, n)
    assert (padded[1, 0, 10, :5] == float("-inf")).all() and (padded[0, 0, 10, :5] == 0).all()
    assert torch.equal(torch.ops.uniprefill.dense_mask(q, valid, 0, None), padded)  # no counts: always built


@pytest.mark.parametrize("block", [7, 40, 1 << 26])  # several query rows per block, a partial last block, one block
def test_masks_built_block_by_block_equal_the_whole_mask(monkeypatch, block):
    """`dense_mask` and `packed_masks` fill their additive masks a block of query rows at a time
    (the boolean temporaries stay one block's size); every block size gives the mask built from
    whole-matrix comparisons: causal, windowed, left padding (pad queries see themselves), and
    packed rows over original positions."""
    from uniprefill import attention_ops

    monkeypatch.setattr(attention_ops, "_MASK_BLOCK_ELEMENTS", block * 23)
    n, window = 23, 6
    q = torch.zeros(2, 1, n, 4, dtype=torch.bfloat16)
    valid = torch.ones(2, n, dtype=torch.long)
    valid[1, :4] = 0
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]

    def additive(visible):
        return torch.zeros(visible.shape, dtype=torch.bfloat16).masked_fill(~visible, float("-inf"))

    want = additive((j <= i) & (j > i - window))
    assert torch.equal(torch.ops.uniprefill.dense_mask(q, valid, window, torch.tensor([n, n]))[0, 0], want)
    padded = torch.ops.uniprefill.dense_mask(q, valid, window, torch.tensor([n, n - 4]))
    for b in range(2):
        seen = ((j <= i) & (j > i - window) & valid[b].bool()[None, :]) | (i == j)
        assert torch.equal(padded[b, 0], additive(seen))
    positions = torch.tensor([0, 3, 4, 9, 10, 11, 20, 1, 2, 8])  # two packed rows: 7 and 3 kept tokens
    counts = torch.tensor([7, 3])
    flat = torch.ops.uniprefill.packed_masks(q, positions, counts, window)
    start = offset = 0
    for count in counts.tolist():
        pos = positions[start:start + count]
        seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        assert torch.equal(flat[offset:offset + count * count].view(count, count), additive(seen))
        start, offset = start + count, offset + count * count
    assert offset == flat.numel()


def test_rewrite_counts_and_one_graph_for_all_lengths():
    model = _llama()
    compiled = uniprefill.compile(model, UniPrefillConfig(p=0.9, drop_layers=(1, 2), **SMALL))
    with torch.no_grad():
        for length in (300, 411, 517):
            compiled(input_ids=_ids(1, length), use_cache=False)
            assert uniprefill.last_drop_report(compiled).seq_len == length
    reports = uniprefill.graph_reports(compiled)
    assert len(reports) == 1, "one dynamic-shape graph serves every length"
    assert reports[0].counts["drop_points"] == 2
    assert reports[0].counts["dense_attention"] == 2  # layers 0 and 1
    assert reports[0].counts["packed_attention"] == 2  # layers 2 and 3
    assert [r.kind for r in reports[0].layers] == ["full"] * 4
    assert [r.drop_point for r in reports[0].layers] == [False, True, True, False]


def test_layer_kinds_of_a_sliding_hybrid_and_auto_rule():
    model = _gemma3()
    compiled = uniprefill.compile(model, UniPrefillConfig(drop_layers="all", **SMALL))
    with torch.no_grad():
        compiled(input_ids=_ids(1, 300), use_cache=False)
    report = uniprefill.graph_reports(compiled)[0]
    kinds = [r.kind for r in report.layers]
    expected = ["full" if t == "full_attention" else "sliding" for t in model.config.layer_types]
    assert kinds == expected
    assert all(r.window == 24 for r in report.layers if r.kind == "sliding")
    assert report.drop_layers == (1, 3)


def test_short_inputs_run_unchanged():
    model = _llama()
    compiled = uniprefill.compile(model, UniPrefillConfig(p=0.5, drop_layers=(1,), min_tokens=1000, **SMALL))
    ids = _ids(1, 300)
    with torch.no_grad():
        out = compiled(input_ids=ids, use_cache=False).logits
        ref = model(input_ids=ids, use_cache=False).logits
    assert uniprefill.last_drop_report(compiled) is None
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_drop_layer_that_is_not_full_attention_raises():
    """At compile time now, from the model's config; the graph's own check stays behind it."""
    model = _gemma3()
    with pytest.raises(ValueError, match="not full-attention"):
        uniprefill.compile(model, UniPrefillConfig(drop_layers=(2,), **SMALL))
    compiled = torch.compile(model, backend="uniprefill", options={"drop_layers": (2,), **SMALL})
    with pytest.raises(Exception, match="not full-attention"), torch.no_grad():
        compiled(input_ids=_ids(1, 300), use_cache=False)


def _alibi_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention with an ALiBi bias (-slope_h * distance, as Bloom and MPT add): not SDPA's
    function of q, k and the mask, so the eager-attention matcher must leave it alone."""
    from transformers.models.llama.modeling_llama import repeat_kv

    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    n = query.shape[-2]
    slopes = 2.0 ** -torch.arange(1, query.shape[1] + 1, dtype=query.dtype, device=query.device)
    distance = torch.arange(n, device=query.device)[:, None] - torch.arange(key.shape[-2], device=query.device)
    scores = (query @ key.transpose(2, 3)) * scaling - slopes[:, None, None] * distance.abs().to(query.dtype)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def test_an_attention_form_the_pass_does_not_know_is_left_unchanged_with_a_reason():
    """Plain eager attention is rewritten to SDPA, soft-capped or with sinks to uniprefill ops
    (tests/passes/test_sinks.py); an eager form the pass does not know (here an ALiBi bias) runs
    unaccelerated with a reason, and strict mode refuses it."""
    from transformers import AttentionInterface

    AttentionInterface.register("uniprefill_test_alibi", _alibi_eager_attention)
    model = _llama()
    model.config._attn_implementation = "uniprefill_test_alibi"
    compiled = uniprefill.compile(model, UniPrefillConfig(p=0.5, **SMALL))
    ids = _ids(1, 300)
    with pytest.warns(UserWarning, match="unaccelerated"), torch.no_grad():
        out = compiled(input_ids=ids, use_cache=False).logits
    report = uniprefill.graph_reports(compiled)[0]
    assert not report.rewritten and "no full-attention" in report.reason
    with torch.no_grad():
        torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits, atol=ATOL, rtol=0)
    torch._dynamo.reset()
    strict = uniprefill.compile(model, UniPrefillConfig(strict=True, **SMALL))
    with pytest.raises(Exception, match="cannot rewrite"), torch.no_grad():
        strict(input_ids=ids, use_cache=False)
    torch._dynamo.reset()


@torch.library.custom_op("uniprefill_test::opaque_linear", mutates_args=())
def _opaque_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


@_opaque_linear.register_fake
def _(x, w):
    return x.new_empty(x.shape[:-1] + (w.shape[0],))


class _OpaqueLinear(torch.nn.Module):
    """Stands in for a quantized / packed linear layer whose kernel the pass cannot inspect."""

    def __init__(self, linear):
        super().__init__()
        self.weight = linear.weight

    def forward(self, x):
        return torch.ops.uniprefill_test.opaque_linear(x, self.weight)


def test_unknown_kernel_after_a_drop_point_is_left_unchanged():
    model = _llama()
    model.model.layers[3].mlp.down_proj = _OpaqueLinear(model.model.layers[3].mlp.down_proj)
    compiled = uniprefill.compile(model, UniPrefillConfig(p=0.5, drop_layers=(1,), **SMALL))
    with pytest.warns(UserWarning, match="unknown custom op"), torch.no_grad():
        compiled(input_ids=_ids(1, 300), use_cache=False)
    report = uniprefill.graph_reports(compiled)[0]
    assert not report.rewritten and "opaque_linear" in report.reason


def test_backend_by_name_with_options():
    from importlib.metadata import entry_points

    if not any(ep.name == "uniprefill" for ep in entry_points(group="torch_dynamo_backends")):
        # e.g. the GPU box, which imports a copied source tree: the name comes from the entry point
        pytest.skip("uniprefill is not pip-installed here, so its torch_dynamo_backends entry point is absent")
    model = _llama()
    compiled = torch.compile(model, backend="uniprefill", options={"p": 1.0, "drop_layers": [1], **SMALL}, dynamic=True)
    ids = _ids(1, 300)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, use_cache=False).logits,
                                   model(input_ids=ids, use_cache=False).logits, atol=ATOL, rtol=0)
    torch._dynamo.reset()
    bad = torch.compile(model, backend="uniprefill", options={"top_p": 0.9}, dynamic=True)
    with pytest.raises(Exception, match="unknown uniprefill option"), torch.no_grad():
        bad(input_ids=ids, use_cache=False)


def test_output_hidden_states_runs_unaccelerated():
    model = _llama()
    compiled = uniprefill.compile(model, UniPrefillConfig(p=0.5, drop_layers=(1,), **SMALL))
    with pytest.warns(UserWarning, match="output_hidden_states"), torch.no_grad():
        compiled(input_ids=_ids(1, 300), use_cache=False, output_hidden_states=True)


@pytest.mark.parametrize("arch,drops", [("tiny-qwen3-next", (3,)), ("tiny-qwen3-next", "all"), ("gpt-oss", "all")])
@pytest.mark.parametrize("p", [1.0, 0.5])
@pytest.mark.parametrize("batch", [1, 2])
def test_output_router_logits_runs_unaccelerated_and_returns_every_row(arch, drops, p, batch):
    """Before: a drop at Qwen3-Next's last layer returned that layer's router logits for the kept rows only (172 of
    300 rows at p = 0.5, nothing said), and p = 1 was rewritten where p = 0.5 with earlier drops was refused."""
    from uniprefill.testing.fuzz import build_model

    model = build_model(arch, torch.float32)
    compiled = uniprefill.compile(model, UniPrefillConfig(p=p, drop_layers=drops, **SMALL))
    ids = _ids(batch, 300)
    with pytest.warns(UserWarning, match="output_router_logits"), torch.no_grad():
        out = compiled(input_ids=ids, use_cache=False, output_router_logits=True)
    ref = model(input_ids=ids, use_cache=False, output_router_logits=True)
    assert compiled.backend.last_unaccelerated is not None and "output_router_logits" in compiled.backend.last_unaccelerated
    assert len(out.router_logits) == len(ref.router_logits)
    for got, want in zip(out.router_logits, ref.router_logits):
        assert got.shape == want.shape and torch.allclose(got, want, atol=ATOL)
    assert torch.allclose(out.logits, ref.logits, atol=ATOL)


@pytest.mark.parametrize("setting", [dict(p=1.0), dict(keep_ratio=0.4)])
def test_a_base_model_without_a_final_norm_returns_every_row(setting):
    """OPT with `do_layer_norm_before=False` has no final norm: its base model returns the last layer's output as it
    is. Before: that came back with the kept rows only (124 of 300 at keep 0.4), against the output contract."""
    from transformers import AutoModel, OPTConfig

    cfg = OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
                    max_position_embeddings=1024, do_layer_norm_before=False, word_embed_proj_dim=64)
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg).eval()
    compiled = uniprefill.compile(model, UniPrefillConfig(drop_layers=(1,), **setting, **SMALL))
    ids = _ids(1, 300)
    with torch.no_grad():
        out = compiled(input_ids=ids, use_cache=False).last_hidden_state
        ref = model(input_ids=ids, use_cache=False).last_hidden_state
    points = compiled.history.points
    assert out.shape == ref.shape and points and points[0].kept[0] == (300 if "p" in setting else 124)
    if "p" in setting:
        assert torch.allclose(out, ref, atol=ATOL)


def test_gather_tokens_refuses_a_value_of_another_layout():
    """A packed value mislabelled as dense must raise, not have its indices wrapped around."""
    import uniprefill.ops  # noqa: F401  (registers the custom ops)

    x = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    idx = torch.tensor([0, 4, 5, 9])  # flat b * N + t over a 2 x 5 grid
    out = torch.ops.uniprefill.gather_tokens(x, idx, 0, 1, 5)
    assert torch.equal(out[0], x.reshape(10, 3)[idx])
    with pytest.raises(RuntimeError, match="mislabelled"):
        torch.ops.uniprefill.gather_tokens(x[:, :3], idx, 0, 1, 5)


@pytest.mark.parametrize("request_kind", ["labels-same-tensor", "labels-copy", "gradients"])
def test_requests_that_need_every_position_run_unaccelerated_or_raise_under_strict(request_kind):
    """`labels=input_ids` reaches dynamo as ONE input (the token ids), so the pass must
    recognise the loss itself; a silently dropped loss was the bug this test pins."""
    model = _llama()
    ids = _ids(1, 300)
    kwargs = dict(input_ids=ids, use_cache=False)
    if request_kind.startswith("labels"):
        kwargs["labels"] = ids if request_kind == "labels-same-tensor" else ids.clone()
    reason = "gradients are enabled" if request_kind == "gradients" else "labels were given"
    with torch.set_grad_enabled(request_kind == "gradients"):
        lenient = uniprefill.compile(model, UniPrefillConfig(p=0.5, drop_layers=(1,), **SMALL))
        with pytest.warns(UserWarning, match=reason):
            out = lenient(**kwargs)
        assert uniprefill.last_drop_report(lenient) is None
        if request_kind.startswith("labels"):
            torch.testing.assert_close(out.loss, model(**kwargs).loss)
        torch._dynamo.reset()
        strict = uniprefill.compile(model, UniPrefillConfig(p=0.5, drop_layers=(1,), strict=True, **SMALL))
        with pytest.raises(Exception, match=reason):
            strict(**kwargs)


@torch.no_grad()
def test_debug_dumps_the_graph_before_and_after_the_rewrite_to_the_logger(caplog):
    import logging

    model = _llama()
    fast = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(1, 2), debug=True, **SMALL))
    with caplog.at_level(logging.INFO, logger="uniprefill.passes"):
        fast(input_ids=_ids(1, 300), use_cache=False)
    messages = [r.getMessage() for r in caplog.records if r.name == "uniprefill.passes"]
    assert any("graph before rewrite" in m for m in messages)
    assert any("graph after rewrite" in m and "score_select" in m for m in messages)


def test_differential_attention_two_calls_sharing_one_map_is_accelerated():
    """DiffLlama applies one softmax map to two halves of the values (two SDPA calls with the same
    queries, mask and scale): the drop point scores with the first call, both run on the kept
    tokens; at p = 1 prefill (padded batch) and greedy generation equal the plain model."""
    import warnings

    from uniprefill.testing.census import _build

    model, _ = _build("diffllama")
    ids = _ids(2, 240)
    mask = torch.ones_like(ids)
    mask[1, :41] = 0
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        out = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
        report = uniprefill.graph_reports(exact)[-1]
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        gen = exact.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0)
        want = model.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
    layers = len(report.layers)
    assert report.rewritten and report.counts["drop_points"] == layers, report
    assert report.counts["dense_attention"] + report.counts["packed_attention"] == 2 * layers
    torch.testing.assert_close(out[0], ref[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1, 41:], ref[1, 41:], atol=ATOL, rtol=0)
    assert torch.equal(gen, want)
    torch._dynamo.reset()
