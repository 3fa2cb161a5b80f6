"""The vLLM settings of a dropping engine, in one place: the example, the GPU scripts and the
docs' commands all build them here.

Mode 3 (vLLM's default, `mode=3` here): the uniprefill settings are the one option,
`compilation_config={"inductor_compile_config": {"uniprefill": {...}}}`; every other setting stays
vLLM's (Inductor and piecewise CUDA graphs, AOT compile, chunked prefill, prefix caching): `uniprefill.vllm.piecewise` rewrites the graph in front of vLLM's backend, and
`uniprefill.vllm.prefix_cache_guard` keeps dropped requests' blocks out of the prefix cache. Unless
`max_num_batched_tokens` is given, the plugin raises vLLM's step budget so that a prompt of up to 32,768
tokens fits in one step beside the running decodes (`uniprefill.vllm.prefill_budget`, option
`vllm_one_step_prefill`) and drops over all its tokens; a budget given here is kept, and a prompt longer than it drops among the tokens of its last chunk only
(`vllm_context_drops`; 1.43x instead of 2.39x at 32K on the Llama shape).

Mode 2 (`mode=2`, the channel measured before mode 3 worked): uniprefill's backend runs the rewritten
graph without Inductor (`inductor_compile_config["uniprefill"]` plus the backend string), chunked
prefill off with a step budget of at least the longest prompt, and the environment of
`uniprefill.env.prepare_vllm_channel` (AOT compile off). docs/vllm.md says why.
"""

from __future__ import annotations

from .checks import BACKEND_QUALNAME

__all__ = ["compilation_config", "dropping_engine_kwargs"]


def compilation_config(settings: dict, *, mode: int = 3, decode_graphs: bool = False) -> dict:
    """vLLM's `compilation_config` with these `UniPrefillConfig` fields. Mode 2 only: decode_graphs
    decodes under CUDA graphs that read the drop histories (the option "vllm_decode_graphs" with
    cudagraph_mode FULL_DECODE_ONLY; mode 3 does so under vLLM's default FULL_AND_PIECEWISE)."""
    options = dict(settings)
    if mode == 3:
        if decode_graphs:
            raise ValueError("decode_graphs is a mode-2 setting: mode 3 decodes under vLLM's own full graphs")
        return {"inductor_compile_config": {"uniprefill": options}}
    if mode != 2:
        raise ValueError(f"mode={mode}: expected 3 (vLLM's default) or 2 (uniprefill's backend)")
    config = {"mode": 2, "backend": BACKEND_QUALNAME, "inductor_compile_config": {"uniprefill": options}}
    if decode_graphs:
        options["vllm_decode_graphs"] = True
        config["cudagraph_mode"] = "FULL_DECODE_ONLY"
    return config


def dropping_engine_kwargs(settings: dict, *, max_model_len: int, mode: int = 3, decode_graphs: bool = False,
                           max_num_batched_tokens: int | None = None) -> dict:
    """`vllm.LLM(**kwargs)` settings (the model excepted) of an engine that drops prompts of up to
    `max_model_len` tokens. Mode 3: the one option and `max_model_len` (plus `max_num_batched_tokens`
    only when given). Mode 2: chunked prefill off and a step budget that holds the longest prompt
    (never below `max_model_len`). Prefix caching stays at vLLM's default in both."""
    kwargs = {"max_model_len": max_model_len,
              "compilation_config": compilation_config(settings, mode=mode, decode_graphs=decode_graphs)}
    if mode == 3:
        if max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        return kwargs
    return {**kwargs, "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(max_num_batched_tokens or 0, max_model_len)}
