"""One-step prefill (`uniprefill.vllm.prefill_budget`): a dropping engine whose user gave no step budget gets
`max_model_len + max_num_seqs`, so that a long prompt drops over all its tokens instead of in its last chunk.

A stand-in for vLLM 0.26's `EngineArgs` with the one method the plugin wraps (the defaults it sets for
`vllm serve` on an H200), and the same checks against vLLM's own `EngineArgs` where its source imports
(`scripts/vllm_source_on_cpu.sh`; skipped in CI)."""

from __future__ import annotations

import logging
from types import SimpleNamespace as NS

import pytest

from uniprefill.config import UniPrefillConfig
from uniprefill.vllm import prefill_budget


class EngineArgs:
    """vLLM 0.26's `EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`, reduced to what it does
    for `vllm serve` on an H200: 8192 tokens and 1024 sequences unless given; with chunked prefill off, at
    least `max_model_len`."""

    def __init__(self, compilation_config=None, max_num_batched_tokens=None, max_num_seqs=None,
                 enable_chunked_prefill=None):
        self.compilation_config = compilation_config or {}
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill

    def _set_default_max_num_seqs_and_batched_tokens_args(self, usage_context, model_config, parallel_config):
        given = self.max_num_batched_tokens
        self.max_num_batched_tokens = self.max_num_batched_tokens or 8192
        self.max_num_seqs = self.max_num_seqs or 1024
        if given is None and self.enable_chunked_prefill is False:
            self.max_num_batched_tokens = max(model_config.max_model_len, self.max_num_batched_tokens)


MODEL = NS(max_model_len=32768, is_multimodal_model=False, is_mm_prefix_lm=False)


def options(**settings):
    return {"inductor_compile_config": {"uniprefill": settings}}


@pytest.fixture()
def installed():
    assert prefill_budget.install(EngineArgs)
    assert not prefill_budget.install(EngineArgs)  # idempotent
    yield
    assert prefill_budget.uninstall(EngineArgs)
    assert not prefill_budget.uninstall(EngineArgs)


def budget_of(args: EngineArgs) -> int:
    args._set_default_max_num_seqs_and_batched_tokens_args(None, MODEL, NS(use_batched_dp_moe=False))
    return args.max_num_batched_tokens


def test_a_dropping_engine_prefills_its_longest_prompt_in_one_step(installed, caplog):
    """Fails without the wrap: vLLM's 8192 would chunk a 32K prompt into four steps."""
    with caplog.at_level(logging.INFO, logger="uniprefill.vllm"):
        budget = budget_of(EngineArgs(options(vllm_drop=True, keep_ratio=0.3)))
    assert budget == 32768 + 1024
    assert "max_num_batched_tokens 8192 -> 33792" in caplog.text  # logged at construction


@pytest.mark.parametrize("args, why", [
    (EngineArgs(options(vllm_drop=True), max_num_batched_tokens=4096), "the user's budget"),
    (EngineArgs(options(vllm_drop=True, vllm_one_step_prefill=False)), "the option off"),
    (EngineArgs(options(p=0.9)), "an engine that does not drop"),
    (EngineArgs({}), "an engine without uniprefill"),
])
def test_vllms_budget_is_left_alone(installed, args, why):
    given = args.max_num_batched_tokens
    assert budget_of(args) == (given or 8192), why


def test_chunked_prefill_off_keeps_vllms_own_raise(installed):
    assert budget_of(EngineArgs(options(vllm_drop=True), enable_chunked_prefill=False)) == 32768


def test_the_budget_covers_a_full_batch_of_decodes():
    assert prefill_budget.one_step_budget(32768, 1024) == 33792
    assert UniPrefillConfig().vllm_one_step_prefill  # on by default
    with pytest.raises(ValueError, match="vllm_one_step_prefill"):
        UniPrefillConfig(vllm_one_step_prefill="yes")


def test_a_bad_setting_fails_the_engine_construction(installed):
    with pytest.raises(ValueError, match="keep_ratio"):
        budget_of(EngineArgs(options(vllm_drop=True, keep_ratio=3.0)))


def test_install_where_vllm_runs_needs_the_engine_arguments_module(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "vllm.engine.arg_utils", raising=False)
    assert prefill_budget.install_where_vllm_runs() is False


def test_vllms_own_engine_arguments(monkeypatch):
    """vLLM 0.26.0's `EngineArgs` (its source on CPU): the wrapped method raises the budget of a dropping
    engine to max_model_len + max_num_seqs, and leaves the others at vLLM's."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils", reason="vLLM's source is not importable here")
    usage = pytest.importorskip("vllm.usage.usage_lib")
    monkeypatch.setenv("VLLM_PLUGINS", "none")  # vLLM's plugin loader would import all of its scheduler
    real = arg_utils.EngineArgs
    installed_here = prefill_budget.install(real)
    try:
        budgets = {}
        for name, cc in (("drop", options(vllm_drop=True)), ("plain", {})):
            args = real(model="/nonexistent", compilation_config=cc)
            args._set_default_max_num_seqs_and_batched_tokens_args(usage.UsageContext.OPENAI_API_SERVER, MODEL,
                                                                    NS(use_batched_dp_moe=False))
            budgets[name] = (args.max_num_batched_tokens, args.max_num_seqs)
    finally:
        if installed_here:
            prefill_budget.uninstall(real)
    drop_budget, seqs = budgets["drop"]
    assert drop_budget == 32768 + seqs
    assert budgets["plain"][0] < drop_budget
