"""One-step prefill: a dropping engine's step budget holds a prompt of up to 32K tokens beside a full batch of decodes.

vLLM prefills a prompt longer than the step's free budget in chunks (chunked prefill is on by default; the
budget `max_num_batched_tokens` is 16384 for `LLM` and 8192 for `vllm serve` on an H200, and the running
decodes take one token each of it). The earlier chunks run every layer over all their tokens before the
last chunk's drop decides anything, so a chunked prompt drops among the tokens of its last chunk only
(`vllm_context_drops`) and keeps most of its cost: under `vllm serve` at concurrency 4 an 8K prompt became a
chunk of about 8,189 tokens and one of a few tokens (docs/results/vllm-bench-serve-h200-2026-12-04/).

With the option `vllm_one_step_prefill` (on by default) and the engine dropping (`vllm_drop`), the default
budget becomes `min(max_model_len, ONE_STEP_MAX_PROMPT) + max_num_seqs - 1` (at most `max_num_seqs *
max_model_len`, vLLM's own bound): a prompt of up to 32,768 tokens fits in one step beside one decode token of
every other running request, and drops over all its tokens. Logged at construction, through vLLM's logger
tree (`vllm.uniprefill`), which every vLLM process prints. Prompts longer than the cap are chunked and drop in
their last chunk: the cap keeps the step inside what was measured (33,792 tokens on the H200) and out of two
costs that grow with it, the activation memory vLLM reserves for a step of that size (3.8 GiB at 33,792 tokens
on the Llama-3.1-8B shape, less KV cache) and Inductor's switch to 64-bit indexing once a step's largest
tensor passes 2^31 elements (Llama's 131,072-token default would cross it).

The budget is left as vLLM sets it when the user gives `max_num_batched_tokens`, `max_num_scheduled_tokens` or
`long_prefill_token_threshold` (each caps what one step or one prompt gets), when chunked prefill is off (vLLM
then raises the budget to `max_model_len` itself), under batched data-parallel MoE (vLLM sets 256 there: it
sizes the all-to-all buffers), when the engine does not drop, when it drops only for requests that bring their
own p (p = 1 and no `keep_ratio`: standard's step composition, hence standard's numbers at p = 1; such a request's
long prompt drops in its last chunk with `vllm_context_drops`, else not), and when vLLM's default is already
larger.
Chunked prefill stays on: vLLM still chunks where the budget runs out (several long prompts arriving
together), and those requests drop in their last chunk. The price is decode latency: a step holding a long
prefill stalls the running decodes for all of it (docs/vllm.md gives the measured TTFT, TPOT and inter-token
gaps). An engine that turns out to run unaccelerated (its log says why) keeps the raised budget.

Where it hooks (read in vLLM 0.26.0's source): `EngineArgs.create_engine_config` sets the budget in
`EngineArgs._set_default_max_num_seqs_and_batched_tokens_args(usage_context, model_config, parallel_config)`,
once, in the process that builds the config, before `SchedulerConfig` and everything derived from it (compile
ranges, CUDA-graph sizes, encoder budgets) are made; the engine core and the workers receive the finished
config. `install(EngineArgs)` wraps that method (idempotent, reversible with `uninstall`). vLLM loads the
plugins from `EngineArgs.__post_init__` (and `add_cli_args`), so the wrap is in place before the config is made.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .checks import _get, config_from_compilation_config
from .class_patch import unwrap_method, wrap_method

# vLLM's logger tree: vLLM configures its handler on "vllm", and its front end shows nothing from other loggers
logger = logging.getLogger("vllm.uniprefill")

_MARK = "_uniprefill_prefill_budget"
_METHOD = "_set_default_max_num_seqs_and_batched_tokens_args"
ONE_STEP_MAX_PROMPT = 32768  # longest prompt given a step of its own by default (module docstring)


def one_step_budget(max_model_len: int, max_num_seqs: int) -> int:
    """The step budget that holds a prompt of min(max_model_len, ONE_STEP_MAX_PROMPT) tokens beside one decode
    token of each of the other `max_num_seqs - 1` requests, within vLLM's bound `max_num_seqs * max_model_len`."""
    prompt, seqs = min(int(max_model_len), ONE_STEP_MAX_PROMPT), int(max_num_seqs)
    return min(prompt + seqs - 1, seqs * int(max_model_len))


def raised_budget(engine_args: Any, max_model_len: int, user_budget: int | None, parallel_config: Any = None) -> int | None:
    """The budget a dropping engine with these (already defaulted) engine arguments should get, or None to
    leave vLLM's (module docstring: when)."""
    if user_budget is not None or _get(engine_args, "enable_chunked_prefill") is False:
        return None
    if _get(engine_args, "max_num_scheduled_tokens") is not None or _get(engine_args, "long_prefill_token_threshold"):
        return None
    if _get(parallel_config, "use_batched_dp_moe", False):
        return None
    settings = config_from_compilation_config(_get(engine_args, "compilation_config"))
    if settings is None or not settings.vllm_drop or not settings.vllm_one_step_prefill:
        return None
    if settings.p >= 1.0 and settings.keep_ratio is None:  # drops only for requests bringing their own p: vLLM's
        return None  # steps stay standard's, so that p = 1 keeps standard vLLM's bits in batched runs too
    budget = one_step_budget(max_model_len, _get(engine_args, "max_num_seqs"))
    current = _get(engine_args, "max_num_batched_tokens") or 0
    return budget if budget > current else None


def _raising_defaults(original):
    def method(self, usage_context, model_config, parallel_config, *args, **kwargs):
        user_budget = self.max_num_batched_tokens
        result = original(self, usage_context, model_config, parallel_config, *args, **kwargs)
        budget = raised_budget(self, model_config.max_model_len, user_budget, parallel_config)
        if budget is not None:
            logger.warning("uniprefill: max_num_batched_tokens %d -> %d, so that a prompt of up to %d tokens drops "
                           "over all its tokens in one step beside the running decodes (vllm_one_step_prefill; give "
                           "max_num_batched_tokens to keep a budget of your own)", self.max_num_batched_tokens, budget,
                           min(model_config.max_model_len, ONE_STEP_MAX_PROMPT))
            self.max_num_batched_tokens = budget
        return result

    return method


def install(engine_args_cls) -> bool:
    """Wrap `engine_args_cls._set_default_max_num_seqs_and_batched_tokens_args`; False when already wrapped."""
    return wrap_method(engine_args_cls, _METHOD, _raising_defaults, _MARK)


def uninstall(engine_args_cls) -> bool:
    return unwrap_method(engine_args_cls, _METHOD, _MARK)


def install_where_vllm_runs() -> bool:
    """`install` on vLLM's `EngineArgs` where its module is loaded (the plugin's `register()`, which vLLM
    calls from `EngineArgs.__post_init__` in the process that builds the config); imports nothing, and
    leaves a vLLM without the method (another version) as it is, with a warning."""
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    EngineArgs = getattr(arg_utils, "EngineArgs", None)
    if EngineArgs is None:
        return False

    if not hasattr(EngineArgs, _METHOD):
        logger.warning("uniprefill: this vLLM's EngineArgs has no %s; long prompts keep vLLM's step budget "
                       "(vllm_one_step_prefill has no effect)", _METHOD)
        return False
    return install(EngineArgs)
