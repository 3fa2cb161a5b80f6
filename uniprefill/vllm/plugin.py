"""The vLLM side of uniprefill: the `vllm.general_plugins` entry point and the backend that rewrites vLLM's graph.

Switching uniprefill on (written against vLLM 0.26.0; docs/vllm.md says what is verified): the settings
alone, every other vLLM setting at its default (compilation mode 3, VLLM_COMPILE):

    LLM(model, compilation_config={"inductor_compile_config": {"uniprefill": {"p": 0.99, "vllm_drop": True}}})

`CompilationConfig` forbids unknown fields; `inductor_compile_config` is its one free-form dict (and part
of vLLM's config hash), so the settings travel under its key "uniprefill". In mode 3 vLLM's own backend
splits the graph at attention ops and compiles the pieces with Inductor: `register()` installs
`uniprefill.vllm.piecewise` on it, which rewrites the whole graph first (with `VllmTokenDropBackend`)
and takes the key out of the options it hands to Inductor.

Modes 1 and 2 (STOCK_TORCH_COMPILE, DYNAMO_TRACE_ONCE) hand the whole backbone to
`compilation_config.backend` and run what it returns without Inductor: `{"mode": 2, "backend":
"uniprefill.vllm.plugin.vllm_backend", ...}` runs the rewritten graph eagerly. That backend string is
resolved as `module.attribute` during model loading, while vLLM's current-config context is set, so
`vllm_backend` is built on attribute access (the module `__getattr__` below), bound to that config and
validated there: a bad setting fails engine construction with a `ValueError` naming it.

`register()` runs in every vLLM process, for every vLLM user who has uniprefill installed: it stays
idempotent and harmless (it wraps vLLM's scheduler and backend classes, inert unless an engine's config
carries the settings). `import uniprefill` never imports this module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

from .. import env
from ..config import UniPrefillConfig
from ..report import GraphReport
from ..models.layer_kinds import LayerKind
from ..unaccelerated import Kind, Unaccelerated, kind_of
from .hooks import VllmHooks, vllm_tp_group, vllm_window_layer  # noqa: F401  (re-exported)
from .checks import (  # noqa: F401  (re-exported: tests, scripts and docs use them from here)
    BACKEND_QUALNAME, CONFIG_KEY, SUPPORTED_MODES, VERIFIED_VLLM_VERSIONS, VllmCheck, _get, _mode_number,
    check_vllm_config, config_from_compilation_config, cudagraph_mode_name, decode_graphs_requested,
)

logger = logging.getLogger("uniprefill.vllm")

_loaded = False


def register() -> None:
    """The `vllm.general_plugins` entry point (vLLM calls it once per process): idempotent. Where vLLM is
    imported, it wraps vLLM's scheduler (`prefix_cache_guard`), compile backend (`piecewise`) and, where
    their module is loaded (the process that builds the engine's config), engine arguments
    (`prefill_budget`); otherwise it imports nothing."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import piecewise, prefill_budget, prefix_cache_guard

    # the guard first: if installing it fails, nothing after it is installed and nothing drops (vLLM logs the
    # plugin's failure), instead of dropping with prefix caching unguarded
    prefix_cache_guard.install_where_vllm_runs()
    piecewise.install_where_vllm_runs()
    prefill_budget.install_where_vllm_runs()
    logger.debug("uniprefill vLLM plugin loaded; enable it with compilation_config.inductor_compile_config[%r]",
                 CONFIG_KEY)


def plugin_loaded() -> bool:
    return _loaded


# ----------------------------------------------------------------------------- the backend
def _warm_up_max_seqlen(vllm_config: Any, config: UniPrefillConfig) -> int:
    """max_model_len when a dropping engine will run the Triton score-and-select kernels (CUDA,
    impl "auto" or "triton"): they are then compiled at the first dummy forward, not inside the
    first requests' prefills (`kernels/warm_up.py`); else 0."""
    import torch

    if not config.vllm_drop or config.impl == "torch" or not torch.cuda.is_available():
        return 0
    return int(_get(_get(vllm_config, "model_config"), "max_model_len", 0) or 0)


class VllmTokenDropBackend:
    """The dynamo backend vLLM calls with the whole backbone graph, bound to one config.

    By default every graph runs unaccelerated (plain FX, no Inductor) with the reason logged
    and kept in `graphs` (or raises under `strict=True`), and the report names the attention
    layers and the drop points the config would use. With the option `vllm_drop` the graph
    is rewritten (`vllm.rewrite`, `vllm.drop`, request ids from
    `vllm.runner_hook`; sliding-window layers after a drop through
    `vllm.window`; under TP > 1 the block scores are summed across vLLM's TP group, so
    every rank keeps the same rows): tested on CPU in a fake vLLM and with gloo ranks only.
    """

    def __init__(self, config: UniPrefillConfig, check: VllmCheck | None = None,
                 layer_kinds: Sequence[str] | None = None, *, block_size: int | None = None,
                 tensor_parallel: int = 1, hooks: Any = None, sliding_window: int | None = None,
                 graph_decode_max_reqs: int = 0, warm_up_max_seqlen: int = 0) -> None:
        """hooks: a `VllmHooks`, or a callable returning one (built when first needed).
        sliding_window: the model's window (tokens) for its "sliding" layers.
        graph_decode_max_reqs: vLLM's max_num_seqs when it decodes under CUDA graphs after drops
        (FULL_DECODE_ONLY with the option `vllm_decode_graphs`), else 0.
        warm_up_max_seqlen: vLLM's max_model_len where the score-and-select Triton kernels will
        run (CUDA): each runtime compiles them at its first dummy forward; 0: no warm-up."""
        self.config = config
        self.check = check or VllmCheck()
        self.layer_kinds = None if layer_kinds is None else [LayerKind(k) for k in layer_kinds]  # words checked
        self.block_size = block_size  # vLLM's KV-cache block size (cache_config.block_size)
        self.tensor_parallel, self.sliding_window = tensor_parallel, sliding_window
        self.graph_decode_max_reqs, self.warm_up_max_seqlen = graph_decode_max_reqs, warm_up_max_seqlen
        self._hooks = hooks if hooks is not None else VllmHooks.from_vllm
        self.graphs: list[GraphReport] = []
        self.runtimes: list = []  # one VllmDropRuntime per rewritten graph

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, vllm_version: str | None = None,
                         aot_compile: bool | None = None) -> "VllmTokenDropBackend":
        config = config_from_compilation_config(_get(vllm_config, "compilation_config"))
        if config is None:
            raise ValueError(f"compilation_config.backend is {BACKEND_QUALNAME!r} but compilation_config."
                             f"inductor_compile_config has no {CONFIG_KEY!r} entry; give one (an empty dict "
                             "takes the defaults)")
        check = check_vllm_config(vllm_config, vllm_version, aot_compile, drop_enabled=config.vllm_drop)
        check.raise_if_errors()
        for note in check.notes:  # what will run unaccelerated: a warning, so that it shows without logging set up
            logger.warning("uniprefill: %s", note)
        cache = _get(vllm_config, "cache_config")
        parallel = _get(vllm_config, "parallel_config")
        max_reqs = 0
        if config.vllm_drop and decode_graphs_requested(vllm_config, config):
            max_reqs = int(_get(_get(vllm_config, "scheduler_config"), "max_num_seqs", 0) or 0)
            if max_reqs < 1:  # without the table vLLM would capture graphs that ignore the drop histories
                raise ValueError("decode under CUDA graphs after drops needs scheduler_config.max_num_seqs (the size "
                                 f"of the table the graphs read); got {max_reqs}")
        return cls(config, check, _layer_kinds(vllm_config), block_size=_get(cache, "block_size"),
                   tensor_parallel=int(_get(parallel, "tensor_parallel_size", 1) or 1),
                   sliding_window=_get(_hf_text_config(vllm_config), "sliding_window"),
                   graph_decode_max_reqs=max_reqs, warm_up_max_seqlen=_warm_up_max_seqlen(vllm_config, config))

    def uuid(self) -> str:
        """The rewrite's code and this backend's settings (`passes.pass_uuid`), for compile caches."""
        from ..passes import pass_uuid

        return pass_uuid(self.config, extra_sources=("uniprefill.vllm",))

    def __call__(self, gm, example_inputs):
        rewritten = self.rewrite_graph(gm, example_inputs)
        return gm.forward if rewritten is None else rewritten.forward

    def rewrite_graph(self, gm, example_inputs):
        """A rewritten copy of `gm` (its runtime is `runtimes[-1]`), or None: the graph runs
        unaccelerated, the reason logged and kept in `graphs` (raised under `strict`)."""
        from .graph import attach_example_inputs

        attach_example_inputs(gm, example_inputs)
        names = [_target_name(n) for n in gm.graph.nodes if n.op == "call_function"]
        report = GraphReport(
            rewritten=False,
            reason=Unaccelerated("the vLLM rewrite is experimental and off: it is tested on CPU in a fake vLLM only "
                                 "(the option \"vllm_drop\": true turns it on; docs/vllm.md)", Kind.OPTION_OFF),
            layers=(), drop_layers=None,
            graph_ops={"attention": sum("unified_attention" in n for n in names),
                       "kv_cache_update": sum("unified_kv_cache_update" in n for n in names),
                       "gdn": sum("gdn_attention" in n for n in names),
                       "placeholders": sum(1 for n in gm.graph.nodes if n.op == "placeholder")},
        )
        info = self._plan(gm, report)
        if info is None and self.config.vllm_drop:
            report.reason = Unaccelerated(f"its graph could not be read ({report.plan_error})", Kind.GRAPH_NOT_FOLLOWED)
        if info is not None and self.config.vllm_drop:
            rewritten = self._rewrite(gm, info, report)
            if rewritten is not None:
                self.graphs.append(report)
                return rewritten
            if kind_of(report.reason) is None:  # a model or engine setting `_rewrite` refused
                report.reason = Unaccelerated(report.reason, Kind.VLLM_NOT_SUPPORTED)
        self.graphs.append(report)
        if self.config.strict:
            raise RuntimeError(f"uniprefill cannot rewrite this vLLM graph: {report.reason}")
        message = f"uniprefill: running the vLLM graph unaccelerated: {report.reason}"
        logger.warning("%s (%d attention ops; layers %s; drop layers it would use: %s%s)", message,
                       report.graph_ops["attention"], list(report.layers), report.drop_layers,
                       f"; {report.plan_error}" if report.plan_error else "")
        warnings.warn(message, stacklevel=2)
        return None

    def _plan(self, gm, report: GraphReport):
        """The attention layers of the graph and the drop points the config picks among them."""
        from ..passes.classify import LayerInfo
        from ..passes.drop_points import resolve_drop_layers
        from .graph import analyze_vllm_graph

        try:
            info = analyze_vllm_graph(gm)
            report.layers = info.layers
            if self.layer_kinds is None:
                report.plan_error = "the model config gave no layer kinds"
                return None
            # every layer of the model, so that "auto" sees a hybrid's depth (Gated DeltaNet layers included)
            layers = set(info.layers) | set(range(len(self.layer_kinds)))
            kinds = {i: LayerInfo(i, self.layer_kinds[i] if i < len(self.layer_kinds) else LayerKind.OTHER)
                     for i in layers}
            report.drop_layers = resolve_drop_layers(self.config.drop_layers, kinds)
            return info
        except ValueError as exc:
            report.plan_error = str(exc)
            return None

    def _rewrite(self, gm, info, report: GraphReport):
        """The experimental vLLM rewrite (option `vllm_drop`); None, with the reason in the
        report, where it cannot run."""
        from .graph import analyze_vllm_graph
        from .rewrite import copy_graph_module, rewrite_vllm_graph
        from .drop import VllmDropRuntime

        if not report.drop_layers:
            report.reason = (f"drop_layers={self.config.drop_layers!r} selects no layer: no full-attention layer "
                             f"among the layer kinds {sorted(set(self.layer_kinds or []))}")
            return None
        if info.gdn_ops != len(info.linear_sites):
            report.reason = (f"{info.gdn_ops - len(info.linear_sites)} of {info.gdn_ops} Gated DeltaNet ops carry no "
                             "readable 'layers.<index>.' layer name: their metadata could not be rebuilt for the kept rows")
            return None
        linear = {site.layer for site in info.linear_sites}
        if linear and self.config.last_q < 2:
            report.reason = (f"last_q={self.config.last_q} with Gated DeltaNet layers after a drop: a prompt could keep "
                             "a single row, which vLLM's GDN metadata builder would take for a decode (whose kernels "
                             "read a state slot the prompt never wrote); use last_q >= 2")
            return None
        other = [i for i, kind in enumerate(self.layer_kinds or []) if kind == LayerKind.LINEAR and i not in linear]
        if other:
            report.reason = (f"recurrent or convolutional token mixers other than Gated DeltaNet (Mamba, short "
                             f"convolutions) at layers {other}: the vLLM rewrite does not rebuild their state metadata "
                             "for the kept rows")
            return None
        numbered = sorted(info.layers + tuple(linear))
        if not self.block_size or numbered != list(range(len(numbered))):
            report.reason = f"unknown KV block size, or layers that are not 0..L-1 (attention and Gated DeltaNet: {numbered})"
            return None
        first = min(report.drop_layers)
        sliding = [site.layer_name for site in info.sites
                   if site.layer > first and self.layer_kinds[site.layer] is LayerKind.SLIDING]
        if sliding and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            report.reason = (f"sliding-window layers run after drop layer {first} but the model config gives no "
                             f"sliding_window ({self.sliding_window!r})")
            return None
        hooks = self._hooks() if callable(self._hooks) else self._hooks
        if sliding and hooks.window_layer_fn is None:
            report.reason = "sliding-window layers run after a drop point and the hooks give no window_layer_fn"
            return None
        group = None
        if self.tensor_parallel != 1:
            if hooks.tp_group_fn is None:
                report.reason = f"tensor_parallel_size={self.tensor_parallel} and the hooks give no tp_group_fn"
                return None
            group = hooks.tp_group_fn()  # every rank sums the head-sharded block scores: one decision
        runtime = VllmDropRuntime(self.config, [site.layer_name for site in info.sites],
                                  [info.position(layer) for layer in report.drop_layers],
                                  hooks.context_fn, lambda name: self.block_size,
                                  num_prompt_tokens_fn=hooks.num_prompt_tokens_fn,
                                  request_ids_fn=hooks.request_ids_fn, opted_out_fn=hooks.opted_out_fn,
                                  request_p_fn=hooks.request_p_fn,
                                  windows={name: self.sliding_window for name in sliding},
                                  window_layer_fn=hooks.window_layer_fn, group=group,
                                  graph_decode_max_reqs=self.graph_decode_max_reqs,
                                  warm_up_max_seqlen=self.warm_up_max_seqlen,
                                  linear_layers={site.layer_name: site.attention_before for site in info.linear_sites})
        copy = copy_graph_module(gm)  # a refusal half-way must leave vLLM's graph intact
        try:
            result = rewrite_vllm_graph(copy, analyze_vllm_graph(copy), report.drop_layers, self.layer_kinds, runtime)
        except (ValueError, KeyError) as exc:
            report.reason = Unaccelerated(f"the vLLM rewrite refused this graph: {exc}", Kind.GRAPH_NOT_FOLLOWED)
            return None
        gm = copy
        dump = env.rewrite_dump_dir()  # debugging: the rewritten graph's code, with the rewrite's counts
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"rewritten-{os.getpid()}-{len(self.runtimes)}.py").write_text(f"# {result}\n{gm.code}")
        hooks.listeners.add(runtime)
        self.runtimes.append(runtime)
        report.rewritten, report.reason = True, ""
        report.counts = {k: v for k, v in dataclasses.asdict(result).items() if k != "drop_layers"}
        logger.warning("uniprefill: EXPERIMENTAL token dropping inside vLLM at layers %s (option vllm_drop; "
                       "first GPU runs on 2026-12-01, docs/vllm.md): %s", list(report.drop_layers), result)
        return gm


def _hf_text_config(vllm_config: Any) -> Any:
    """vLLM's model config's Hugging Face text config (or its whole config), or None."""
    model_config = _get(vllm_config, "model_config")
    return _get(model_config, "hf_text_config") or _get(model_config, "hf_config")


def _layer_kinds(vllm_config: Any) -> list[LayerKind] | None:
    """Layer kinds from vLLM's model config (its Hugging Face text config), or None."""
    from ..models.layer_kinds import layer_kinds

    hf_config = _hf_text_config(vllm_config)
    layers = _get(hf_config, "num_hidden_layers")
    if hf_config is None or not isinstance(layers, int):
        return None
    try:
        return layer_kinds(hf_config, layers)
    except ValueError as exc:
        logger.warning("uniprefill: layer kinds unknown: %s", exc)
        return None


def _target_name(node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)


def _vllm_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def _vllm_backend_from_current_config() -> VllmTokenDropBackend:
    try:
        from vllm.config import get_current_vllm_config
    except ImportError as exc:
        raise ImportError(f"{BACKEND_QUALNAME} is vLLM's backend and needs vllm installed") from exc
    try:
        from vllm import envs

        aot_compile = bool(envs.VLLM_USE_AOT_COMPILE)
    except (ImportError, AttributeError):  # a vLLM without AOT compile
        aot_compile = None
    return VllmTokenDropBackend.from_vllm_config(get_current_vllm_config(), _vllm_version(), aot_compile)


def __getattr__(name: str):
    # vLLM resolves compilation_config.backend with getattr(module, "vllm_backend") while its
    # config context is set; build a fresh backend bound to that config (no module state).
    if name == "vllm_backend":
        return _vllm_backend_from_current_config()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
