"""Mamba hybrids whose selective scan runs transformers' PyTorch fallback (`scan_ops`, `compat`).

Traced as it stands, the fallback holds for one range of prompt lengths only (torch's recursive
associative scan), and the backend refuses it (`Kind.LENGTH_SPECIALIZED`). Routed through
`uniprefill::selective_scan` (`uniprefill.compile` does it), it is one node that runs on whatever
length it receives: at p = 1 Jamba equals the plain model, and after a drop its later Mamba
layers scan the kept tokens in order, which equals an eager run of the model's own modules on
those tokens.
"""

from __future__ import annotations

import inspect

import torch
import torch._dynamo

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.backend import UniPrefillBackend
from uniprefill.compat import make_linear_attention_opaque
from uniprefill.testing.census import tiny_config
from uniprefill.testing.eager_reference import dropped_run
from uniprefill.unaccelerated import Kind

SMALL = dict(sink=16, last_q=16, block_size=16)
ATOL = 1e-4
LENGTH = 300  # past every chunk of the fallbacks, and 256..383 for the recursive scan


def _model(model_type: str, **overrides):
    """The census's tiny config (Jamba: mamba, attention, mamba, attention), seeded weights."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _ids(rows: int = 1):
    return torch.randint(3, 128, (rows, LENGTH), generator=torch.Generator().manual_seed(1))


def _jamba_reference(model, ids: torch.Tensor, kept: dict[int, torch.Tensor]) -> torch.Tensor:
    """Last-token logits of Jamba run module by module, cutting the residual stream after the
    attention of each drop layer L to the ORIGINAL positions `kept[L]` (Jamba has no positional
    encoding: attention after a drop is causal over the kept tokens; Mamba scans them in order)."""
    h = model.model.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])
    for idx, layer in enumerate(model.model.layers):
        x = layer.input_layernorm(h)
        if hasattr(layer, "mamba"):
            out = layer.mamba(hidden_states=x, cache=None, attention_mask=None)
        else:
            causal = torch.ones(pos.numel(), pos.numel(), dtype=torch.bool).tril()[None, None]
            out, _ = layer.self_attn(hidden_states=x, attention_mask=causal)
        h = h + out
        if idx in kept:
            take = torch.searchsorted(pos, kept[idx])
            assert torch.equal(pos[take], kept[idx]), "kept positions must be a subset of the live ones"
            h, pos = h[:, take], kept[idx]
        h = h + layer.feed_forward(layer.pre_ff_layernorm(h))
    return model.lm_head(model.model.final_layernorm(h))[:, -1]


def _zamba_shared_block(shared, h, emb, idx, mask):
    """The shared attention block on `h ++ embeddings`: up to transformers 5.24 it takes the
    embeddings as `original_hidden_states` and concatenates them itself; from 5.25 the hybrid
    layer concatenates and the block takes the concatenation."""
    if "original_hidden_states" in inspect.signature(shared.forward).parameters:
        return shared(h, original_hidden_states=emb, layer_idx=idx, attention_mask=mask)
    return shared(torch.cat([h, emb], dim=-1), layer_idx=idx, attention_mask=mask)


def _zamba_reference(model, ids: torch.Tensor, kept: dict[int, torch.Tensor]) -> torch.Tensor:
    """Zamba the same way (no positional encoding either). A hybrid layer runs the shared attention
    block on the live tokens, `t = linear(mlp(attention(h ++ embeddings)))`; at a drop layer the
    stream (h, t and the embeddings the shared block reads) is cut there, at the residual add
    `h + t` after the attention, and the layer's Mamba scans the kept tokens:
    `h = h + mamba(norm(h + t))`."""
    h = model.model.embed_tokens(ids)
    emb, pos = h.clone(), torch.arange(ids.shape[1])
    for idx, layer in enumerate(model.model.layers):
        mamba, t = getattr(layer, "mamba_decoder", layer), None
        if hasattr(layer, "shared_transf"):
            causal = torch.ones(pos.numel(), pos.numel(), dtype=torch.bool).tril()[None, None]
            t = layer.linear(_zamba_shared_block(layer.shared_transf, h, emb, idx, causal))
        if idx in kept:
            take = torch.searchsorted(pos, kept[idx])
            assert torch.equal(pos[take], kept[idx]), "kept positions must be a subset of the live ones"
            h, t, emb, pos = h[:, take], t[:, take], emb[:, take], kept[idx]
        x = mamba.input_layernorm(h if t is None else h + t)
        h = h + mamba.mamba(hidden_states=x, cache=None, attention_mask=None)
    return model.lm_head(model.model.final_layernorm(h))[:, -1]


def _scan_nodes(gm) -> int:
    scan = torch.ops.uniprefill.selective_scan
    return sum(1 for n in gm.graph.nodes if n.target in (scan, scan.default))


def test_the_scan_op_is_the_function_at_every_length_and_its_fake_agrees():
    """The op runs the model's own function (so any length, including fewer kept tokens), and
    `torch.library.opcheck` holds its fake (shapes, dtypes) to the real outputs."""
    import importlib

    from uniprefill.scan_ops import original_of

    name = "transformers.models.jamba.modeling_jamba"
    function = f"{name}.mamba_selective_scan"
    importlib.import_module(name)
    g = torch.Generator().manual_seed(0)
    A = -torch.rand(6, 4, generator=g) - 0.5
    D, bias = torch.rand(6, generator=g), torch.rand(6, generator=g)
    for length in (1, 7, 300):
        x, dt, z = (torch.randn(2, 6, length, generator=g) for _ in range(3))
        B, C = (torch.randn(2, 4, length, generator=g) for _ in range(2))
        args = (x, dt, A, B, C, D, z, bias, True, True, False, True, function)
        out, state = torch.ops.uniprefill.selective_scan(*args)
        ref_out, ref_state = original_of(function)(x, dt, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True,
                                                 return_last_state=True)
        assert torch.equal(out, ref_out) and torch.equal(state, ref_state) and state.shape == (2, 6, 4)
        torch.library.opcheck(torch.ops.uniprefill.selective_scan.default, args,
                              test_utils=("test_schema", "test_faketensor"))
    no_state = torch.ops.uniprefill.selective_scan(x, dt, A, B, C, None, None, None, False, False, False, False,
                                                   function)
    assert no_state[1].numel() == 0 and no_state[0].shape == x.shape


def test_the_fallback_becomes_one_op_per_mamba_layer_and_the_graph_is_rewritten():
    model = _model("jamba")
    import transformers.models.jamba.modeling_jamba as jamba

    from uniprefill.scan_ops import MARK

    make_linear_attention_opaque(model)  # returns what it patched: nothing if an earlier test did
    assert hasattr(jamba.mamba_selective_scan, MARK)
    assert make_linear_attention_opaque(model) == [], "patching is idempotent"
    backend = UniPrefillBackend(UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    with torch.no_grad():
        out = torch.compile(model, backend=capture, dynamic=True)(input_ids=_ids(), use_cache=False).logits[:, -1]
        ref = model(input_ids=_ids(), use_cache=False).logits[:, -1]
    mamba_layers = sum(hasattr(layer, "mamba") for layer in model.model.layers)
    assert mamba_layers == 2 and [_scan_nodes(gm) for gm in graphs] == [mamba_layers]
    report = backend.graphs[-1]
    assert report.rewritten, report.reason
    assert report.drop_layers == (1, 3)
    assert [r.kind for r in report.layers] == ["linear", "full", "linear", "full"]
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_jamba_p1_equals_the_plain_model_one_row_padded_rows_and_generation():
    model = _model("jamba")
    ids = _ids(2)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        one = exact(input_ids=ids[:1], use_cache=False).logits[:, -1]
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        torch.testing.assert_close(one, model(input_ids=ids[:1], use_cache=False).logits[:, -1], atol=ATOL, rtol=0)
        two = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
        ref_two = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
        torch.testing.assert_close(two, ref_two, atol=ATOL, rtol=0)
        gen = exact.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        ref_gen = model.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, ref_gen)


def test_jamba_drop_scans_the_kept_tokens_and_equals_the_eager_reference():
    model = _model("jamba")
    ids = _ids()
    out, kept, full = dropped_run(model, ids, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
    with torch.no_grad():
        ref = _jamba_reference(model, ids, kept)
    assert sorted(kept) == [1, 3]
    assert kept[1].numel() <= 0.6 * LENGTH and kept[3].numel() < kept[1].numel(), "the drops must drop tokens"
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    # the later Mamba layer (2) ran on the kept tokens: the answer moved
    assert (out - full).abs().max() > 10 * ATOL, "dropping must change the answer of a random model"


def test_without_the_op_the_traced_scan_is_refused_as_length_specialized():
    """A negative case: where the fallback is not routed through the op (plain torch.compile;
    `uniprefill.compile` patches the model), the recursive scan's graph is refused, never rewritten."""
    import importlib
    from unittest import mock

    from transformers import AutoModelForCausalLM

    from uniprefill.scan_ops import original_of

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("falcon_mamba")).eval()  # the same fallback, cheap to trace
    name = "transformers.models.falcon_mamba.modeling_falcon_mamba"
    module = importlib.import_module(name)
    original = original_of(f"{name}.mamba_selective_scan")  # as transformers has it
    backend = UniPrefillBackend(UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
    torch._dynamo.reset()
    with torch.no_grad(), mock.patch.object(module, "mamba_selective_scan", original):
        torch.compile(model, backend=backend, dynamic=True)(input_ids=_ids(), use_cache=False)
    torch._dynamo.reset()
    assert not backend.graphs[0].rewritten
    assert backend.graphs[0].reason.kind is Kind.LENGTH_SPECIALIZED, backend.graphs[0].reason
    assert "holds only for prompt lengths 256..383" in backend.graphs[0].reason


def test_zamba_shared_attention_drops_like_the_reference_generation_refused_with_reason():
    """Zamba: Mamba layers with one attention block shared by several layers. Its prefill drops
    and equals the eager reference; decode steps after a drop cannot tell which layer a shared
    module serves, so generate() runs unaccelerated with that reason, and equals the plain model."""
    # mamba, mamba, hybrid, mamba: one drop point (2), Mamba scans after it; weights 5x the default
    # scale and a slowly decaying scan (A = -exp(-4)), so that the dropped tokens' share of the state shows
    model = _model("zamba", initializer_range=0.1)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.A_log.fill_(-4.0)
    ids = _ids()
    with torch.no_grad():
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))
        one = exact(input_ids=ids, use_cache=False).logits[:, -1]
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        torch.testing.assert_close(one, model(input_ids=ids, use_cache=False).logits[:, -1], atol=ATOL, rtol=0)
        gen = exact.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        ref_gen = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(gen, ref_gen)
        assert "no layer index of its own" in str(exact.backend.last_unaccelerated)
        torch._dynamo.reset()
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
        out = fast(input_ids=ids, use_cache=False).logits[:, -1]
        history = uniprefill.last_drop_report(fast)
        kept = {p.layer: p.kept_positions(0, LENGTH) for p in history.points}
        ref = _zamba_reference(model, ids, kept)
        full = model(input_ids=ids, use_cache=False).logits[:, -1]
    assert sorted(kept) == [2] and kept[2].numel() <= 0.6 * LENGTH
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert (out - full).abs().max() > 10 * ATOL, "dropping must change the answer of a random model"


def test_kimi_delta_attention_fallback_is_routed_through_the_chunked_op():
    """Kimi-Linear's `chunk_kimi_delta_attention` (64-token chunks, a per-channel gate) shares
    `uniprefill::chunk_gated_delta_rule`: patched by `make_linear_attention_opaque`, equal to the
    function past one chunk, its fake checked (float32 state, output in the query's dtype)."""
    import transformers.models.kimi_linear.modeling_kimi_linear as kimi

    from uniprefill.compat import restore_linear_attention
    from uniprefill.scan_ops import MARK, original_of

    model = _model("kimi_linear")
    name = "transformers.models.kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention"
    original = original_of(name)
    make_linear_attention_opaque(model)
    assert getattr(kimi.chunk_kimi_delta_attention, MARK) is original
    g = torch.Generator().manual_seed(0)
    q, k, gate = (torch.randn(1, 100, 2, 8, generator=g) for _ in range(3))
    v, beta = torch.randn(1, 100, 2, 4, generator=g), torch.rand(1, 100, 2, generator=g)
    args = (q, k, v, -gate.abs(), beta, None, True, True, name)
    out, state = torch.ops.uniprefill.chunk_gated_delta_rule(*args)
    ref_out, ref_state = original(q, k, v, g=-gate.abs(), beta=beta, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, ref_out) and torch.equal(state, ref_state) and state.dtype == torch.float32
    torch.library.opcheck(torch.ops.uniprefill.chunk_gated_delta_rule.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    assert restore_linear_attention(model) == [kimi.__name__] and kimi.chunk_kimi_delta_attention is original
    torch.testing.assert_close(torch.ops.uniprefill.chunk_gated_delta_rule(*args)[0], out, atol=0, rtol=0)


def test_a_patched_model_still_trains():
    """The ops have no backward; the patch is process-wide, so a patched model that trains must
    reach the function itself (gradients flow through the Mamba scan)."""
    model = _model("jamba")
    make_linear_attention_opaque(model)
    ids = _ids()[:, :40]
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].mamba.x_proj.weight.grad.abs().sum() > 0


def test_the_chunked_op_over_zero_tokens_hands_back_a_copy_of_its_initial_state_not_the_state_itself():
    """transformers' Gated DeltaNet fallback over zero tokens returns its initial state itself; a custom op's output
    may not alias an input, so the op raised (assisted generation of a plain Qwen3-Next in a process where
    `uniprefill.compile` had routed the fallback through the op failed: "must not also be an input")."""
    make_linear_attention_opaque(_model("qwen3_next"))
    batch, heads, dim = 1, 2, 8
    q = k = torch.randn(batch, 0, heads, dim)
    v = torch.randn(batch, 0, heads, dim)
    g, beta = torch.randn(batch, 0, heads), torch.rand(batch, 0, heads)
    state = torch.randn(batch, heads, dim, dim)
    out, final = torch.ops.uniprefill.chunk_gated_delta_rule(
        q, k, v, g, beta, state, True, False, "transformers.models.qwen3_next.modeling_qwen3_next."
                                             "torch_chunk_gated_delta_rule")
    assert out.shape == v.shape and torch.equal(final, state)
    assert final.untyped_storage().data_ptr() != state.untyped_storage().data_ptr()


@torch.no_grad()
def test_assisted_generation_of_a_plain_qwen3_next_is_unchanged_by_compiling_another_model():
    plain, draft = _model("qwen3_next"), _model("qwen3_next")
    ids = torch.randint(3, 100, (1, 90), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, assistant_model=draft)
    before = plain.generate(input_ids=ids, **kwargs)
    uniprefill.compile(_model("qwen3_next"), UniPrefillConfig(p=1.0, **SMALL))  # routes the fallback, process-wide
    assert torch.equal(plain.generate(input_ids=ids, **kwargs), before)
