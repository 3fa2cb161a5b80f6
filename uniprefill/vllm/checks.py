"""What the vLLM plugin accepts: the uniprefill settings read from vLLM's `compilation_config`, and
the check of an engine's configuration (`check_vllm_config`) that decides whether it drops, runs
unaccelerated with a logged reason, or fails construction with a `ValueError` naming the setting.

Nothing here imports vLLM: the configuration objects are read by attribute or key (`_get`), so
the checks run in CI on plain namespaces (`tests/vllm/fake_vllm.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import env
from ..config import UniPrefillConfig

logger = logging.getLogger("uniprefill.vllm")

CONFIG_KEY = "uniprefill"
BACKEND_QUALNAME = "uniprefill.vllm.plugin.vllm_backend"
# the name before the vLLM code moved into uniprefill.vllm (2026-12-02); `uniprefill.vllm_plugin`
# is that package's plugin module under its old name, so configs written for it keep working
FORMER_BACKEND_QUALNAME = "uniprefill.vllm_plugin.vllm_backend"
SUPPORTED_MODES = {1: "STOCK_TORCH_COMPILE", 2: "DYNAMO_TRACE_ONCE"}  # with `BACKEND_QUALNAME`
VLLM_COMPILE = 3  # vLLM's default mode: its own backend, the rewrite hooked in front (`uniprefill.vllm.piecewise`)
# Read in source and run on the H200 (docs/vllm.md): the channel above, the rewrite, the runner
# hook, decode graphs. Dropping on another version needs the option vllm_allow_untested.
VERIFIED_VLLM_VERSIONS = ("0.26.0",)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def config_from_compilation_config(compilation_config: Any) -> UniPrefillConfig | None:
    """The `UniPrefillConfig` under `inductor_compile_config["uniprefill"]`, or None if absent.

    Accepts vLLM's `CompilationConfig` or the plain dict a user passes to `LLM(...)`.
    Unknown options and out-of-range values raise `ValueError` naming where they were found.
    """
    inductor = _get(compilation_config, "inductor_compile_config") or {}
    if not isinstance(inductor, Mapping):
        raise ValueError(f"compilation_config.inductor_compile_config: expected a dict, got {type(inductor).__name__}")
    if CONFIG_KEY not in inductor:
        return None
    options = inductor[CONFIG_KEY]
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ValueError(f"compilation_config.inductor_compile_config[{CONFIG_KEY!r}]: expected a dict of "
                         f"UniPrefillConfig fields, got {type(options).__name__} {options!r}")
    try:
        return UniPrefillConfig.from_options(options)
    except ValueError as exc:
        raise ValueError(f"compilation_config.inductor_compile_config[{CONFIG_KEY!r}]: {exc}") from None


def _mode_number(mode: Any) -> int | None:
    if mode is None:
        return None
    if isinstance(mode, str):
        names = {v: k for k, v in SUPPORTED_MODES.items()} | {"NONE": 0, "VLLM_COMPILE": 3}
        return names.get(mode.upper(), int(mode) if mode.isdigit() else -1)
    return int(mode)


_VLLM_SCHEDULERS = ("vllm.v1.core.sched.scheduler.Scheduler", "vllm.v1.core.sched.async_scheduler.AsyncScheduler")


def _guarded_scheduler(scheduler_cls: Any) -> bool:
    """Whether `scheduler_config.scheduler_cls` builds a vLLM `Scheduler` (which the prefix-cache guard
    wraps): None (vLLM's choice), one of vLLM's two by qualname, or a class derived from vLLM's."""
    if scheduler_cls is None or scheduler_cls in _VLLM_SCHEDULERS:
        return True
    return isinstance(scheduler_cls, type) and any(
        f"{c.__module__}.{c.__qualname__}" == _VLLM_SCHEDULERS[0] for c in scheduler_cls.__mro__)


@dataclass
class VllmCheck:
    """What `check_vllm_config` found: errors stop the engine, notes are logged."""

    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def raise_if_errors(self) -> None:
        if self.errors:
            raise ValueError("uniprefill cannot run with this vLLM configuration:\n  - " + "\n  - ".join(self.errors))


def cudagraph_mode_name(vllm_config: Any) -> str:
    """`compilation_config.cudagraph_mode` as an upper-case name ("NONE" when unset)."""
    graphs = _get(_get(vllm_config, "compilation_config"), "cudagraph_mode")
    return str(getattr(graphs, "name", graphs) or "NONE").upper()


def _settings(vllm_config: Any) -> UniPrefillConfig:
    """The uniprefill settings of a vLLM config (the defaults where it gives none)."""
    return config_from_compilation_config(_get(vllm_config, "compilation_config")) or UniPrefillConfig()


def decode_graphs_requested(vllm_config: Any, config: UniPrefillConfig | None = None) -> bool:
    """Whether decode steps replay full CUDA graphs that must read each step's drop histories
    (`vllm.graph_decode`): in mode 3 whenever its cudagraph_mode captures full decode graphs
    (FULL_AND_PIECEWISE, vLLM's default, or FULL_DECODE_ONLY); in modes 1 and 2 with FULL_DECODE_ONLY
    and the option `vllm_decode_graphs`."""
    config = config if config is not None else _settings(vllm_config)
    graphs = cudagraph_mode_name(vllm_config)
    if _mode_number(_get(_get(vllm_config, "compilation_config"), "mode")) == VLLM_COMPILE:
        return graphs in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
    return graphs == "FULL_DECODE_ONLY" and config.vllm_decode_graphs


def check_vllm_config(vllm_config: Any, vllm_version: str | None = None, aot_compile: bool | None = None,
                      drop_enabled: bool | None = None) -> VllmCheck:
    """Check the parts of a `VllmConfig` (or a duck-typed fake) uniprefill depends on.

    aot_compile: vLLM's `envs.VLLM_USE_AOT_COMPILE` (on by default with torch >= 2.10).
    drop_enabled: the experimental rewrite will drop tokens; None: the option `vllm_drop` of the
        uniprefill settings in the config.
    """
    check = VllmCheck()
    settings = _settings(vllm_config)
    if drop_enabled is None:
        drop_enabled = settings.vllm_drop
    for name, field_name in env.legacy_vllm_switches().items():
        check.notes.append(f"the environment variable {name} is no longer read: give \"{field_name}\": true in "
                           f"compilation_config.inductor_compile_config[{CONFIG_KEY!r}] instead")
    cc = _get(vllm_config, "compilation_config")
    mode = _mode_number(_get(cc, "mode"))
    backend = _get(cc, "backend")
    ours = backend in (BACKEND_QUALNAME, FORMER_BACKEND_QUALNAME)
    if mode == VLLM_COMPILE:
        if ours:
            check.errors.append(f"compilation_config.backend={backend!r} with mode 3 (VLLM_COMPILE): leave the backend "
                                "at vLLM's default; in mode 3 uniprefill rewrites the graph in front of vLLM's own "
                                f"backend (or use mode 2 with that backend)")
    elif mode not in SUPPORTED_MODES:
        check.errors.append(
            f"compilation_config.mode={_get(cc, 'mode')!r}: expected 3 (VLLM_COMPILE, vLLM's default), or 1 "
            f"(STOCK_TORCH_COMPILE) or 2 (DYNAMO_TRACE_ONCE) with backend {BACKEND_QUALNAME!r}")
    else:
        if mode == 2 and aot_compile:
            check.errors.append(
                "compilation_config.mode=2 with VLLM_USE_AOT_COMPILE=1 (vLLM's default on torch >= 2.10): dynamo's "
                "AOT compile needs a serialisable compiled function and uniprefill's backend returns a plain "
                "callable; set VLLM_USE_AOT_COMPILE=0, use mode 1, or mode 3 (vLLM's default)")
        if not ours:
            check.errors.append(f"compilation_config.backend={backend!r}: expected {BACKEND_QUALNAME!r} in mode {mode}")
    if settings.early_sparse:
        check.errors.append("early_sparse_p / early_sparse_keep (block-sparse attention before the first drop point) "
                            "is implemented for the Hugging Face backend only; remove it from the vLLM settings")
    parallel = _get(vllm_config, "parallel_config")
    if (_get(parallel, "pipeline_parallel_size", 1) or 1) > 1:
        check.errors.append("pipeline_parallel_size > 1 is not supported (drop layers may sit on another rank)")
    if _get(vllm_config, "speculative_config") is not None:
        check.errors.append("speculative decoding is not supported yet")
    graphs = cudagraph_mode_name(vllm_config)
    decode_graphs = decode_graphs_requested(vllm_config, settings)
    if drop_enabled and mode == VLLM_COMPILE and graphs == "FULL":
        check.errors.append(
            "compilation_config.cudagraph_mode=FULL with token dropping: every batch up to the capture size, prefills "
            "included, would replay one full CUDA graph, which cannot drop; use vLLM's default FULL_AND_PIECEWISE, "
            "PIECEWISE, FULL_DECODE_ONLY or NONE")
    elif drop_enabled and mode != VLLM_COMPILE and graphs != "NONE" and not decode_graphs:
        check.errors.append(
            f"compilation_config.cudagraph_mode={graphs} with token dropping: CUDA graphs would be captured "
            "without any request's drop history, so a replayed decode step would attend, in the layers after a "
            "drop, over KV entries those layers never wrote; use cudagraph_mode NONE (what vLLM sets for mode 2 "
            "unless FULL_DECODE_ONLY or VLLM_USE_BREAKABLE_CUDAGRAPH asks otherwise), or FULL_DECODE_ONLY with "
            "the option \"vllm_decode_graphs\": true (decode graphs that read each step's drop histories; experimental; "
            "run on the H200 with vLLM 0.26.0, docs/vllm.md)")
    if mode in SUPPORTED_MODES:
        check.notes.append(
            f"compilation mode {mode} runs the model without Inductor's fusion and without piecewise CUDA graphs "
            "for prefills: measured on the H200 (docs/benchmarks.md), dropping gave 2.07-2.42x standard vLLM's "
            "prefill throughput on a Llama-3.1-8B shape but 0.48-0.84x on Gemma-3-270M, whose layers are too small "
            "for that loss; compare with standard vLLM on your model")
    if drop_enabled and decode_graphs:
        check.notes.append(f"decode under full CUDA graphs after drops ({graphs}): experimental "
                           "(run on the H200 with vLLM 0.26.0 and FA3; sliding-window layers after a drop, Gemma-3: CPU-tested only)")
    runner = _get(_get(vllm_config, "model_config"), "runner_type", "generate")
    if runner not in (None, "generate"):
        check.errors.append(f"model_config.runner_type={runner!r}: uniprefill serves generation only (a pooling model "
                            "reads the hidden state of every prompt token, and after a drop point only the kept "
                            "tokens have one)")
    if (_get(parallel, "tensor_parallel_size", 1) or 1) > 1:
        check.notes.append("tensor_parallel_size > 1: block scores are summed across the TP group (rank-consistent "
                           "selection, tested with gloo ranks on CPU; not yet run on GPUs)")
    if _get(_get(vllm_config, "cache_config"), "enable_prefix_caching", False):
        check.notes.append(_context_note(settings, "prefix caching: a request that finds its prompt's start cached"))
        custom = _get(_get(vllm_config, "scheduler_config"), "scheduler_cls")
        if drop_enabled:
            check.notes.append(
                f"prefix caching with token dropping: requests of at least {settings.effective_min_tokens} prompt "
                "tokens that may drop publish no KV blocks from the step that ends their prompt on (after a drop "
                "point those blocks hold only the kept tokens); earlier chunks, opted-out requests and requests "
                "at top-p 1 publish as usual (uniprefill.vllm.prefix_cache_guard)")
            if not _guarded_scheduler(custom):
                check.errors.append(
                    f"scheduler_config.scheduler_cls={custom!r} with prefix caching and token dropping: the guard "
                    "that keeps dropped requests' blocks out of the prefix cache wraps vLLM's Scheduler; use "
                    "vLLM's scheduler or pass enable_prefix_caching=False")
    scheduler = _get(vllm_config, "scheduler_config")
    if _get(scheduler, "enable_chunked_prefill", False):
        budget = _get(scheduler, "max_num_batched_tokens")
        longest = _get(_get(vllm_config, "model_config"), "max_model_len")
        split = (f"chunked prefill with max_num_batched_tokens={budget} < max_model_len={longest}: a prompt longer "
                 f"than {budget} tokens is prefilled over several steps" if budget and longest and budget < longest
                 else "chunked prefill: a prompt split over several steps")
        check.notes.append(_context_note(settings, split))
    if vllm_version is not None and vllm_version.split("+")[0] not in VERIFIED_VLLM_VERSIONS:
        if drop_enabled and not settings.vllm_allow_untested:
            check.errors.append(
                f"vLLM {vllm_version} with token dropping: the rewrite reads vLLM internals (attention metadata "
                f"fields, the model runner's batch, CUDA-graph capture) verified in {list(VERIFIED_VLLM_VERSIONS)} "
                "only, and a change there could give wrong answers; install a verified version, or give the option "
                "\"vllm_allow_untested\": true to try it (and compare its outputs with standard vLLM's)")
        else:
            check.notes.append(f"vLLM {vllm_version} is untested; the channel was read in "
                               f"{list(VERIFIED_VLLM_VERSIONS)}")
    return check


def _context_note(settings: UniPrefillConfig, what: str) -> str:
    """What happens to a prompt whose start is in the KV cache when its last step runs."""
    if settings.vllm_context_drops:
        return (f"{what} drops among the tokens of its last step, its context whole (vllm_context_drops; in models "
                "with sliding-window layers after a drop point only where that step drops at least min(window - 1, "
                "context) rows, else it runs unaccelerated)")
    return f"{what} runs unaccelerated (vllm_context_drops is off)"
