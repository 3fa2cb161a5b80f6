"""The differential fuzzer's fixed-seed slice: random doors against the plain model.

The long form is `uniprefill fuzz --cases 10000 --seed S` (docs/benchmarks.md); CI runs a
slice that covers every architecture and every kind of case in a few minutes.
"""

from __future__ import annotations

import random

import pytest
import torch

from uniprefill.testing import fuzz, fuzz_cases, fuzz_reference


def test_fuzz_slice_has_no_mismatch_and_explains_every_unaccelerated_call():
    summary = fuzz.run_fuzz(cases=40, seed=20261202, fresh_every=20)
    assert summary.cases == 40
    assert summary.mismatches == 0, str(summary)
    assert summary.by_status["equal"] >= 30, str(summary)  # not a slice of plain-model refusals
    assert summary.accelerated_calls >= 20, str(summary)


def test_fuzz_detects_a_wrong_answer():
    """The oracle itself: a compiled model whose logits are off is reported as a mismatch."""
    pool = fuzz._Pool()
    model, fast = pool.get("tiny-llama", torch.float32, p=1.0)
    forward = fast.forward
    fast.forward = lambda *a, **k: _perturbed(forward(*a, **k))
    result = fuzz._forward_case(random.Random(3), _SinglePool(model, fast), 7, "tiny-llama", torch.float32)
    assert result.status == "mismatch", result


def _perturbed(out, by=1e-2):
    out.logits = out.logits + by
    return out


class _SinglePool:
    def __init__(self, model, fast):
        self.entry = (model, fast)

    def get(self, *args, **kwargs):
        return self.entry


@pytest.mark.parametrize("arch", fuzz.ARCHS)
def test_every_fuzz_architecture_builds_and_runs(arch):
    model = fuzz.build_model(arch, torch.float32)
    assert not model.training
    with torch.no_grad():
        logits = model(input_ids=torch.randint(3, 100, (1, 20)), use_cache=False).logits
    assert logits.shape[:2] == (1, 20) and torch.isfinite(logits).all()


def test_a_greedy_divergence_counts_as_a_tie_only_where_the_plain_model_scores_both_tokens_alike():
    model = fuzz.build_model("tiny-llama", torch.float32)
    with torch.no_grad():
        model.lm_head.weight[6] = model.lm_head.weight[5]  # tokens 5 and 6 always tie exactly
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, -1]
    ref = torch.cat([ids, torch.tensor([[5]])], dim=1)
    tied = torch.cat([ids, torch.tensor([[6]])], dim=1)
    assert "a tie" in fuzz._tie_at_divergence(model, tied, ref, mask, 40, torch.float32)
    far = int((logits - logits[5]).abs().argmax())  # the token the plain model scores farthest from 5
    wrong = torch.cat([ids, torch.tensor([[far]])], dim=1)
    assert fuzz._tie_at_divergence(model, wrong, ref, mask, 40, torch.float32) is None


def test_a_divergence_under_logits_processors_is_judged_on_the_processed_scores():
    """The "processors" mode (repetition penalty, no repeated 2-grams) picks the highest PROCESSED score, so a tie
    there is judged after the same processors (round 21, seed 1037001 on transformers 5.17: tiny Gemma-2 in bf16
    decoded 122 where the plain model decoded 39, which it scores one bf16 step apart, 0.3340 vs 0.3359; before,
    this mode had no tie check and the case counted as a mismatch). A token the penalty moves, or one the 2-gram
    rule bans, is never a tie."""
    model = fuzz.build_model("tiny-llama", torch.float32)
    with torch.no_grad():
        model.lm_head.weight[6] = model.lm_head.weight[5]  # tokens 5 and 6 always score alike before processing
    process = fuzz_cases._processors({"repetition_penalty": 1.2, "no_repeat_ngram_size": 2})
    ids = torch.randint(10, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ref, tied = (torch.cat([ids, torch.tensor([[t]])], dim=1) for t in (5, 6))
    assert "a tie" in fuzz._tie_at_divergence(model, tied, ref, mask, 40, torch.float32, process)
    penalised = ids.clone()
    penalised[0, 3] = 5  # token 5 is in the prompt: the penalty moves its score and not 6's
    ref, other = (torch.cat([penalised, torch.tensor([[t]])], dim=1) for t in (5, 6))
    assert "a tie" in fuzz._tie_at_divergence(model, other, ref, mask, 40, torch.float32)  # unprocessed: alike
    assert fuzz._tie_at_divergence(model, other, ref, mask, 40, torch.float32, process) is None
    banned = ids.clone()
    banned[0, 10:12] = torch.tensor([ids[0, -1], 6])  # the 2-gram (last token, 6) already occurred: 6 is banned
    ban_only = fuzz_cases._processors({"repetition_penalty": 1.0, "no_repeat_ngram_size": 2})  # penalty 1: none
    ref, other = (torch.cat([banned, torch.tensor([[t]])], dim=1) for t in (5, 6))
    assert fuzz._tie_at_divergence(model, other, ref, mask, 40, torch.float32, ban_only) is None
    assert "a tie" in fuzz._tie_at_divergence(model, other, ref, mask, 40, torch.float32,
                                              fuzz_cases._processors({"repetition_penalty": 1.0,
                                                                      "no_repeat_ngram_size": 3}))
    assert fuzz_cases._processors({"do_sample": False}) is None


def test_a_reference_case_that_runs_unaccelerated_for_a_stated_reason_is_checked_against_the_plain_model(
        monkeypatch):
    """A p < 1 case whose graph is refused with a reason is not "unexplained": it must equal the plain model, and
    a wrong answer there is still a mismatch (on transformers 5.17 GPT-OSS's eager masks were refused, and the
    case was reported "unexplained" although the backend said why)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def unread_mask(*args, dtype=torch.float32, **kwargs):  # an additive mask whose "zero" is no zero
        kwargs.pop("allow_is_causal_skip", None)
        mask = sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)
        return torch.where(mask, torch.tensor(0.25, dtype=dtype), torch.finfo(dtype).min)

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "eager", unread_mask)
    pool = fuzz._Pool()
    result = fuzz._reference_case(random.Random(5), pool, 11, "gpt-oss", torch.float32)
    assert result.status == "equal" and result.accelerated == 0, result
    assert result.reasons and "mask built with" in result.reasons[0], result
    model, fast = pool.get("gpt-oss", torch.float32, keep_ratio=0.5)
    forward = fast.forward
    fast.forward = lambda *a, **k: _perturbed(forward(*a, **k))
    wrong = fuzz._reference_case(random.Random(5), _SinglePool(model, fast), 11, "gpt-oss", torch.float32)
    assert wrong.status == "mismatch", wrong


def test_a_reference_case_whose_rewritten_graph_raised_is_an_error(monkeypatch):
    """A rewritten graph that raises falls back to the original graph (the answer is right, the reason says so):
    the reference case reports it as an error, as every other kind of case does, not as an explained call."""
    from uniprefill.backend import UniPrefillBackend

    guarded = UniPrefillBackend._guarded

    def failing(self, original, result):
        def boom(*args):
            raise RuntimeError("boom: a bug of the rewrite")
        result.graph_module = boom
        return guarded(self, original, result)

    monkeypatch.setattr(UniPrefillBackend, "_guarded", failing)
    result = fuzz._reference_case(random.Random(5), fuzz._Pool(), 11, "tiny-llama", torch.float32)
    assert result.status == "error" and "rewritten graph failed" in result.detail, result


class _PlainPool:
    """A pool whose plain-torch.compile door hands out a given (model, compiled) pair."""

    def __init__(self, model, compiled):
        self.entry = (model, compiled)

    def get_plain(self, *args, **kwargs):
        return self.entry


def test_the_plain_torch_compile_door_equals_the_plain_model_and_accounts_for_every_call():
    """Through `torch.compile(model, backend="uniprefill")`, `model.compile(...)` and `model.forward =
    torch.compile(model.forward, ...)`: every case equal (or the plain model refused the input), and some calls ran
    the rewritten graph. Seeds 0-8 and 16 reach every door (seed 7 a forward through the compiled method, 8 its
    generate, 5 a call whose length axis the caller marked dynamic, 16 a call under `inference_mode`; the seeds as
    drawn since torch.compile's keywords are, 2026-12-07)."""
    pool = fuzz._Pool()
    results = [fuzz._plain_compile_case(random.Random(seed), pool, seed, "tiny-llama", torch.float32)
               for seed in (*range(9), 16)]
    assert {r.status for r in results} <= {"equal", "invalid"}, [(r.status, r.detail) for r in results]
    assert sum(r.accelerated for r in results) >= 1, [(r.kind, r.reasons) for r in results]
    assert {r.kind for r in results} == {"forward (torch.compile)", "generate (model.compile)",
                                         "generate (compiled forward)"}
    assert "'marked': 3" in results[5].detail, results[5]  # the draw that marks the length axis dynamic happens
    # (this seed's call fills a cache and runs unaccelerated anyway: the fix it led to is tested in test_doors.py)
    assert "under inference_mode" in results[9].detail, results[9]  # the calling context is drawn at this door too
    method = results[7]  # a forward long enough to drop ran the rewritten graph or said why (`_outcome`)
    assert "(method)" in method.detail and method.status == "equal", method
    assert method.accelerated or method.reasons, method


@pytest.mark.parametrize("flags", [(("dynamic", False),), (("dynamic", True),), (("fullgraph", True),)])
def test_the_plain_torch_compile_door_with_torch_compile_keywords_equals_the_plain_model(flags, monkeypatch):
    """A user's own torch.compile keywords (`dynamic=False`: a graph per shape, `dynamic=True`, `fullgraph=True`)
    at the plain door: every case equal, or invalid where the plain model refused the input or (fullgraph) raises
    under dynamo's eager backend too; the keywords are named in the detail, and calls still run the rewritten graph."""
    from uniprefill.testing import fuzz_plain_compile

    monkeypatch.setattr(fuzz_plain_compile, "_draw_flags", lambda rng: flags)
    pool = fuzz._Pool()
    results = [fuzz._plain_compile_case(random.Random(seed), pool, seed, "tiny-llama", torch.float32)
               for seed in (0, 2, 6, 7, 9)]  # 7 and 9 run the rewritten graph, 6 asks for hidden states
    assert {r.status for r in results} <= {"equal", "invalid"}, [(r.status, r.detail) for r in results]
    assert all(f"{flags[0][0]}={flags[0][1]}" in r.detail for r in results if r.status == "equal"), results
    assert sum(r.accelerated for r in results) >= 1, [(r.kind, r.reasons) for r in results]
    invalid = [r for r in results if r.status == "invalid" and "eager backend too" in r.detail]
    assert not invalid or flags == (("fullgraph", True),), invalid


def test_a_raise_under_fullgraph_is_invalid_only_where_the_eager_backend_raises_too():
    """`_raised_under_flags`: under fullgraph=True the same call through dynamo's eager backend decides; a raise only
    under uniprefill, or without fullgraph, propagates (for `run_case` to count as an error)."""
    from uniprefill.testing.fuzz_plain_compile import _raised_under_flags

    def eager_raises(flags):
        raise RuntimeError("graph break")

    result = _raised_under_flags(fuzz.CaseResult(1, "tiny-llama", "forward", "equal"), ValueError("ours"),
                                 (("fullgraph", True),), eager_raises)
    assert result.status == "invalid" and "graph break" in result.detail, result
    with pytest.raises(ValueError, match="ours"):
        _raised_under_flags(fuzz.CaseResult(1, "tiny-llama", "forward", "equal"), ValueError("ours"),
                            (("fullgraph", True),), lambda flags: None)
    called = []
    with pytest.raises(ValueError, match="ours"):
        _raised_under_flags(fuzz.CaseResult(1, "tiny-llama", "forward", "equal"), ValueError("ours"),
                            (("dynamic", False),), called.append)
    assert not called


def test_the_plain_torch_compile_door_reports_wrong_logits_and_calls_that_never_reached_the_backend():
    import copy

    model = fuzz.build_model("tiny-llama", torch.float32)
    compiled = torch.compile(copy.deepcopy(model), backend="uniprefill", options={"p": 1.0, **fuzz.SETTINGS})
    original = compiled.forward
    compiled.forward = lambda *a, **k: _perturbed(original(*a, **k))
    forward_seed = next(s for s in range(50) if random.Random(s).random() >= 0.25)  # a forward case, not generate
    wrong = fuzz._plain_compile_case(random.Random(forward_seed), _PlainPool(model, compiled), 1, "tiny-llama",
                                     torch.float32)
    assert wrong.status == "mismatch", wrong
    # a "compiled" model that never reaches uniprefill's backend (as dynamo runs a frame past its recompile limit):
    # a call long enough to drop without a report or a reason is unexplained, never counted as explained
    uncompiled = copy.deepcopy(model)
    statuses = [fuzz._plain_compile_case(random.Random(s), _PlainPool(model, uncompiled), s, "tiny-llama",
                                         torch.float32) for s in range(6)]
    assert any(r.status == "unexplained" for r in statuses), [(r.status, r.reasons) for r in statuses]
    assert all(r.status == "unexplained" or r.reasons == ["shorter than min_tokens"] * len(r.reasons)
               for r in statuses if r.status != "invalid"), [(r.status, r.reasons) for r in statuses]
    assert not any(r.accelerated for r in statuses)


def test_bf16_logits_of_a_batch_prefilled_row_by_row_count_as_a_tie_only_where_the_plain_model_parts_from_itself():
    """GPT-OSS in bf16 on a left-padded batch: the plain model's batched logits part from its own rows run one at a
    time by more than the tolerance (rounding in another order); the compiled model, which prefills such a batch
    row by row, equals the latter. That is a tie, counted apart; logits off both are still a mismatch."""
    import uniprefill

    model = fuzz.build_model("gpt-oss", torch.bfloat16)
    fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(p=1.0, drop_layers=fuzz._first_full_layers(model),
                                                                 **fuzz.SETTINGS))
    ids = torch.randint(3, 128, (3, 228), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :50], mask[1, :10], mask[2, :100] = 0, 0, 0
    kwargs = dict(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        ref, out = model(**kwargs).logits, fast(**kwargs).logits
    assert fast.row_histories is not None
    assert fuzz._compare_logits(out, ref, mask, None, torch.bfloat16) is not None  # the plain batch disagrees
    assert "rounding" in fuzz._rows_alone_tie(model, fast, out, ref, mask, kwargs, torch.bfloat16)
    assert fuzz._rows_alone_tie(model, fast, out + 0.5, ref, mask, kwargs, torch.bfloat16) is None


def test_an_fp32_model_under_bf16_autocast_ties_the_same_way_with_its_rows_run_under_autocast_too():
    """Round 55's one mismatch (case 1087004261240): tiny Qwen3-Next in fp32 under bf16 autocast, a left-padded batch
    of two rows that the compiled model prefills row by row. Its logits equal the plain model's rows run one at a
    time under the same autocast, bit for bit; the plain model's batched logits part from both by 0.031 (bf16's
    tolerance 0.03): rounding, a tie. The fuzzer checked that only for bf16 models; the rows alone must run under
    the call's context, since without autocast they are fp32 and equal neither."""
    import uniprefill

    from uniprefill.testing.fuzz_cases import _autocast_bf16_no_grad

    model = fuzz.build_model("qwen3-next-6", torch.float32)
    fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(p=1.0, drop_layers=fuzz._first_full_layers(model),
                                                                 **fuzz.SETTINGS))
    ids = torch.randint(3, model.config.vocab_size, (2, 127), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :17], mask[1, :8] = 0, 0
    kwargs = dict(input_ids=ids, attention_mask=mask)
    with _autocast_bf16_no_grad():
        ref, out = model(**kwargs).logits, fast(**kwargs).logits
    assert fast.row_histories is not None
    assert fuzz._compare_logits(out, ref, mask, None, torch.bfloat16) is not None  # the plain batch disagrees
    assert "rounding" in fuzz._rows_alone_tie(model, fast, out, ref, mask, kwargs, torch.bfloat16,
                                              _autocast_bf16_no_grad)
    assert fuzz._rows_alone_tie(model, fast, out, ref, mask, kwargs, torch.bfloat16) is None  # rows alone in fp32
    assert fuzz._rows_alone_tie(model, fast, out, ref, mask, kwargs, torch.float32, _autocast_bf16_no_grad) is None


class _Scripted(random.Random):
    """A Random whose choice / randint / random calls return the given answers in order."""

    def __init__(self, answers):
        super().__init__(0)
        self.answers = list(answers)

    def choice(self, seq):
        return self.answers.pop(0)

    def randint(self, a, b):
        return self.answers.pop(0)

    def random(self):
        return self.answers.pop(0)


def test_a_decode_case_whose_bf16_batch_prefill_parts_from_the_plain_batch_as_its_rows_alone_do_is_a_tie():
    """Round 17's one flagged case (GPT-OSS bf16, 2 rows of 183 tokens, 27 pads): the decode case compared the row
    by row prefill with the plain batch only; the plain model's own rows alone part from its batch by as much."""
    case = 1011004033220
    rows, length, pad_branch, pads, embeds = 2, 183, 0.1, 27, 0.9
    result = fuzz._decode_case(_Scripted([rows, length, pad_branch, pads, embeds]), fuzz._Pool(), case, "gpt-oss",
                               torch.bfloat16)
    assert result.status == "tie" and "rounding" in result.detail, result


@pytest.mark.parametrize("mode", ["chunked prefill", "mask inferred", "stop tokens", "processors", "beam",
                                  "beam sample", "no cache", "logits returned",
                                  "assistant model"])
def test_the_generate_modes_equal_the_plain_model_and_explain_every_unaccelerated_call(mode):
    """Each of these `generate` modes at p = 1, on a transformer and a sliding-window hybrid, over several seeds:
    equal to the plain model (or a tie), and a call that ran unaccelerated says why."""
    pool = fuzz._Pool()
    results = [fuzz._generate_case(random.Random(seed), pool, seed, arch, torch.float32, mode=mode)
               for arch in ("tiny-llama", "tiny-gemma3") for seed in range(3)]
    assert {r.status for r in results} <= {"equal", "tie"}, [(r.status, r.detail) for r in results]
    assert all(r.accelerated or r.reasons for r in results), [(r.detail, r.reasons) for r in results]
    if mode == "chunked prefill":
        assert any("prefill_chunk_size" in why for r in results for why in r.reasons), [r.reasons for r in results]


def test_returned_logits_off_by_a_margin_that_keeps_the_tokens_are_a_mismatch():
    """The "logits returned" mode compares every step's logits, not only the tokens: the compiled model's first step
    off by 1e-2 (its tokens unchanged) is a mismatch naming the logits."""
    pool = fuzz._Pool()
    _, fast = pool.get("tiny-llama", torch.float32, p=1.0)
    generate = fast.generate

    def off_first_step(**kwargs):
        out = generate(**kwargs)
        out.logits = (out.logits[0] + 1e-2, *out.logits[1:])
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast, "generate", off_first_step)
        result = fuzz._generate_case(random.Random(3), pool, 3, "tiny-llama", torch.float32, mode="logits returned")
    assert result.status == "mismatch" and "returned logits" in result.detail, result
    right = fuzz._generate_case(random.Random(3), pool, 3, "tiny-llama", torch.float32, mode="logits returned")
    assert right.status == "equal", right


def test_a_token_mismatch_replays_the_plain_model_and_names_a_reference_that_does_not_repeat_itself():
    """After a `generate` mismatch the plain model runs again from the same seed: the detail says whether it gave
    its first answer again, or another one (process state moving the reference's numerics, not a compiled bug)."""
    pool = fuzz._Pool()
    model, fast = pool.get("tiny-llama", torch.float32, p=1.0)
    generate = fast.generate

    def shifted(**kwargs):  # the compiled model's new tokens off by one
        out = generate(**kwargs)
        length = kwargs["input_ids"].shape[1]
        return torch.cat([out[:, :length], (out[:, length:] + 1) % model.config.vocab_size], 1)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast, "generate", shifted)
        result = fuzz._generate_case(random.Random(3), pool, 3, "tiny-llama", torch.float32, mode="sample")
        assert result.status == "mismatch" and "same seed: the same)" in result.detail, result
        plain, answers = model.generate, []

        def drifting(**kwargs):  # the plain model's answer moves between its two calls
            out = plain(**kwargs)
            answers.append(out)
            moved = torch.cat([out[:, :-1], (out[:, -1:] + 1) % model.config.vocab_size], 1)
            return out if len(answers) == 1 else moved

        patch.setattr(model, "generate", drifting)
        result = fuzz._generate_case(random.Random(3), pool, 3, "tiny-llama", torch.float32, mode="sample")
    assert result.status == "mismatch" and "its answer does not repeat" in result.detail, result
    assert len(answers) == 2


def test_a_case_that_leaves_process_wide_torch_state_changed_is_an_error_naming_it(monkeypatch):
    """A case after which a process-wide setting that moves eager numerics differs (here the float32 matmul
    precision) is an error naming the setting; later cases are compared with the new state, so only it is named.
    The summary records the environment a replay must match."""
    before = torch.get_float32_matmul_precision()
    calls = []

    def fake_case(rng, pool, case, archs):
        calls.append(case)
        if len(calls) == 2:
            torch.set_float32_matmul_precision("medium" if before != "medium" else "high")
        return fuzz.CaseResult(case, "tiny-llama", "forward", "equal")

    monkeypatch.setattr(fuzz, "run_case", fake_case)
    try:
        summary = fuzz.run_fuzz(cases=3, seed=1)
    finally:
        torch.set_float32_matmul_precision(before)
    assert summary.by_status == {"equal": 2, "error": 1}, summary.by_status
    assert summary.failures[0].case == calls[1] and "float32_matmul_precision" in summary.failures[0].detail
    environment = summary.as_json(1, ["tiny-llama"])["environment"]
    assert {"torch", "transformers", "cpu", "cpu_capability", "threads", "autocast_cpu"} <= set(environment)
    assert environment["float32_matmul_precision"] == before


@pytest.mark.parametrize("arch", fuzz.REFERENCE_ARCHS)
def test_a_left_padded_batch_after_drops_equals_the_reference_row_by_row_and_a_swapped_history_is_a_mismatch(arch):
    """Each row of a left-padded batch drops on its own; checked with the histories' order reversed, the case is a
    mismatch: against the reference where the other row's kept positions fit the row (seed 4: rows of 125 and 74
    tokens), as a history past the row's end where they do not (seed 1: 193 and 253)."""
    pool = fuzz._Pool()
    model, fast = pool.get(arch, torch.float32, keep_ratio=0.3)
    generate = fast.generate

    def swapped(**kwargs):
        out = generate(**kwargs)
        object.__setattr__(fast, "row_histories", fast.row_histories[::-1])
        return out

    for seed, finding in ((4, "vs the eager reference"), (1, "keeps positions past its 193 tokens")):
        result = fuzz_reference._batch_after_drop(random.Random(seed), model, fast, 5, arch, 0.3, rows=2)
        assert result.status == "equal" and result.accelerated == 1, result
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fast, "generate", swapped)
            wrong = fuzz_reference._batch_after_drop(random.Random(seed), model, fast, 5, arch, 0.3, rows=2)
        assert wrong.status == "mismatch" and finding in wrong.detail, wrong


@pytest.mark.parametrize("mode", fuzz_reference.DECODE_MODES)
@pytest.mark.parametrize("arch", fuzz.REFERENCE_ARCHS)
def test_decode_steps_after_a_drop_equal_the_eager_reference_and_a_wrong_step_is_a_mismatch(arch, mode):
    pool = fuzz._Pool()
    model, fast = pool.get(arch, torch.float32, keep_ratio=0.4)
    ids = torch.randint(3, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(2))
    result = fuzz_reference._decode_after_drop(random.Random(1), model, fast, 3, arch, ids, 0.4, mode=mode)
    assert result.status == "equal" and result.accelerated == 1, result
    forward = type(model).forward

    def off_after_the_prefill(self, *args, **kwargs):  # every decode step (the eager path) off by 1e-2
        out = forward(self, *args, **kwargs)
        return _perturbed(out) if kwargs.get("uniprefill_decode") is not None else out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(model), "forward", off_after_the_prefill)
        wrong = fuzz_reference._decode_after_drop(random.Random(1), model, fast, 3, arch, ids, 0.4, mode=mode)
    assert wrong.status == "mismatch" and "eager reference" in wrong.detail, wrong


def test_the_plain_model_raising_inside_uniprefill_code_is_an_error_not_an_invalid_input():
    """The plain model runs through uniprefill's ops where `compat` routed a fallback process-wide: its exception
    there is a finding (the zero-token Gated DeltaNet scan's aliasing was one), not a refused input."""
    from uniprefill.scan_ops import original_of
    from uniprefill.testing.fuzz_cases import CaseResult, _plain_model_raised

    try:
        original_of("no_such_module_anywhere.f")
    except Exception as exc:  # noqa: BLE001
        ours = _plain_model_raised(CaseResult(1, "tiny-llama", "forward", "equal"), exc)
    try:
        torch.zeros(2) @ torch.zeros(3)
    except Exception as exc:  # noqa: BLE001
        theirs = _plain_model_raised(CaseResult(2, "tiny-llama", "forward", "equal"), exc)
    assert ours.status == "error" and "scan_ops.py" in ours.detail, ours
    assert theirs.status == "invalid", theirs


@pytest.mark.parametrize("arch,name", [("tiny-qwen3-next", "output_router_logits"), ("gpt-oss", "output_router_logits"),
                                       ("tiny-gemma3", "output_hidden_states")])
def test_outputs_beside_the_logits_are_compared_and_a_missing_row_is_a_mismatch(arch, name):
    """Forward cases may ask for the hidden states or the router logits: the oracle compares every tensor of them.
    The router logits of a layer after a drop once came back with the kept rows only; that must be a finding."""
    from uniprefill.testing.fuzz_cases import _compare_extras

    pool = fuzz._Pool()
    model, fast = pool.get(arch, torch.float32, p=1.0)
    kwargs = dict(input_ids=torch.randint(3, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(3)),
                  use_cache=False, **{name: True})
    with torch.no_grad():
        out, ref = fast(**kwargs), model(**kwargs)
    assert _compare_extras(out, ref, kwargs, torch.float32) is None
    field = "router_logits" if name == "output_router_logits" else "hidden_states"
    last = getattr(out, field)[-1]
    short = type(out)(**{**out, field: (*getattr(out, field)[:-1], last[..., :100, :])})  # the token (or row) axis
    assert "differs" in _compare_extras(short, ref, kwargs, torch.float32)


def test_the_eager_reference_refuses_a_family_it_does_not_model():
    """Gemma-2's layers (extra norms, soft caps) are not the reference's: it must refuse, not answer wrongly."""
    from uniprefill.testing.eager_reference import reference_last_logits

    model = fuzz.build_model("gemma2", torch.float32)
    with pytest.raises(ValueError, match="gemma2"):
        reference_last_logits(model, torch.randint(3, 100, (1, 20)), {})


@pytest.mark.parametrize("arch,request_kind", [
    ("tiny-llama", "labels"), ("tiny-gemma3", "labels with pads ignored"), ("tiny-llama", "gradients"),
    ("tiny-qwen3-next", "gradients"), ("gpt-oss", "output_router_logits"), ("tiny-gemma3", "output_hidden_states")])
def test_a_call_that_needs_every_position_below_p_1_runs_unaccelerated_with_the_reason_and_equals_the_plain_model(
        arch, request_kind):
    """At forced retention a loss, gradients, hidden states or router logits need every position: the case checks
    that nothing dropped, that the backend said why, and every output (the embedding gradient too) against the plain
    model's."""
    from uniprefill.testing.fuzz_every_position import _every_position_case

    result = _every_position_case(random.Random(2), fuzz._Pool(), 31, arch, torch.float32, request=request_kind)
    assert result.status == "equal", result
    assert result.reasons and not result.accelerated, result


class _IgnoresTheRequest:
    """A compiled model that answers a call asking for every position as if it asked for the last one: it drops."""

    def __init__(self, fast):
        self.fast = fast

    def __getattr__(self, name):
        return getattr(self.fast, name)

    def __call__(self, **kwargs):
        return self.fast(**{k: v for k, v in kwargs.items() if k != "labels"})


def test_a_call_that_needs_every_position_and_dropped_is_a_mismatch():
    from uniprefill.testing.fuzz_every_position import _every_position_case

    pool = fuzz._Pool()
    model, fast = pool.get("tiny-llama", torch.float32, keep_ratio=0.5)
    result = _every_position_case(random.Random(2), _SinglePool(model, _IgnoresTheRequest(fast)), 31, "tiny-llama",
                                  torch.float32, request="labels")
    assert result.status == "mismatch" and "dropped although" in result.detail, result
    with pytest.raises(ValueError, match="output_router_logits"):
        _every_position_case(random.Random(2), pool, 31, "tiny-llama", torch.float32, request="output_router_logits")


def test_calls_are_drawn_under_no_grad_inference_mode_and_bf16_autocast_the_last_for_fp32_models_only():
    rng = random.Random(5)
    fp32 = {fuzz_cases._grad_free(rng, torch.float32)[0] for _ in range(200)}
    bf16 = {fuzz_cases._grad_free(rng, torch.bfloat16)[0] for _ in range(200)}
    assert fp32 == {"no_grad", "inference_mode", "autocast bf16"}
    assert bf16 == {"no_grad", "inference_mode"}
    name, grad_free, tolerance_dtype = next(c for c in iter(lambda: fuzz_cases._grad_free(rng, torch.float32), None)
                                            if c[0] == "autocast bf16")
    with grad_free():
        assert not torch.is_grad_enabled() and torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert tolerance_dtype == torch.bfloat16 and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


def _forced(context):
    contexts = {"inference_mode": (torch.inference_mode, None),
                "autocast bf16": (fuzz_cases._autocast_bf16_no_grad, torch.bfloat16)}
    factory, tolerance = contexts[context]
    return lambda rng, dtype: (context, factory, tolerance or dtype)


@pytest.mark.parametrize("context", ["inference_mode", "autocast bf16"])
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gemma3"])
def test_a_prefill_after_a_drop_under_inference_mode_or_autocast_equals_the_reference_and_an_off_one_is_a_mismatch(
        arch, context, monkeypatch):
    """Users call the compiled model under `torch.inference_mode()` or autocast (drawn here on CPU) as often as
    under `no_grad`: at forced retention the prefill still drops and its logits equal the eager reference run under
    the same context; logits off by 1.0 (past bf16's tolerance, 3e-2 x max(1, |logits|)) are a mismatch."""
    monkeypatch.setattr(fuzz_reference, "_grad_free", _forced(context))
    model, fast = fuzz._Pool().get(arch, torch.float32, keep_ratio=0.4)
    ids = torch.randint(3, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(4))
    result = fuzz_reference._prefill_after_drop(random.Random(1), model, fast, 5, arch, ids, 0.4)
    assert result.status == "equal" and result.accelerated == 1 and f"under {context}" in result.detail, result
    forward = fast.forward
    fast.forward = lambda *a, **k: _perturbed(forward(*a, **k), 1.0)
    wrong = fuzz_reference._prefill_after_drop(random.Random(1), model, fast, 5, arch, ids, 0.4)
    assert wrong.status == "mismatch" and "eager reference" in wrong.detail, wrong


@pytest.mark.parametrize("context", ["inference_mode", "autocast bf16"])
def test_forward_calls_under_inference_mode_or_autocast_equal_the_plain_model(context, monkeypatch):
    monkeypatch.setattr(fuzz_cases, "_grad_free", _forced(context))
    pool, accelerated = fuzz._Pool(), 0
    for seed in range(4):
        result = fuzz._forward_case(random.Random(seed), pool, seed, "tiny-llama", torch.float32)
        assert result.status in ("equal", "invalid") and f"under {context}" in result.detail, result
        accelerated += result.accelerated
    assert accelerated >= 1


@pytest.mark.parametrize("context", ["inference_mode", "autocast bf16"])
def test_plain_torch_compile_calls_under_inference_mode_or_autocast_equal_the_plain_model(context, monkeypatch):
    from uniprefill.testing import fuzz_plain_compile

    monkeypatch.setattr(fuzz_plain_compile, "_grad_free", _forced(context))
    pool = fuzz._Pool()
    # seeds 7 and 9: forward cases whose calls ran the rewritten graph under no_grad (most plain-door calls fill a
    # cache and run unaccelerated by design)
    results = [fuzz._plain_compile_case(random.Random(s), pool, s, "tiny-llama", torch.float32) for s in (7, 9)]
    assert all(r.status in ("equal", "invalid") and f"under {context}" in r.detail for r in results), results
    assert sum(r.accelerated for r in results) >= 1, [r.reasons for r in results]


def test_router_logits_the_model_does_not_return_ask_for_no_position():
    """transformers 5.17's GraniteMoeHybrid answers `output_router_logits=True` with no router logits (round 52 of the
    fuzzer): such a call needs no position but the last, so the every-position case counts it invalid, not a drop
    that should not have happened; a model that returns them keeps the check."""
    import types

    from uniprefill.testing.fuzz_every_position import ignores_router_logits

    assert ignores_router_logits(types.SimpleNamespace(router_logits=None, aux_loss=0))
    assert ignores_router_logits(types.SimpleNamespace(logits=torch.zeros(1)))
    assert not ignores_router_logits(types.SimpleNamespace(router_logits=(torch.zeros(58, 4),)))
    assert not ignores_router_logits(types.SimpleNamespace(router_logits=torch.zeros(58, 4)))  # one tensor
    assert ignores_router_logits(types.SimpleNamespace(router_logits=()))


def test_an_every_position_call_whose_bf16_batch_ran_row_by_row_ties_as_the_plain_models_rows_alone_do(monkeypatch):
    """Round 61's one mismatch (case 1093004279057): tiny Qwen3-Next in bf16, gradients on, a left-padded batch of
    rows of 199 and 87 tokens at keep_ratio 0.3. The compiled model ran it unaccelerated, row by row: its logits equal
    the plain model's rows run one at a time bit for bit, while the plain model's batched logits part from the padded
    row's by 0.034 (tolerance 0.03): rounding of the padded chunked scan, a tie. Logits off both stay a mismatch."""
    from uniprefill.testing import fuzz_every_position
    from uniprefill.testing.fuzz_every_position import _every_position_case

    case = 1093004279057
    draws = [0.3, "gradients", 2, 199, 87, None]  # keep ratio, request, rows, lengths, use_cache left to the config
    result = _every_position_case(_Scripted(draws), fuzz._Pool(), case, "qwen3-next-6", torch.bfloat16)
    assert result.status == "tie" and "rounding" in result.detail and "rows of [199, 87]" in result.detail, result

    def off_both(model, fast, out, ref, *args):  # the compiled logits equal no plain answer
        return None

    monkeypatch.setattr(fuzz_every_position, "_rows_alone_tie", off_both)
    again = _every_position_case(_Scripted(draws), fuzz._Pool(), case, "qwen3-next-6", torch.bfloat16)
    assert again.status == "mismatch" and "logits differ" in again.detail, again
