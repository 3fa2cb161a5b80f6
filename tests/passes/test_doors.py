"""The ordinary doors: each of these gave a silent wrong answer or no acceleration before.

At p = 1 the compiled model must equal the plain model however it is called; where a
call cannot be accelerated soundly it runs unaccelerated and says why.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import uniprefill
from uniprefill import UniPrefillConfig

from .test_backend import MODELS, SMALL, _ids

P1 = UniPrefillConfig(p=1.0, drop_layers=(1, 2), **SMALL)
ATOL = 1e-4


def _llama():
    return MODELS["llama"][0]()


def _last(out):
    return out.logits[:, -1]


def _padded(rows=2, length=300):
    ids = _ids(rows, length)
    mask = torch.ones_like(ids)
    mask[1, :29] = 0
    return ids, mask


@torch.no_grad()
def test_padded_batch_after_a_batch_1_call_equals_the_plain_model():
    """After a batch-1 call the recompiled graph gives the mask's batch axis a symbol of its own;
    the padding mask is still found (by its role) and the pads stay out."""
    model = _llama()
    ids, mask = _padded()
    fast = uniprefill.compile(model, P1)
    fast(input_ids=ids[:1], use_cache=False)
    out = fast(input_ids=ids, attention_mask=mask, use_cache=False)
    torch.testing.assert_close(_last(out), _last(model(input_ids=ids, attention_mask=mask, use_cache=False)),
                               atol=ATOL, rtol=0)
    history = uniprefill.last_drop_report(fast)
    assert history.points[0].entering == (300, 271)


@torch.no_grad()
def test_mask_passed_positionally_is_read_as_the_padding_mask():
    model = _llama()
    ids, mask = _padded()
    fast = uniprefill.compile(model, P1)
    out = fast(ids, mask, use_cache=False)
    torch.testing.assert_close(_last(out), _last(model(ids, mask, use_cache=False)), atol=ATOL, rtol=0)
    assert uniprefill.last_drop_report(fast).points[0].entering == (300, 271)


@pytest.mark.parametrize("positions", ["packed", "strided"])
@torch.no_grad()
def test_packed_or_strided_position_ids_run_unaccelerated_and_say_why(positions):
    model = _llama()
    ids = _ids(1, 300)
    pid = torch.cat([torch.arange(150), torch.arange(150)])[None] if positions == "packed" else (torch.arange(300) * 2)[None]
    fast = uniprefill.compile(model, P1)
    with pytest.warns(UserWarning, match="position_ids are not consecutive"):
        out = fast(input_ids=ids, position_ids=pid, use_cache=False)
    torch.testing.assert_close(_last(out), _last(model(input_ids=ids, position_ids=pid, use_cache=False)),
                               atol=ATOL, rtol=0)
    assert uniprefill.last_drop_report(fast) is None
    assert "not consecutive" in fast.backend.last_unaccelerated
    # consecutive positions from an offset are one document: accelerated, and equal
    offset = (torch.arange(300) + 7)[None]
    out = fast(input_ids=ids, position_ids=offset, use_cache=False)
    torch.testing.assert_close(_last(out), _last(model(input_ids=ids, position_ids=offset, use_cache=False)),
                               atol=ATOL, rtol=0)
    assert uniprefill.last_drop_report(fast) is not None


@torch.no_grad()
def test_training_mode_with_dropout_is_not_rewritten():
    model = _llama()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.train()
    fast = uniprefill.compile(model, P1)
    with pytest.warns(UserWarning, match="dropout is active"):
        fast(input_ids=_ids(1, 300), use_cache=False)
    assert not uniprefill.graph_reports(fast)[-1].rewritten


@pytest.mark.parametrize("mode", ["beam", "padded single row"])
@torch.no_grad()
def test_generate_modes_equal_the_plain_model(mode):
    model = _llama()
    ids = _ids(1, 300)
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=8, do_sample=False)
    if mode == "beam":
        kwargs["num_beams"] = 4
    else:
        mask[:, :100] = 0
    fast = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(1, 2), **SMALL))
    ref = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    out = fast.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(out, ref)


@torch.no_grad()
def test_a_cache_passed_in_for_a_batch_is_filled_not_replaced():
    model = _llama()
    ids, mask = _padded()
    fast = uniprefill.compile(model, P1)
    cache = DynamicCache(config=model.config)
    with pytest.warns(UserWarning, match="cache object was passed in"):
        out = fast(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 300
    assert out.past_key_values is cache


@torch.no_grad()
def test_row_by_row_prefill_keeps_explicit_position_ids():
    model = _llama()
    ids, mask = _padded()
    pid = (torch.arange(300) * 2)[None].expand(2, -1)  # RoPE sees these; strided keeps it visible
    fast = uniprefill.compile(model, P1)
    out = fast(input_ids=ids, attention_mask=mask, position_ids=pid, use_cache=True)
    ref = model(input_ids=ids, attention_mask=mask, position_ids=pid, use_cache=True)
    torch.testing.assert_close(_last(out), _last(ref), atol=ATOL, rtol=0)


@torch.no_grad()
def test_a_multi_token_continuation_of_a_plain_cache_runs_as_the_plain_model():
    model = _llama()
    ids = _ids(1, 300)
    fast = uniprefill.compile(model, P1)
    cache, twin = DynamicCache(config=model.config), DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache)
    model(input_ids=ids, past_key_values=twin)
    more = _ids(1, 40, seed=3)
    out = fast(input_ids=more, past_key_values=cache)
    ref = model(input_ids=more, past_key_values=twin)
    torch.testing.assert_close(out.logits, ref.logits, atol=0, rtol=0)


@torch.no_grad()
def test_plain_torch_compile_drops_from_its_first_call_without_recompiling_per_length():
    model = _llama()
    options = {"p": 1.0, "drop_layers": (1, 2), **SMALL}
    compiled = torch.compile(model, backend="uniprefill", options=options)
    for length in (300, 333, 257):
        ids = _ids(1, length)
        out = compiled(input_ids=ids, use_cache=False)
        torch.testing.assert_close(_last(out), _last(model(input_ids=ids, use_cache=False)), atol=ATOL, rtol=0)
        history = uniprefill.last_drop_report(compiled)
        assert history is not None and history.seq_len == length, "dropped from the first call"
    reports = uniprefill.graph_reports(compiled)
    assert [r.rewritten for r in reports] == [True], "one dynamic graph for every length"


@pytest.mark.parametrize("rows", [2, 3])
@pytest.mark.parametrize("arch", sorted(MODELS))
@torch.no_grad()
def test_plain_torch_compile_whose_first_call_is_a_batch_drops_from_it(arch, rows):
    """A first call of several rows: dynamo's static first trace holds the row count as a constant (a reshape to
    (rows, length, heads, dim)), which packing the rows into one sequence cannot follow, so the rewritten graph
    raised and every call fell back to the plain graph ("the rewritten graph failed", found by the fuzzer's
    plain torch.compile door). The restart now marks the row axis dynamic too."""
    build, drops = MODELS[arch]
    model = build()
    compiled = torch.compile(model, backend="uniprefill", options={"p": 1.0, "drop_layers": drops, **SMALL})
    for batch, length in ((rows, 300), (1, 333), (rows + 1, 257)):
        ids = _ids(batch, length)
        out = compiled(input_ids=ids, use_cache=False)
        torch.testing.assert_close(out.logits, model(input_ids=ids, use_cache=False).logits, atol=ATOL, rtol=0)
        backend = uniprefill.backend._backend_of(compiled)
        assert backend.last_unaccelerated is None, backend.last_unaccelerated
        assert uniprefill.last_drop_report(compiled).seq_len == length


@pytest.mark.parametrize("arch", sorted(MODELS))
@torch.no_grad()
def test_a_batch_traced_with_a_symbolic_length_and_a_constant_row_count_drops_and_equals_the_plain_model(arch):
    """Dynamo traces a symbolic length with the row count as a constant where the caller marked only the length
    dynamic (`mark_dynamic(ids, 1)`, the documented way to avoid a recompile per length) or where its automatic
    dynamic shapes saw the length change and the rows not (another compile of the same forward code ran first).
    The rewrite packs the rows into one sequence, which a constant row count in the graph's sizes (a reshape to
    (3, length, heads, dim), MoE index arithmetic on 6 * length) cannot follow: the rewritten graph raised and the
    call fell back (the fuzzer, round 19c: tiny Qwen3-Next, 3 left-padded rows). The backend now marks the row axis
    dynamic too and retraces, as it does for a static first trace."""
    build, drops = MODELS[arch]
    model = build()
    compiled = torch.compile(model, backend="uniprefill", options={"p": 1.0, "drop_layers": drops, **SMALL})
    for length in (300, 333):
        ids, mask = _ids(3, length), torch.ones(3, length, dtype=torch.long)
        mask[1, :29] = 0
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(mask, 1)
        out = compiled(input_ids=ids, attention_mask=mask, use_cache=False)
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(out.logits[mask.bool()], want[mask.bool()], atol=ATOL, rtol=0)
        backend = uniprefill.backend._backend_of(compiled)
        assert backend.last_unaccelerated is None, backend.last_unaccelerated
        assert uniprefill.last_drop_report(compiled).seq_len == length


@torch.no_grad()
def test_a_first_call_after_automatic_dynamic_shapes_saw_other_lengths_drops_and_equals_the_plain_model():
    """Dynamo's automatic dynamic shapes are per forward code, not per compile: after another compile of the class
    ran 3-row batches of two lengths without a mask, uniprefill's first trace has a symbolic length for the ids,
    constant rows, and the mask's length constant too (round 19c's trigger). The retrace marks both; before, the
    call was refused ("the masks read 2 padding-mask inputs") or the rewritten graph raised."""
    model = _llama()
    other = torch.compile(model, backend="eager")
    for length in (300, 333):
        other(input_ids=_ids(3, length), use_cache=False)
    compiled = torch.compile(model, backend="uniprefill", options={"p": 1.0, "drop_layers": (1, 2), **SMALL})
    ids, mask = _ids(3, 350), torch.ones(3, 350, dtype=torch.long)
    mask[2, :31] = 0
    out = compiled(input_ids=ids, attention_mask=mask, use_cache=False)
    want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out.logits[mask.bool()], want[mask.bool()], atol=ATOL, rtol=0)
    backend = uniprefill.backend._backend_of(compiled)
    assert backend.last_unaccelerated is None, backend.last_unaccelerated
    assert uniprefill.last_drop_report(compiled).seq_len == 350


@torch.no_grad()
def test_a_graph_whose_row_count_is_a_constant_is_refused_by_the_rewrite_with_the_reason():
    """Where a trace keeps the rows a constant after all (the backend's retrace marks them dynamic, above), the
    rewrite refuses the graph with the reason instead of producing one that raises on its sizes."""
    from uniprefill.passes.token_drop import RewriteSkipped, TokenDropPass

    graphs = []
    model = _llama()
    ids = _ids(3, 300)
    torch._dynamo.mark_dynamic(ids, 1)
    torch.compile(model, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)(input_ids=ids,
                                                                                             use_cache=False)
    with pytest.raises(RewriteSkipped, match=r"row count is a constant of the graph \(3 rows"):
        TokenDropPass(graphs[0], P1).run()


@torch.no_grad()
def test_a_4d_mask_left_static_beside_ids_marked_dynamic_drops_and_equals_the_plain_model():
    """The caller marks the ids' length dynamic and passes a 4-D causal mask of its own unmarked: dynamo traces a
    symbolic length and a mask of constant size. The backend's mask analysis raised on it (BackendCompilerFailed
    out of the user's call: the fuzzer, round 20, tiny OLMo-3); the retrace now marks the mask's token axes too."""
    model = _llama()
    compiled = torch.compile(model, backend="uniprefill", options={"p": 1.0, "drop_layers": (1, 2), **SMALL})
    for length in (300, 333):
        ids = _ids(1, length)
        mask = torch.tril(torch.ones(length, length, dtype=torch.bool))[None, None]
        torch._dynamo.maybe_mark_dynamic(ids, 1)
        out = compiled(input_ids=ids, attention_mask=mask, use_cache=False)
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=0)
        backend = uniprefill.backend._backend_of(compiled)
        assert backend.last_unaccelerated is None, backend.last_unaccelerated
        assert uniprefill.last_drop_report(compiled).seq_len == length


@torch.no_grad()
def test_a_graph_with_a_mask_of_constant_size_beside_a_symbolic_length_is_refused_with_the_reason():
    """Where the retrace cannot make such a mask dynamic, the plan refuses the graph instead of its mask analysis
    raising out of the backend."""
    from uniprefill.passes.token_drop import RewriteSkipped, TokenDropPass

    graphs = []
    model = _llama()
    ids, mask = _ids(1, 300), torch.tril(torch.ones(300, 300, dtype=torch.bool))[None, None]
    torch._dynamo.maybe_mark_dynamic(ids, 1)
    torch.compile(model, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)(
        input_ids=ids, attention_mask=mask, use_cache=False)
    # before, the mask analysis raised ("The expanded size of the tensor (300) must match the existing size (37)")
    with pytest.raises(RewriteSkipped, match="constant length in a graph traced with a symbolic one"):
        TokenDropPass(graphs[0], P1).run()


@torch.no_grad()
def test_plain_torch_compile_of_two_models_of_one_class_reports_each_models_own_calls():
    """Dynamo runs one compiled graph for two models of a class compiled with equal options (their parameters are
    graph inputs). Each model's `last_drop_report` is its own latest call's, not the other's; before, the second
    model's calls were reported as the first's and its own report raised "has not run yet"."""
    import copy

    options = {"keep_ratio": 0.3, "drop_layers": (1, 2), **SMALL}
    first, second = _llama(), _llama()
    with torch.no_grad():
        for p in second.parameters():
            p.add_(0.01 * torch.randn_like(p))
    compiled = {name: torch.compile(model, backend="uniprefill", options=dict(options))
                for name, model in (("first", first), ("second", second))}
    plain = {"first": first, "second": second}
    for name, length in (("first", 300), ("second", 333), ("first", 257), ("second", 290)):
        ids = _ids(1, length)
        compiled[name](input_ids=ids, use_cache=False)
        assert uniprefill.last_drop_report(compiled[name]).seq_len == length, name
        other = "second" if name == "first" else "first"
        if (other, length) != ("second", 300):  # the second has run after the first call
            assert uniprefill.last_drop_report(compiled[other]).seq_len != length, f"{name}'s call reported as {other}'s"
    assert [r.rewritten for r in uniprefill.graph_reports(compiled["second"])] == [True]
    # each model's answers are its own (the graph reads the parameters it is given)
    ids = _ids(1, 300)
    for name in compiled:
        reference = copy.deepcopy(plain[name])
        eager = uniprefill.compile(reference, UniPrefillConfig(**options))(input_ids=ids, use_cache=False)
        torch.testing.assert_close(_last(compiled[name](input_ids=ids, use_cache=False)), _last(eager), atol=ATOL,
                                   rtol=0)


@torch.no_grad()
def test_plain_torch_compile_reports_a_first_call_given_inputs_embeds():
    """A graph traced from `inputs_embeds` holds no embedding lookup; the backend finds its model by any parameter,
    so `last_drop_report` works when such a call comes first (before, it raised "has not run yet")."""
    model = _llama()
    compiled = torch.compile(model, backend="uniprefill", options={"p": 1.0, "drop_layers": (1, 2), **SMALL})
    embeds = model.get_input_embeddings()(_ids(1, 300))
    out = compiled(inputs_embeds=embeds, use_cache=False)
    torch.testing.assert_close(_last(out), _last(model(inputs_embeds=embeds, use_cache=False)), atol=ATOL, rtol=0)
    assert uniprefill.last_drop_report(compiled).seq_len == 300


@torch.no_grad()
def test_plain_torch_compile_drops_from_the_first_call_of_a_model_that_embeds_a_view_of_its_ids():
    """GPT-2 embeds `input_ids.view(-1, N)`: the first-call restart finds the token input all the same."""
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=1024)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    compiled = torch.compile(model, backend="uniprefill", options={"p": 1.0, "drop_layers": (1, 2), **SMALL})
    for length in (300, 257):
        ids = _ids(1, length)
        out = compiled(input_ids=ids, use_cache=False)
        torch.testing.assert_close(_last(out), _last(model(input_ids=ids, use_cache=False)), atol=ATOL, rtol=0)
        history = uniprefill.last_drop_report(compiled)
        assert history is not None and history.seq_len == length, "dropped from the first call"
    assert [r.rewritten for r in uniprefill.graph_reports(compiled)] == [True]


@torch.no_grad()
def test_plain_torch_compile_call_that_fills_a_cache_runs_unaccelerated_with_the_reason():
    model = _llama()
    compiled = torch.compile(model, backend="uniprefill", options={"p": 1.0, "drop_layers": (1, 2), **SMALL})
    ids = _ids(1, 300)
    with pytest.warns(UserWarning, match="fills a cache"):
        out = compiled(input_ids=ids)
    torch.testing.assert_close(_last(out), _last(model(input_ids=ids)), atol=ATOL, rtol=0)
    assert uniprefill.last_drop_report(compiled) is None


@torch.no_grad()
def test_plain_torch_compile_of_a_batch_of_three_rows_with_a_hole_in_its_mask_equals_the_plain_model():
    """Plain torch.compile traces the batch as the number 3; the check of what the mask computes evaluated it on 2
    rows against a padding input of 3 and the compile raised ("The size of tensor a (2) must match the size of
    tensor b (3)"; the fuzzer, drawing plain torch.compile calls, found it on 2026-12-05)."""
    model = _llama()
    compiled = torch.compile(model, backend="uniprefill", options={"p": 1.0, "drop_layers": (1, 2), **SMALL})
    ids = _ids(3, 300)
    mask = torch.ones(3, 300)
    mask[1, 40:63] = 0  # a hole inside row 1, a float mask
    out = compiled(input_ids=ids, attention_mask=mask, use_cache=False)
    ref = model(input_ids=ids, attention_mask=mask, use_cache=False)
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], ref.logits[real], atol=ATOL, rtol=0)


@torch.no_grad()
def test_plain_torch_compile_of_forward_then_generate_equals_the_plain_model():
    """transformers' documented idiom: the prefill fills a cache, so it runs unaccelerated
    (with the reason) and the decode continues a complete cache."""
    model = _llama()
    ids = _ids(1, 300)
    ref = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    model.forward = torch.compile(model.forward, backend="uniprefill",
                                  options={"keep_ratio": 0.5, "drop_layers": (1, 2), **SMALL})
    try:
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    finally:
        del model.forward
    assert torch.equal(out, ref)


@torch.no_grad()
def test_a_compiled_forward_method_drops_and_its_report_is_read_from_the_model():
    """`torch.compile(model.forward, ...)` returns a plain function: the report is the model's, and asking the
    function for it says so instead of "not compiled"."""
    model = _llama()
    ids = _ids(1, 300)
    forward = torch.compile(model.forward, backend="uniprefill",
                            options={"keep_ratio": 0.5, "drop_layers": (1, 2), **SMALL})
    out = forward(input_ids=ids, use_cache=False)
    assert out.logits.shape == (1, 300, model.config.vocab_size)
    report = uniprefill.last_drop_report(model)
    assert report is not None and report.points  # it dropped
    with pytest.raises(ValueError, match="pass the model itself"):
        uniprefill.last_drop_report(forward)


def test_numpy_and_torch_scalars_are_accepted_as_settings():
    np = pytest.importorskip("numpy")
    config = UniPrefillConfig(drop_layers=np.array([1, 2]), block_size=np.int64(16), p=np.float32(0.5),
                              keep_ratio=torch.tensor([0.5, 0.6]), sink=np.int32(16))
    assert config.drop_layers == (1, 2) and config.block_size == 16 and config.sink == 16
    assert isinstance(config.p, float) and config.keep_ratio == pytest.approx((0.5, 0.6))


@pytest.mark.parametrize("options, match", [
    ({"drop_layers": [999]}, "has 4 decoder layers"),
    ({"drop_layers": [1, 2], "keep_ratio": [0.5, 0.5, 0.5]}, "3 values for 2 drop points"),
])
def test_settings_that_cannot_fit_the_model_raise_at_compile(options, match):
    with pytest.raises(ValueError, match=match):
        uniprefill.compile(_llama(), UniPrefillConfig(**options))


def test_a_sliding_layer_as_drop_point_raises_at_compile():
    from .test_backend import _gemma3

    with pytest.raises(ValueError, match="not full-attention layers"):
        uniprefill.compile(_gemma3(), UniPrefillConfig(drop_layers=(0,)))


@torch.no_grad()
def test_two_threads_generating_on_one_model_both_equal_the_plain_model():
    import threading

    model = _llama()
    fast = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(1, 2), **SMALL))
    prompts = [_ids(1, 300, seed=s) for s in (1, 2)]
    refs = [model.generate(input_ids=p, max_new_tokens=5, do_sample=False) for p in prompts]
    fast.generate(input_ids=prompts[0], max_new_tokens=2, do_sample=False)  # compile outside the threads
    outs, errors = [None, None], []

    def run(i):
        try:
            with torch.no_grad():
                outs[i] = fast.generate(input_ids=prompts[i], max_new_tokens=5, do_sample=False)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(torch.equal(o, r) for o, r in zip(outs, refs))
    assert "forward" not in vars(model), "generate() left its routing on the model"


def _tiny(config_name: str, **extra):
    import transformers

    cfg = getattr(transformers, config_name)(vocab_size=128, hidden_size=64, num_hidden_layers=3,
                                             num_attention_heads=4, max_position_embeddings=4096, **extra)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@torch.no_grad()
def test_stablelm_generate_after_a_drop_reaches_the_decode_attention():
    """StableLM's attention does not forward extra keyword arguments to the attention function;
    the decode step's history reaches it all the same."""
    model = _tiny("StableLmConfig", intermediate_size=128, num_key_value_heads=2)
    ids = _ids(1, 200)
    fast = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(1,), **SMALL))
    out = fast.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert uniprefill.last_drop_report(fast) is not None
    assert torch.equal(out, model.generate(input_ids=ids, max_new_tokens=5, do_sample=False))


def _calls_the_attention_interface(model, ids) -> bool:
    """Whether the model's attention goes through transformers' attention interface: one plain
    forward with the interface's function for the model's implementation wrapped to count calls
    (a local override of `ALL_ATTENTION_FUNCTIONS`, removed after)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    key = model.config._attn_implementation
    original, calls = ALL_ATTENTION_FUNCTIONS[key], []

    def counting(*args, **kwargs):
        calls.append(key)
        return original(*args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[key] = counting
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        del ALL_ATTENTION_FUNCTIONS[key]
        if ALL_ATTENTION_FUNCTIONS[key] is not original:  # it was a local override before
            ALL_ATTENTION_FUNCTIONS[key] = original
    return bool(calls)


@torch.no_grad()
def test_falcon_generates_through_the_attention_interface_or_unaccelerated_with_the_reason():
    """Falcon's attention bypassed transformers' attention interface up to transformers 5.24
    (it called SDPA itself): there a call that fills a cache runs unaccelerated and says so,
    equal to the plain model, while prefill-only calls still drop. From 5.25 it calls the
    interface: generate() is accelerated, equals the plain model at p = 1, and at keep_ratio 0.5
    drops and decodes over the compacted cache. Which case holds is found by running the model."""
    model = _tiny("FalconConfig", num_kv_heads=2, new_decoder_architecture=True)
    ids = _ids(1, 200)
    reference = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    if not _calls_the_attention_interface(model, ids[:, :8]):
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=(1,), **SMALL))
        with pytest.warns(UserWarning, match="not through transformers' attention interface"):
            out = fast.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
        assert torch.equal(out, reference)
        fast(input_ids=ids, use_cache=False)
        assert uniprefill.last_drop_report(fast) is not None, "prefill-only calls still drop"
        return
    exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(1,), **SMALL))
    out = exact(input_ids=ids, use_cache=False)
    assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
    torch.testing.assert_close(_last(out), _last(model(input_ids=ids, use_cache=False)), atol=ATOL, rtol=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = exact.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert not [w for w in caught if "unaccelerated" in str(w.message)], [str(w.message) for w in caught]
    assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
    assert uniprefill.last_drop_report(exact).points[0].entering == (200,)
    assert torch.equal(out, reference)
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=(1,), **SMALL))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fast.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert not [w for w in caught if "unaccelerated" in str(w.message)], [str(w.message) for w in caught]
    assert fast.backend.last_unaccelerated is None, fast.backend.last_unaccelerated
    point = uniprefill.last_drop_report(fast).points[0]
    assert point.layer == 1 and point.entering == (200,) and point.kept[0] <= 0.6 * 200
    assert out.shape == (1, 205) and torch.equal(out[:, :200], ids)
    cache = DynamicCache(config=model.config)
    fast(input_ids=ids, cache=cache)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [200, 200, point.kept[0]], \
        "layers after the drop cache only the kept tokens"


@torch.no_grad()
def test_a_model_dynamo_cannot_trace_runs_eagerly_and_says_why():
    model = _llama()
    fast = uniprefill.compile(model, P1)

    def untraceable(**kwargs):
        raise torch._dynamo.exc.TorchRuntimeError("RuntimeError when making fake tensor call")

    object.__setattr__(fast, "_compiled_forward", untraceable)
    ids = _ids(1, 300)
    with pytest.warns(UserWarning, match="torch.compile cannot compile this model"):
        out = fast(input_ids=ids, use_cache=False)
    torch.testing.assert_close(_last(out), _last(model(input_ids=ids, use_cache=False)), atol=0, rtol=0)
    strict = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(1, 2), strict=True, **SMALL))
    object.__setattr__(strict, "_compiled_forward", untraceable)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError):
        strict(input_ids=ids, use_cache=False)


class _HalvingScan(torch.nn.Module):
    """A token mixer whose Python code recurses on the length (like Jamba's Mamba scan without
    its kernels): dynamo bounds the traced length on both sides."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def scan(self, x):
        n = x.shape[1]
        if n <= 64:
            return x.cumsum(1)
        half = self.scan(x[:, : n // 2])
        return torch.cat([half, self.scan(x[:, n // 2:]) + half[:, -1:]], dim=1)

    def forward(self, x):
        return self.mlp(x) + 0.01 * self.scan(x)


@torch.no_grad()
def test_a_program_traced_for_a_range_of_lengths_runs_uncompiled_and_says_why():
    """Layers after a drop would run such a program on a kept count it was not traced for
    (Jamba was off by a shape error); the model then runs uncompiled instead of retracing
    every new length only to refuse it."""
    model = _llama()
    model.model.layers[2].mlp = _HalvingScan(model.model.layers[2].mlp)
    fast = uniprefill.compile(model, P1)
    for length in (300, 200, 260):
        ids = _ids(1, length)
        out = fast(input_ids=ids, use_cache=False)
        torch.testing.assert_close(_last(out), _last(model(input_ids=ids, use_cache=False)), atol=ATOL, rtol=0)
        assert "holds only for prompt lengths" in fast.backend.last_unaccelerated
    assert len(fast.backend.graphs) == 1, "traced once, then run uncompiled"
    assert fast.backend.stop_compiling


class _WholeChunks(torch.nn.Module):
    """A token mixer that assumes a whole number of 16-token chunks (a chunked scan without
    padding, as GraniteMoeHybrid's traced at 64 tokens): dynamo guards `N % 16 == 0`."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        b, n, h = x.shape
        chunks = x.reshape(b, n // 16, 16, h).cumsum(2).reshape(b, n, h)
        return self.mlp(x) + 0.01 * chunks


@torch.no_grad()
def test_a_program_that_assumes_whole_chunks_runs_unaccelerated_and_says_why():
    model = _llama()
    model.model.layers[2].mlp = _WholeChunks(model.model.layers[2].mlp)
    fast = uniprefill.compile(model, P1)
    ids = _ids(1, 320)
    mask = torch.ones_like(ids)
    mask[:, :7] = 0  # 313 real tokens after the pads leave: not whole chunks (was: the rewritten graph failed)
    out = fast(input_ids=ids, attention_mask=mask, use_cache=False)
    torch.testing.assert_close(_last(out), _last(model(input_ids=ids, attention_mask=mask, use_cache=False)),
                               atol=ATOL, rtol=0)
    assert "holds only for some prompt lengths" in fast.backend.last_unaccelerated
    assert not fast.backend.stop_compiling, "a guard of this length only: other lengths get their own trace"


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("form", ["causal", "documents"])
def test_plain_torch_compile_with_a_4d_mask_of_the_callers_own_equals_the_plain_model(arch, form):
    """A 4-D mask ([rows, 1, queries, keys]) on plain torch.compile's first call: the restart marked only its query
    axis dynamic, so the retraced graph kept its keys at the first call's length and the backend raised
    (BackendCompilerFailed: "The expanded size of the tensor (37) must match the existing size (61)"), every model,
    transformers 5.17 and 5.25; found by the fuzzer's new 4-D masks. The causal one drops; packed documents run
    unaccelerated with the reason."""
    build, drops = MODELS[arch]
    model = build()
    compiled = torch.compile(model, backend="uniprefill", options={"p": 1.0, "drop_layers": drops, **SMALL})
    for rows, length in ((2, 37), (1, 300), (2, 257)):
        visible = torch.tril(torch.ones(length, length, dtype=torch.bool))
        if form == "documents":
            visible[length // 2:, :length // 2] = False
        kwargs = dict(input_ids=_ids(rows, length), attention_mask=visible[None, None].expand(rows, 1, length, length),
                      use_cache=False)
        torch.testing.assert_close(compiled(**kwargs).logits, model(**kwargs).logits, atol=ATOL, rtol=0)
        backend = uniprefill.backend._backend_of(compiled)
        if length >= 256 and form == "causal":
            assert backend.last_unaccelerated is None and uniprefill.last_drop_report(compiled).seq_len == length
        elif length >= 256:
            assert "not the plain causal mask" in backend.last_unaccelerated
