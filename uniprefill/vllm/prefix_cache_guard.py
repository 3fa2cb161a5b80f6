"""Prefix caching beside token dropping: a request never publishes KV blocks its drop may have changed.

vLLM's prefix cache (on by default) registers a request's full KV blocks under the hash of the
tokens they hold, at scheduling time, so a later request with the same prefix reads them instead of
computing them. After a drop point a dropped request's blocks hold, in every later layer, only its
KEPT tokens, compacted to the front, and its later tokens (the rest of the prompt step, every decoded
token) were computed from them: handed to another request as if they held every token, they would
give that request wrong answers without any error. The scheduler decides what to publish before the
forward that decides what to drop, so the guard is conservative. For a request whose prompt has at
least `effective_min_tokens` tokens (the worker's own lower bound for a drop,
`uniprefill.vllm.metadata.drop_eligibility`):
- a step that schedules only PART of the rest of its prompt (an earlier chunk of a chunked prefill)
  never drops (`SkipReason.PARTIAL_CHUNK`): its blocks publish as usual;
- a step that reaches the end of its prompt may drop, and so may every step after it: they publish
  nothing (the blocks of its earlier chunks were published when those ran).
Shorter requests publish as usual, and so do requests that cannot remove a row whatever their scores:
those that opt out (`extra_args={"uniprefill": False}`, or a setting the worker does not understand),
those that ask for prompt logprobs (the worker keeps every row of theirs for their whole life) and, where
the config forces no keep ratio, those whose top-p (their own, else the config's) is 1, which keeps every
block. Both sides read a request's setting with one function
(`uniprefill.vllm.request_option.read_request_option`). So an engine at p = 1 caches prefixes as
standard vLLM does. Stateless: a request that vLLM preempts and recomputes follows the same rule.

Reading the cache is left as vLLM does it: a request that finds a cached prefix has context when its
prefill runs; it reads blocks published by the rule above (every one computed without a drop), and,
with `vllm_context_drops` (the default), drops among the tokens of its own last step.

Where it hooks (read in vLLM 0.26.0's source): every publication goes through
`KVCacheCoordinator.cache_blocks(request, num_tokens)` of the scheduler's `kv_cache_manager`
(`KVCacheManager.allocate_slots` after each schedule, `cache_blocks` for KV received from elsewhere,
the async scheduler after each output). `install(Scheduler)` wraps the scheduler class's `__init__`
(idempotent, reversible with `uninstall`): a scheduler built with a config that drops and caches gets
its coordinator's `cache_blocks` wrapped on that instance; any other scheduler is left as built. The
plugin's `register()` installs it in every vLLM process, because the scheduler runs in the engine
core's process, which never resolves the backend when the model runs in worker processes (tensor
parallel).
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass
from typing import Any

from .checks import _get, _settings
from .class_patch import unwrap_method, wrap_method
from .request_option import read_request_option

logger = logging.getLogger("uniprefill.vllm")

_MARK = "_uniprefill_prefix_cache_guard"


@dataclass
class PrefixCacheGuard:
    """Withholds from the prefix cache the blocks a request's drop may have changed (module docstring)."""

    min_tokens: int
    p: float  # the config's top-p (no default: a guard that assumed 1 would publish every block)
    keep_ratio: float | None  # the config's forced keep ratio, or None (then p is read)
    withheld: int = 0  # calls that published nothing: the request may drop in this step or did earlier
    published: int = 0  # calls passed on to vLLM

    def may_have_dropped(self, request: Any, num_tokens: int) -> bool:
        """Whether the blocks of `request`'s first `num_tokens` tokens may hold a drop's result: its prompt is
        long enough to drop, this step reaches the prompt's end (or runs after it), and the request can
        remove rows (`can_remove_rows`)."""
        prompt = int(_get(request, "num_prompt_tokens", 0) or 0)
        return prompt >= self.min_tokens and num_tokens >= prompt and self.can_remove_rows(request)

    def can_remove_rows(self, request: Any) -> bool:
        """False for a request that keeps every row whatever its scores: opted out, asking for prompt logprobs,
        or top-p 1 (its own, else the config's) where no keep ratio is forced."""
        option = read_request_option(_get(request, "sampling_params"))  # prompt logprobs opt out too
        if option.opted_out:
            return False
        if self.keep_ratio is not None:
            return True
        return (option.p if option.p is not None else self.p) < 1.0

    def attach(self, scheduler: Any) -> None:
        """Wrap `scheduler.kv_cache_manager.coordinator.cache_blocks` on this instance."""
        coordinator = scheduler.kv_cache_manager.coordinator
        original = coordinator.cache_blocks

        @functools.wraps(original)
        def cache_blocks(request, num_computed_tokens, *args, **kwargs):
            if self.may_have_dropped(request, num_computed_tokens):
                self.withheld += 1
                return None
            self.published += 1
            return original(request, num_computed_tokens, *args, **kwargs)

        coordinator.cache_blocks = cache_blocks
        scheduler.uniprefill_prefix_cache_guard = self


def guard_for(vllm_config: Any) -> PrefixCacheGuard | None:
    """The guard an engine with this config needs: None unless it drops (`vllm_drop`) with prefix
    caching on."""
    if not _get(_get(vllm_config, "cache_config"), "enable_prefix_caching", False):
        return None
    settings = _settings(vllm_config)
    if not settings.vllm_drop:
        return None
    return PrefixCacheGuard(min_tokens=settings.effective_min_tokens, p=settings.p, keep_ratio=settings.keep_ratio)


def install(scheduler_cls) -> bool:
    """Wrap `scheduler_cls.__init__` so that schedulers of dropping, caching engines get a guard.
    Returns False when it was already installed."""
    return wrap_method(scheduler_cls, "__init__", _guarding_init, _MARK)


def uninstall(scheduler_cls) -> bool:
    """Undo `install` (schedulers built before keep their guard). False when it was not installed."""
    return unwrap_method(scheduler_cls, "__init__", _MARK)


def _guarding_init(original):
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        guard = guard_for(vllm_config)
        if guard is not None and getattr(self, "kv_cache_manager", None) is not None:
            guard.attach(self)
            logger.info("uniprefill: prefix caching stays on; requests of at least %d prompt tokens that may drop "
                        "(not opted out; top-p below 1 or a forced keep ratio) publish no KV blocks from the step "
                        "that ends their prompt on", guard.min_tokens)

    return __init__


def install_where_vllm_runs() -> bool:
    """`install` on vLLM's `Scheduler` in a process where vLLM is imported (the plugin's `register()`, which
    vLLM calls once per process, before an engine core builds its scheduler: in the engine core's own
    process, or earlier in the same process when the engine runs in-process); imports nothing without vLLM."""
    if "vllm" not in sys.modules:
        return False
    from vllm.v1.core.sched.scheduler import Scheduler

    return install(Scheduler)
