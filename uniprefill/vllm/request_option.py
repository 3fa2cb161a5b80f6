"""A request's own uniprefill setting, read from its sampling params: one reader for every vLLM process.

`SamplingParams.extra_args["uniprefill"]`: False (or "off") keeps every row of the request (an opt-out);
`{"p": x}` with 0 < x <= 1 gives it its own top-p (ignored where the config forces a keep ratio). The
OpenAI server passes only flat scalars (`vllm_xargs`, which turns JSON false / true into 0 / 1), so there
`"uniprefill": "off"` (or false) opts out, true changes nothing, and `"uniprefill_p": x` sets p. Anything
else is a problem: the request keeps every row, and the caller logs why, so a bad setting never silently
changes an answer. A request asking for prompt logprobs (`SamplingParams.prompt_logprobs`) keeps every row too,
for its whole life (vLLM reads the logits at every prompt position; a recompute after a preemption included).

Two readers must agree, so both call `read_request_option`: the worker, which drops
(`uniprefill.vllm.runner_hook.RequestSettings`), and the scheduler, which decides which KV blocks may enter
the prefix cache (`uniprefill.vllm.prefix_cache_guard`: a request that cannot drop publishes as usual).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestOption:
    """What one request asks for: `opted_out` (keep every row), else its own `p` (None: the engine's)."""

    opted_out: bool = False
    p: float | None = None
    problem: str | None = None  # why a setting was not understood (then opted_out)


def read_request_option(sampling_params: Any) -> RequestOption:
    """The request's own setting from `sampling_params.extra_args` (module docstring), opted out where it asks for
    prompt logprobs; the engine's settings (`RequestOption()`) where it brings none, or has no sampling params
    (pooling)."""
    option = _read_extra_args(sampling_params)
    if not option.opted_out and getattr(sampling_params, "prompt_logprobs", None) is not None:
        return RequestOption(opted_out=True)
    return option


def _read_extra_args(sampling_params: Any) -> RequestOption:
    extra = getattr(sampling_params, "extra_args", None) or {}
    setting = extra.get("uniprefill")
    if "uniprefill_p" in extra:  # the server's flat form of {"p": x}
        setting = {"p": extra["uniprefill_p"]} if setting is None else {"conflict": (setting, extra["uniprefill_p"])}
    if setting is None or setting is True or (type(setting) is int and setting == 1):  # 1: JSON true
        return RequestOption()
    if setting is False or (type(setting) is int and setting == 0) or setting == "off":
        return RequestOption(opted_out=True)
    p = setting.get("p") if isinstance(setting, dict) and set(setting) == {"p"} else None
    if isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 < p <= 1.0:
        return RequestOption(p=float(p))
    return RequestOption(opted_out=True, problem=f"extra_args['uniprefill']={setting!r} is not False, 'off' or "
                                                 "{'p': x} (server: 'uniprefill_p': x) with 0 < x <= 1")
