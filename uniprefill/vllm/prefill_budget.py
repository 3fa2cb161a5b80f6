"""One-step prefill: a dropping engine's step budget holds its longest prompt beside a full batch of decodes.

vLLM prefills a prompt longer than the step's free budget in chunks (chunked prefill is on by default; the
budget `max_num_batched_tokens` is 16384 for `LLM` and 8192 for `vllm serve` on an H200, and the running
decodes take one token each of it). The earlier chunks run every layer over all their tokens before the
last chunk's drop decides anything, so a chunked prompt drops among the tokens of its last chunk only
(`vllm_context_drops`) and keeps most of its cost: under `vllm serve` at concurrency 4 an 8K prompt became a
chunk of about 8,189 tokens and one of a few tokens (docs/results/vllm-bench-serve-h200-2026-12-04/).

With the option `vllm_one_step_prefill` (on by default) and the engine dropping (`vllm_drop`), the default
budget becomes `max_model_len + max_num_seqs`: any prompt the engine accepts fits in one step beside one
decode token of every other running request, and drops over all its tokens. Logged at construction (a warning:
vLLM's logging shows no other level of a plugin's logger). The
budget is left as given when the user sets `max_num_batched_tokens`, when chunked prefill is off (vLLM then
raises the budget to `max_model_len` itself) and when the engine does not drop. Chunked prefill stays on:
vLLM still chunks where the budget runs out (several long prompts arriving together), and those requests
drop in their last chunk as before. The price is decode latency: a step holding a long prefill stalls the
running decodes for longer than one chunk would (`docs/vllm.md` gives the measured TTFT and TPOT).

Where it hooks (read in vLLM 0.26.0's source): `EngineArgs.create_engine_config` sets the budget in
`EngineArgs._set_default_max_num_seqs_and_batched_tokens_args(usage_context, model_config, parallel_config)`,
once, in the front-end process, before `SchedulerConfig` and the compilation ranges are built from it;
`install(EngineArgs)` wraps that method (idempotent, reversible with `uninstall`). vLLM loads the plugins
in `EngineArgs.__post_init__`, so the wrap is in place before the config is made.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .checks import _get, config_from_compilation_config
from .class_patch import unwrap_method, wrap_method

logger = logging.getLogger("uniprefill.vllm")

_MARK = "_uniprefill_prefill_budget"
_METHOD = "_set_default_max_num_seqs_and_batched_tokens_args"


def one_step_budget(max_model_len: int, max_num_seqs: int) -> int:
    """The step budget that holds a prompt of `max_model_len` tokens beside `max_num_seqs - 1` decodes."""
    return int(max_model_len) + int(max_num_seqs)


def raised_budget(engine_args: Any, max_model_len: int, user_budget: int | None) -> int | None:
    """The budget a dropping engine with these (already defaulted) engine arguments should get, or None to
    leave vLLM's: the user gave one, chunked prefill is off, the engine does not drop, or the option is off."""
    if user_budget is not None or _get(engine_args, "enable_chunked_prefill") is False:
        return None
    settings = config_from_compilation_config(_get(engine_args, "compilation_config"))
    if settings is None or not settings.vllm_drop or not settings.vllm_one_step_prefill:
        return None
    budget = one_step_budget(max_model_len, _get(engine_args, "max_num_seqs"))
    current = _get(engine_args, "max_num_batched_tokens") or 0
    return budget if budget > current else None


def _raising_defaults(original):
    def method(self, usage_context, model_config, parallel_config, *args, **kwargs):
        user_budget = self.max_num_batched_tokens
        result = original(self, usage_context, model_config, parallel_config, *args, **kwargs)
        budget = raised_budget(self, model_config.max_model_len, user_budget)
        if budget is not None:
            logger.warning("uniprefill: max_num_batched_tokens %d -> %d (max_model_len %d + max_num_seqs %d), so that "
                        "a prompt drops over all its tokens in one step (vllm_one_step_prefill; give "
                        "max_num_batched_tokens to keep a budget of your own)", self.max_num_batched_tokens, budget,
                        model_config.max_model_len, self.max_num_seqs)
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
