"""The `torch.compile` backend "uniprefill".

Three ways in:

* `torch.compile(model, backend="uniprefill", options={"p": 0.95})`: resolved through the
  `torch_dynamo_backends` entry point with no import needed; `options` are exactly the
  `UniPrefillConfig` field names.
* `uniprefill.compile(model, UniPrefillConfig(...))`: compiles with dynamic shapes (one
  graph for every prompt length) and keeps the backend on the result, so
  `uniprefill.last_drop_report(compiled)` and `uniprefill.graph_reports(compiled)` work.
* `torch.compile(model, backend=UniPrefillBackend(config))`.

Each graph dynamo hands over is rewritten by `uniprefill.passes.token_drop`. A graph that
cannot be rewritten safely runs unchanged with a warning naming the reason (or raises
under `strict=True`); its reason is kept in `backend.graphs` for users and tests. The
rewritten graph runs as plain PyTorch ops (no Inductor): prefill time is dominated by
matrix products and attention, which the rewrite shortens.

Output contract: logits and hidden states keep their original shapes. The last position's
values are the method's answer; rows of dropped tokens hold the hidden state they had when
dropped (logits computed from those states when the caller asks for all positions).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from .config import UniPrefillConfig
from .report import GraphReport  # noqa: F401  (re-exported: `uniprefill.backend.GraphReport`)
from .unaccelerated import Kind, Unaccelerated
from .runtime.history import DropHistory, DropRecorder, recording_into

logger = logging.getLogger("uniprefill.passes")
REWRITE_FAILED = "the rewritten graph failed"


class UniPrefillBackend:
    """A dynamo backend bound to one `UniPrefillConfig` and one drop recorder."""

    def __init__(self, config: UniPrefillConfig | None = None, decodes_caches: bool = False,
                 why_no_decode: str = "") -> None:
        self.config = config or UniPrefillConfig()
        # whether the caller decodes the compacted caches a dropped prefill returns (UniPrefillModel
        # does; a model called through plain torch.compile decodes with the plain attention, which
        # needs every token, so a call that fills a cache runs unaccelerated there)
        self.decodes_caches = decodes_caches
        self.why_no_decode = why_no_decode or (
            "a call that fills a cache (use_cache=True, the transformers default) under plain torch.compile: "
            "its decode steps would attend over compacted caches without the drop history; pass "
            "use_cache=False for prefill-only calls, or use uniprefill.compile(model) to generate")
        self.recorder = DropRecorder(self.config.policy)
        self.graphs: list[GraphReport] = []
        self._warned: set[str] = set()
        self.graphs_with_layers = 0  # graphs compiled that are not pieces without decoder layers
        self.graph_calls = 0  # calls that reached a graph this backend compiled (rewritten or not)
        # why the latest call ran unaccelerated (None: it ran the rewritten graph, or nothing ran yet)
        self.last_unaccelerated: Unaccelerated | None = None  # why the latest call ran unaccelerated
        # set when a graph shows that no call of this model can be accelerated and every new
        # prompt length would be traced again (passes.plan.LengthSpecialized): callers that
        # own the model (UniPrefillModel) then run it eagerly instead of recompiling per length
        self.stop_compiling: Unaccelerated | None = None
        # the string entry point's graphs record each call in the backend of the model whose parameters the call
        # passes (`_owner_of`): dynamo runs one compiled graph for every model of a class compiled with equal
        # options. None: every call records here (uniprefill.compile, a backend object passed to torch.compile)
        self.owner_of = None

    def for_another_model(self) -> UniPrefillBackend:
        """A backend for a model whose calls run this backend's graphs: the same settings and graph reports, its own
        drop recorder, latest reason and call count."""
        other = UniPrefillBackend(self.config, self.decodes_caches, self.why_no_decode)
        other.graphs, other.graphs_with_layers, other.stop_compiling = self.graphs, self.graphs_with_layers, \
            self.stop_compiling
        other.owner_of = self.owner_of
        return other

    def _sink(self, args) -> UniPrefillBackend:
        """The backend that records this call (itself, unless `owner_of` routes it)."""
        return self if self.owner_of is None else self.owner_of(args, self)

    def uuid(self) -> str:
        """The rewrite's code and this backend's settings (`passes.pass_uuid`), for compile caches."""
        from .passes import pass_uuid

        return pass_uuid(self.config)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        from .passes.plan import NoDecoderLayers
        from .passes.token_drop import LengthSpecialized, NothingToDrop, RewriteSkipped, TokenDropPass

        from .first_call import restart_with_dynamic_length

        dump = self.config.debug and logger.isEnabledFor(logging.INFO)
        if dump:
            logger.info("uniprefill: graph before rewrite\n%s", gm.print_readable(print_output=False))
        restart_with_dynamic_length(gm, example_inputs)  # a static first trace: retrace with a symbolic length
        try:
            result = TokenDropPass(gm, self.config).run()
        except RewriteSkipped as exc:
            reason = Unaccelerated(str(exc), exc.kind)
            self.graphs.append(GraphReport(False, reason))
            if isinstance(exc, NoDecoderLayers):
                return self._piece(gm.forward, reason)
            self.graphs_with_layers += 1
            if isinstance(exc, NothingToDrop):
                return self._counted(gm.forward, reason)
            if isinstance(exc, LengthSpecialized):
                self.stop_compiling = reason.prefixed("this model's traced program depends on the exact prompt length: ")
            if self.config.strict:
                raise RuntimeError(f"uniprefill cannot rewrite this graph: {reason}") from exc
            self._warn(f"uniprefill: running a graph unaccelerated: {reason}")
            return self._counted(gm.forward, reason)
        self.graphs_with_layers += 1
        report = GraphReport(True, "", result.layers, result.drop_layers, result.counts,
                             result.single_row_only, result.single_row_reason)
        self.graphs.append(report)
        if dump:  # with every node's fake value, so the dump shows the kept-token sizes (u0, ...)
            from .passes.fake_values import propagate_fake_values

            try:
                propagate_fake_values(result.graph_module)
            except Exception as exc:  # noqa: BLE001  (a debugging aid must not fail the compile)
                logger.info("uniprefill: no fake values for the dump (%s: %s)", type(exc).__name__, exc)
            logger.info("uniprefill: graph after rewrite\n%s", result.graph_module.print_readable(print_output=False))
        return self._guarded(gm, result)

    def _counted(self, forward, reason: Unaccelerated):
        def run(*args):
            sink = self._sink(args)
            sink.graph_calls += 1
            sink.last_unaccelerated = reason.prefixed("graph not rewritten: ")
            return forward(*args)

        return run

    def _piece(self, forward, reason: Unaccelerated):
        """A graph without decoder layers (a piece between graph breaks): its reason is the model's
        only while no graph with layers was compiled; otherwise that graph's reason stands. The first
        piece (the embedding) runs before dynamo traces the next graph, so only a later piece, with
        still no graph of layers, warns (or raises under `strict`)."""
        def run(*args):
            sink = self._sink(args)
            sink.graph_calls += 1
            if not self.graphs_with_layers:
                sink.last_unaccelerated = reason.prefixed("graph not rewritten: ")
            if not self.graphs_with_layers and len(self.graphs) > 1:
                if self.config.strict:
                    raise RuntimeError(f"uniprefill cannot rewrite this graph: {reason}")
                self._warn(f"uniprefill: running a graph unaccelerated: {reason}")
            return forward(*args)

        return run

    def _guarded(self, original: fx.GraphModule, result):
        """Run the rewrite, except for inputs it must not see (short prompts, several rows it can't pack,
        masks or positions the rewrite does not model: `passes.mask_inputs`)."""
        tokens_pos = result.tokens_index
        min_tokens = self.config.effective_min_tokens
        rewritten = result.graph_module

        def run(*args):
            tokens = args[tokens_pos]
            sink = self._sink(args)
            sink.recorder.last = None
            sink.graph_calls += 1
            why = self._unsound_call(result, args, tokens.shape[0], tokens.shape[1], min_tokens)
            if why is None and result.returns_cache and not self.decodes_caches:
                why = Unaccelerated(self.why_no_decode, Kind.CACHE_NOT_DECODABLE)
            if why is None and result.returns_cache and result.counts.get("bias_of_kept_keys"):
                from .passes.kept_key_bias import NO_DECODE_REASON  # a bias decode steps do not model

                why = Unaccelerated(NO_DECODE_REASON, Kind.CACHE_NOT_DECODABLE)
            sink.last_unaccelerated = why
            if why is None:
                try:
                    with recording_into(sink.recorder):  # the graph's recorder ops write here
                        return rewritten(*args)
                except Exception as exc:  # noqa: BLE001
                    # a bug of the rewrite (a graph it should have refused): never the user's
                    # problem. The rewritten graph writes caches only through ops that
                    # overwrite, so running the original afterwards gives the plain answer.
                    if self.config.strict:
                        raise
                    why = Unaccelerated(f"{REWRITE_FAILED}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                                        Kind.REWRITE_FAILED)
                    sink.last_unaccelerated = why
                    self._warn(f"uniprefill: {why}; this call runs unaccelerated (please report it)")
                    return original(*args)
            if why.kind is not Kind.NOTHING_TO_DROP:
                if self.config.strict:
                    raise RuntimeError(f"uniprefill cannot accelerate this call: {why}")
                self._warn(f"uniprefill: this call runs unaccelerated: {why}")
            return original(*args)

        return run

    @staticmethod
    def _unsound_call(result, args, rows: int, seq: int, min_tokens: int) -> Unaccelerated | None:
        from .passes.mask_inputs import failed_check

        if seq < min_tokens:
            return Unaccelerated(f"shorter than min_tokens ({seq} < {min_tokens} tokens): nothing to drop",
                                 Kind.NOTHING_TO_DROP)
        unsound = failed_check(result.input_checks, args, rows, seq, result.left_padding_only)
        if unsound:
            return Unaccelerated(unsound, Kind.INPUT_NOT_MODELLED)
        if result.single_row_only and rows > 1:
            return Unaccelerated(f"a batch of {rows} rows: {result.single_row_reason}", Kind.INPUT_NOT_MODELLED)
        if result.returns_cache and rows > 1:
            return Unaccelerated("a batch of several rows that fills a cache (uniprefill.compile(...) prefills and "
                                 "decodes such batches row by row)", Kind.INPUT_NOT_MODELLED)
        return None

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)

    @property
    def last_history(self) -> DropHistory | None:
        return self.recorder.last

    def layer_windows(self) -> dict[int, int]:
        """Sliding window of every layer any rewritten graph saw (0: none seen). Over all the graphs, not the latest:
        a graph traced for a prompt no longer than a layer's window has no band in its mask (transformers builds the
        sliding mask only beyond it; Gemma-3), so it reads that layer as unbounded; the window is the model's."""
        windows: dict[int, int] = {}
        for graph in self.graphs:
            for r in graph.layers if graph.rewritten else ():
                windows[r.layer] = windows.get(r.layer, 0) or r.window
        return windows


# The backends that the string entry point made, by each parameter of the model (held weakly: an
# entry goes with its model). `torch.compile(model, backend="uniprefill")` hands the backend a
# graph and its inputs, never the module, and returns a module that holds no reference to the
# backend; this map is how one compiled model gets one backend (one drop recorder, every graph's
# report) and how `last_drop_report(compiled)` finds it. Every parameter, not only the input
# embedding's weight: a graph traced from `inputs_embeds` holds no embedding lookup, and it must
# join (or start) the same backend. The only module-level state.
_BY_PARAMETER = WeakIdKeyDictionary()


def uniprefill_backend(gm: fx.GraphModule, example_inputs, options=None, mode=None):
    """Entry point for `torch.compile(model, backend="uniprefill", options={...})`."""
    config = UniPrefillConfig.from_options(options)
    parameters = [x for x in example_inputs if isinstance(x, torch.nn.Parameter)]  # dynamo lifts them to inputs
    backend = next((b for b in map(_BY_PARAMETER.get, parameters) if b is not None), None)
    if backend is None or backend.config != config:
        backend = UniPrefillBackend(config)
        backend.owner_of = _owner_of
    for parameter in parameters:
        _BY_PARAMETER[parameter] = backend
    return backend(gm, example_inputs)


def _owner_of(args, compiling: UniPrefillBackend) -> UniPrefillBackend:
    """The backend that records a call of a graph the string entry point compiled: the one registered for the
    parameters the call passes. Dynamo reuses a compiled graph for another model of the same class compiled
    with equal options (the parameters are graph inputs), so without this a second model's calls would be
    reported as the first's, and its own report would not exist. A model met first at run time gets a backend
    of its own, sharing the compiling one's settings and graph reports."""
    first = next((a for a in args if isinstance(a, torch.nn.Parameter)), None)  # every call: no list built
    if first is None:
        return compiling
    owner = _BY_PARAMETER.get(first)
    if owner is None or owner.config != compiling.config:
        owner = compiling.for_another_model()
        for parameter in (a for a in args if isinstance(a, torch.nn.Parameter)):
            _BY_PARAMETER[parameter] = owner
    return owner


def compile(model: torch.nn.Module, config: UniPrefillConfig | None = None, **options):
    """Compile `model` with the uniprefill backend (dynamic shapes: one graph for every length).

    Pass either a `UniPrefillConfig` or its fields as keywords. Returns a
    `uniprefill.runtime.generation.UniPrefillModel`: calling it runs prefills through the
    compiled graph; its `generate()` decodes against the compacted caches.
    """
    if config is not None and options:
        raise ValueError("pass either a UniPrefillConfig or option keywords, not both")
    config = config or UniPrefillConfig.from_options(options)
    check_against_model(config, getattr(model, "config", None))
    from .compat import make_experts_opaque, make_linear_attention_opaque
    from .runtime.generation import UniPrefillModel, decode_unsupported

    make_linear_attention_opaque(model)
    make_experts_opaque(model)
    why = decode_unsupported(model)
    backend = UniPrefillBackend(config, decodes_caches=not why, why_no_decode=why)
    return UniPrefillModel(model, backend)


def check_against_model(config: UniPrefillConfig, model_config) -> None:
    """Settings that cannot fit this model raise `ValueError` now, not at the first call."""
    if model_config is None:
        return
    text = getattr(model_config, "text_config", None) or model_config
    layers = getattr(text, "num_hidden_layers", None)
    explicit = isinstance(config.drop_layers, tuple)
    if explicit and isinstance(layers, int):
        beyond = [i for i in config.drop_layers if i >= layers]
        if beyond:
            raise ValueError(f"drop_layers={list(config.drop_layers)} names layer(s) {beyond}, but the model has "
                             f"{layers} decoder layers (0..{layers - 1})")
    try:
        from .models.layer_kinds import LayerKind, layer_kinds

        kinds = layer_kinds(model_config)
    except Exception:  # noqa: BLE001  (a config this derivation cannot read: the graph's classification decides)
        return
    if LayerKind.OTHER in kinds:  # a layer type the config does not explain (e.g. attention beside an SSM): the graph decides
        return
    full = [i for i, kind in enumerate(kinds) if kind == LayerKind.FULL]
    if explicit:
        other = [f"{i} ({kinds[i]})" for i in config.drop_layers if kinds[i] != LayerKind.FULL]
        if other:
            raise ValueError(f"drop_layers={list(config.drop_layers)}: layer(s) {', '.join(other)} are not "
                             f"full-attention layers; this model's full-attention layers are {full}")
    count = len(config.drop_layers) if explicit else (len(full) if config.drop_layers == "all" else None)
    if config.keep_ratio is not None and len(config.keep_ratio) > 1 and count is not None \
            and len(config.keep_ratio) != count:
        raise ValueError(f"keep_ratio has {len(config.keep_ratio)} values for {count} drop points; "
                         "give one value or one per drop point")


def _backend_of(compiled) -> UniPrefillBackend:
    """The backend of a `uniprefill.compile` result, of the module `torch.compile(model,
    backend="uniprefill")` returned, or of a model whose forward that compiled."""
    backend = getattr(compiled, "backend", None)
    if isinstance(backend, UniPrefillBackend):
        return backend
    module = getattr(compiled, "_orig_mod", compiled)
    if not isinstance(module, torch.nn.Module) and callable(getattr(compiled, "_torchdynamo_orig_callable", None)):
        # torch.compile(model.forward, ...): a plain function (a compiled module has the attribute too)
        raise ValueError(f"{compiled!r} is a compiled function, not a model: for a compiled method "
                         "(torch.compile(model.forward, backend=\"uniprefill\")) pass the model itself")
    parameters = module.parameters() if isinstance(module, torch.nn.Module) else ()
    backend = next((b for b in map(_BY_PARAMETER.get, parameters) if b is not None), None)
    if backend is None:
        raise ValueError("this model was not compiled with uniprefill.compile(...) or "
                         "torch.compile(..., backend=\"uniprefill\"), or has not run yet")
    return backend


def last_drop_report(compiled) -> DropHistory | None:
    """The drop history of the latest forward call (None if it dropped nothing)."""
    return _backend_of(compiled).last_history


def graph_reports(compiled) -> list[GraphReport]:
    """What the backend did with each graph it was given (layer kinds, drop points, reasons)."""
    return list(_backend_of(compiled).graphs)
