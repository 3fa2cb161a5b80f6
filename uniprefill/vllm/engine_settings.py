"""The vLLM settings of a dropping engine, in one place: the example, the GPU scripts and the
docs' commands all build them here.

Today the uniprefill channel needs compilation mode 2 with uniprefill's backend (the settings in
`inductor_compile_config["uniprefill"]`) and chunked prefill off with a step budget of at least the
longest prompt (a prompt drops only when it is prefilled in one step), plus the environment of
`uniprefill.env.prepare_vllm_channel`. Prefix caching stays at vLLM's default (on): the plugin keeps a
dropping request's blocks out of the cache (`uniprefill.vllm.prefix_cache_guard`). docs/vllm.md says
why each is needed.
"""

from __future__ import annotations

from .checks import BACKEND_QUALNAME

__all__ = ["compilation_config", "dropping_engine_kwargs"]


def compilation_config(settings: dict, *, decode_graphs: bool = False) -> dict:
    """vLLM's `compilation_config` for the uniprefill channel with these `UniPrefillConfig`
    fields. decode_graphs: decode under CUDA graphs that read the drop histories (the option
    "vllm_decode_graphs" with cudagraph_mode FULL_DECODE_ONLY)."""
    options = dict(settings)
    config = {"mode": 2, "backend": BACKEND_QUALNAME, "inductor_compile_config": {"uniprefill": options}}
    if decode_graphs:
        options["vllm_decode_graphs"] = True
        config["cudagraph_mode"] = "FULL_DECODE_ONLY"
    return config


def dropping_engine_kwargs(settings: dict, *, max_model_len: int, decode_graphs: bool = False,
                           max_num_batched_tokens: int | None = None) -> dict:
    """`vllm.LLM(**kwargs)` settings (the model excepted) of an engine that drops prompts of up to
    `max_model_len` tokens: the channel's compilation config, chunked prefill off, a step budget that
    holds the longest prompt (never below `max_model_len`); prefix caching left at vLLM's default."""
    return {"max_model_len": max_model_len, "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(max_num_batched_tokens or 0, max_model_len),
            "compilation_config": compilation_config(settings, decode_graphs=decode_graphs)}
