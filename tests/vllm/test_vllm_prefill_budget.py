"""One-step prefill (`uniprefill.vllm.prefill_budget`): a dropping engine whose user gave no step budget gets
`min(max_model_len, 32768) + max_num_seqs - 1`, so that a long prompt drops over all its tokens instead of in its
last chunk.

A stand-in for vLLM 0.26's `EngineArgs` with the one method the plugin wraps (the defaults it sets for
`vllm serve` on an H200), and the same checks against vLLM's own `EngineArgs` where its source imports
(`scripts/vllm_source_on_cpu.sh`; skipped in CI)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from uniprefill.config import UniPrefillConfig
from uniprefill.vllm import prefill_budget


class EngineArgs:
    """vLLM 0.26's `EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`, reduced to what it does
    for `vllm serve` on an H200: 8192 tokens and 1024 sequences unless given; with chunked prefill off, at
    least `max_model_len`."""

    def __init__(self, compilation_config=None, max_num_batched_tokens=None, max_num_seqs=None,
                 enable_chunked_prefill=None, max_num_scheduled_tokens=None, long_prefill_token_threshold=0):
        self.compilation_config = compilation_config or {}
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_num_scheduled_tokens = max_num_scheduled_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold

    def _set_default_max_num_seqs_and_batched_tokens_args(self, usage_context, model_config, parallel_config):
        given = self.max_num_batched_tokens
        default = 256 if parallel_config.use_batched_dp_moe else 8192
        self.max_num_batched_tokens = self.max_num_batched_tokens or default
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


def budget_of(args: EngineArgs, model=MODEL, batched_dp_moe=False) -> int:
    args._set_default_max_num_seqs_and_batched_tokens_args(None, model, NS(use_batched_dp_moe=batched_dp_moe))
    return args.max_num_batched_tokens


def test_a_dropping_engine_prefills_its_longest_prompt_in_one_step(installed, caplog):
    """Fails without the wrap: vLLM's 8192 would chunk a 32K prompt into four steps."""
    with caplog.at_level(logging.INFO, logger="vllm.uniprefill"):
        budget = budget_of(EngineArgs(options(vllm_drop=True, keep_ratio=0.3)))
    assert budget == 32768 + 1023  # the prompt beside one decode token of each of the other 1023 requests
    assert "max_num_batched_tokens 8192 -> 33791" in caplog.text  # logged at construction, in vLLM's logger tree


def test_the_raise_is_capped_and_never_lowers_vllms_budget(installed):
    long_model = NS(max_model_len=131072, is_multimodal_model=False, is_mm_prefix_lm=False)  # Llama-3.1's default
    assert budget_of(EngineArgs(options(vllm_drop=True)), long_model) == 32768 + 1023  # longer prompts chunk
    short_model = NS(max_model_len=4096, is_multimodal_model=False, is_mm_prefix_lm=False)
    assert budget_of(EngineArgs(options(vllm_drop=True)), short_model) == 8192  # 4096 + 1023 < vLLM's 8192
    one_seq = EngineArgs(options(vllm_drop=True), max_num_seqs=1)
    assert budget_of(one_seq) == 32768  # no other request to decode beside it: max_num_seqs * max_model_len


@pytest.mark.parametrize("args, why", [
    (EngineArgs(options(vllm_drop=True), max_num_batched_tokens=4096), "the user's budget"),
    (EngineArgs(options(vllm_drop=True, vllm_one_step_prefill=False)), "the option off"),
    (EngineArgs(options(p=0.9)), "an engine that does not drop"),
    (EngineArgs(options(vllm_drop=True, p=1.0)), "an engine at p = 1: standard's steps (its bits in batched runs)"),
    (EngineArgs({}), "an engine without uniprefill"),
    (EngineArgs(options(vllm_drop=True), max_num_scheduled_tokens=4096), "the user's cap on scheduled tokens"),
    (EngineArgs(options(vllm_drop=True), long_prefill_token_threshold=2048), "the user's cap on a prompt's chunk"),
])
def test_vllms_budget_is_left_alone(installed, args, why):
    given = args.max_num_batched_tokens
    assert budget_of(args) == (given or 8192), why


def test_an_engine_at_p1_with_a_keep_ratio_drops_and_gets_the_budget(installed):
    """p = 1 keeps vLLM's budget only without a forced keep_ratio (which drops whatever p says)."""
    assert budget_of(EngineArgs(options(vllm_drop=True, p=1.0, keep_ratio=0.3))) == 32768 + 1023


def test_chunked_prefill_off_keeps_vllms_own_raise(installed):
    assert budget_of(EngineArgs(options(vllm_drop=True), enable_chunked_prefill=False)) == 32768


def test_batched_data_parallel_moe_keeps_vllms_budget(installed):
    """vLLM sets 256 there on purpose: the budget sizes the MoE all-to-all buffers."""
    assert budget_of(EngineArgs(options(vllm_drop=True)), batched_dp_moe=True) == 256


def test_the_budget_covers_a_full_batch_of_decodes():
    assert prefill_budget.one_step_budget(32768, 1024) == 33791
    assert prefill_budget.one_step_budget(200000, 8) == 32768 + 7
    assert prefill_budget.one_step_budget(1000, 1) == 1000
    assert UniPrefillConfig().vllm_one_step_prefill  # on by default
    with pytest.raises(ValueError, match="vllm_one_step_prefill"):
        UniPrefillConfig(vllm_one_step_prefill="yes")


def test_a_bad_setting_fails_the_engine_construction(installed):
    with pytest.raises(ValueError, match="keep_ratio"):
        budget_of(EngineArgs(options(vllm_drop=True, keep_ratio=3.0)))


def test_install_where_vllm_runs_needs_the_engine_arguments_module(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm.engine.arg_utils", raising=False)
    assert prefill_budget.install_where_vllm_runs() is False


def test_the_plugins_register_wraps_vllms_engine_arguments(tmp_path):
    """The path vLLM takes: `EngineArgs.__post_init__` loads the plugins, `register()` wraps the method, and the
    config built next gets the budget. A stand-in vLLM in a fresh process (the plugin registers once per process)."""
    code = (
        "import sys, types\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from test_vllm_prefill_budget import EngineArgs, MODEL, options\n"
        "from types import SimpleNamespace as NS\n"
        "for name in ('vllm', 'vllm.engine', 'vllm.engine.arg_utils', 'vllm.v1', 'vllm.v1.core', 'vllm.v1.core.sched',\n"
        "             'vllm.v1.core.sched.scheduler', 'vllm.compilation', 'vllm.compilation.backends'):\n"
        "    sys.modules[name] = types.ModuleType(name)\n"
        "sys.modules['vllm.engine.arg_utils'].EngineArgs = EngineArgs\n"
        "sys.modules['vllm.v1.core.sched.scheduler'].Scheduler = type('Scheduler', (), {'__init__': lambda self: None})\n"
        "sys.modules['vllm.compilation.backends'].VllmBackend = type('VllmBackend', (), {'__call__': lambda self: None})\n"
        "from uniprefill.vllm import plugin\n"
        "plugin.register()\n"
        "args = EngineArgs(options(vllm_drop=True))\n"
        "args._set_default_max_num_seqs_and_batched_tokens_args(None, MODEL, NS(use_batched_dp_moe=False))\n"
        "print('budget', args.max_num_batched_tokens)\n"
    )
    # outside the source tree: on the GPU box it would shadow the installed package (the metadata test's lesson)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "budget 33791" in result.stdout
    assert "max_num_batched_tokens 8192 -> 33791" in result.stderr  # the warning reaches the process's output


def test_vllms_own_engine_arguments(monkeypatch):
    """vLLM 0.26.0's `EngineArgs` (its source on CPU): the wrapped method raises the budget of a dropping
    engine to max_model_len + max_num_seqs - 1, and leaves the others at vLLM's."""
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
    assert drop_budget == 32768 + seqs - 1
    assert budgets["plain"][0] < drop_budget
