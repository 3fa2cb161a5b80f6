"""Generation after a dropped prefill: the transformers adapter of the drop-history runtime.

`UniPrefillModel` wraps a Hugging Face causal LM. A call whose prompt is long enough runs
through the compiled, rewritten graph and records a `DropHistory`; the caches it fills hold,
for every layer after a drop point, only the kept tokens. A later one-token call on that
cache is a decode step: it runs the model eagerly with the attention implementation
"uniprefill_decode", which attends over exactly the keys each layer cached, at their
ORIGINAL positions (`DropHistory.key_positions`): full layers see every cached key, sliding
layers the keys whose original position lies inside the window. New tokens get their true
positions (prompt length + step) from transformers' own cache bookkeeping, which counts the
first layer, a layer no drop point precedes.

`generate()` routes transformers' generation loop through the same forward (greedy and
sampling alike). A left-padded batch of several rows that fills a cache is prefilled and
decoded row by row, each row with its own cache and history (`runtime.batched`;
`row_histories` holds them). Several new tokens on a compacted cache (a chat's next turn) run as
one-token decode steps (`continuation.continue_token_by_token`). A cache that does not belong to
the last dropped prefill or a batch that is not left-padded raises instead of decoding garbage.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types

import torch

from ..compat import register_decode_attention
from ..unaccelerated import Kind, Unaccelerated
from .batched import RowCaches, decode_rows, left_pad_counts, prefill_rows
from .decode_attention import (  # noqa: F401  (decode_kernels re-exported)
    _DECODE_STATE, ATTENTION_NAME, _attention_implementation, decode_kernels,
)
from .continuation import (
    assisted_options, check_step_mask, chunked_prefill, continue_token_by_token, fixed_size_cache,
    multi_token_generation, new_tokens, removed_nothing,
)
from .history import DropHistory

HISTORY_ATTRIBUTE = "uniprefill_drop_history"  # set on a cache filled by a dropped prefill
# Every compiled model adds entries to dynamo's cache of the SAME code objects (transformers'
# forward and its decorators), so the ninth model compiled in one process would pass dynamo's
# default recompile_limit (8) and silently run eagerly. Prefill calls raise the limits to at
# least these values, for the duration of the call only. They also trace `.item()` / `.tolist()`
# as unbacked sizes (capture_scalar_outputs) instead of breaking the graph: MoE routers that read
# their routing counts (JetMoE) then stay in the one graph with the embedding, and the rewrite
# recomputes those counts from the kept tokens (passes/shape_exprs.py).
RECOMPILE_LIMIT = 64
ACCUMULATED_RECOMPILE_LIMIT = 1024


class UniPrefillModel(torch.nn.Module):
    """A causal LM whose prefills run through the uniprefill backend; see the module docstring."""

    def __init__(self, model: torch.nn.Module, backend, compiled_module=None) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "backend", backend)
        bound = types.MethodType(type(model).forward, model)
        object.__setattr__(self, "_compiled_forward", torch.compile(bound, backend=backend, dynamic=True))
        # prefills run one at a time (the recorder holds the latest call's history); generate()
        # routes model.forward while any generate() runs, for the threads running one (thread id: count);
        # another thread's call of the plain model meanwhile runs the plain model
        object.__setattr__(self, "_lock", threading.RLock())
        object.__setattr__(self, "_routing", {})
        # after a batch prefilled row by row (see runtime.batched): each row's DropHistory
        object.__setattr__(self, "row_histories", None)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)

    @property
    def history(self) -> DropHistory | None:
        return self.backend.recorder.last

    def forward(self, *args, **kwargs):
        return self._forward(args, kwargs, from_generate=False)

    def _forward(self, args, kwargs, from_generate: bool):
        kwargs = _as_keywords(self.model, args, _cache_keyword_for(self.model, kwargs))
        ids = kwargs.get("input_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, RowCaches):
            return self._decode_rows(cache, ids, kwargs)
        tokens = new_tokens(kwargs)[1]  # [rows, length] ids or [rows, length, hidden] embeddings
        rows = 0 if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2 else tokens.shape[0]
        empty_cache = cache is None or _cache_length(cache) == 0
        fixed = fixed_size_cache(cache) if empty_cache else None
        if fixed is not None:
            self._unaccelerated(Unaccelerated(fixed, Kind.CACHE_NOT_DECODABLE))
            return self._eager(kwargs)
        if rows >= 2 and empty_cache and self._fills_cache(cache, kwargs):
            why = self._rows_unsupported(cache, kwargs, from_generate)
            if why is None:
                return self._prefill_rows(ids, kwargs)
            self._unaccelerated(Unaccelerated(why, Kind.INPUT_NOT_MODELLED))
            return self._eager(kwargs)
        continuing = cache is not None and not empty_cache
        if continuing:
            history = getattr(cache, HISTORY_ATTRIBUTE, None)
            if history is None and _compacted(cache):
                raise RuntimeError(
                    "this cache holds fewer tokens in later layers than in earlier ones (a dropped prefill filled "
                    "it) but carries no drop history: continue it with the UniPrefillModel that filled it")
            if history is not None and removed_nothing(history) \
                    and _cache_length(cache) != history.seq_len + history.decoded:
                # a whole cache that the plain model extended since (assisted generation, a direct model call): the
                # history no longer counts its tokens, and the plain model continues it exactly, now and after
                delattr(cache, HISTORY_ATTRIBUTE)
                history = None
            if history is None:
                # a cache that no drop compacted (the plain model's, or an undropped prefill's):
                # every layer holds every token, so the plain model continues it exactly
                return self._eager(kwargs)
            key, tokens = new_tokens(kwargs)  # input_ids, or inputs_embeds (a soft prompt, a multimodal turn)
            if tokens is None:
                raise NotImplementedError("after a dropped prefill decode steps take input_ids or inputs_embeds")
            several = tokens.dim() == (2 if key == "input_ids" else 3) and tokens.shape[1] > 1
            if several and removed_nothing(history):
                # several tokens on a cache whose drop points kept every token (p = 1): the plain model continues
                # it exactly; the history counts them, for one-token steps after
                out = self._eager(kwargs)
                history.decoded += tokens.shape[1]
                return out
            if several:  # recurrent layers too (`continuation.recurrent_layers`)
                return continue_token_by_token(lambda **step: self._decode_step(history, new_tokens(step)[1], **step),
                                               tokens, kwargs)
            check_step_mask(kwargs.get("attention_mask"), 1)
            return self._decode_step(history, tokens, **kwargs)
        return self._prefill(ids, **kwargs)

    def _eager(self, kwargs):
        return type(self.model).forward(self.model, **kwargs)

    def _unaccelerated(self, why: Unaccelerated) -> None:
        # the call drops nothing: the reports say so, not the previous call's drop
        self.backend.recorder.last = None
        object.__setattr__(self, "row_histories", None)
        self.backend.last_unaccelerated = why
        if self.backend.config.strict:
            raise RuntimeError(f"uniprefill cannot accelerate this call: {why}")
        self.backend._warn(f"uniprefill: this call runs unaccelerated: {why}")

    def _fills_cache(self, cache, kwargs) -> bool:
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.model.config, "use_cache", True)
        return bool(use_cache) or cache is not None

    def _rows_unsupported(self, cache, kwargs, from_generate: bool) -> str | None:
        """Why a batch that fills a cache cannot be prefilled row by row (None: it can)."""
        extra = sorted(set(kwargs) - _ROW_KWARGS)
        if extra:
            return f"a batch of several rows that fills a cache is prefilled row by row, which does not support {extra}"
        if kwargs.get("return_dict") is False:
            return "a batch of several rows that fills a cache returns a ModelOutput (return_dict=False)"
        if cache is not None and not from_generate:
            return ("a cache object was passed in for a batch of several rows: row-by-row prefill gives every row a "
                    "cache of its own and would leave the object passed in empty")
        tokens = new_tokens(kwargs)[1]
        try:
            left_pad_counts(kwargs.get("attention_mask"), tokens.shape[0], tokens.shape[1])
        except ValueError as exc:
            return f"{exc} (a batch of several rows that fills a cache is prefilled row by row)"
        return None

    def _prefill(self, ids, **kwargs):
        with self._lock:
            return self._prefill_locked(ids, **kwargs)

    def _prefill_locked(self, ids, **kwargs):
        # forget the previous history first, so a call that never reaches the compiled
        # graph (dynamo falling back to eager) cannot leave a stale one behind
        self.backend.recorder.last = None
        object.__setattr__(self, "row_histories", None)
        if self.backend.stop_compiling:
            # an earlier graph showed this model's program depends on the exact length: each new
            # length would be traced again only to be refused, so run the plain model
            self._unaccelerated(self.backend.stop_compiling)
            return self._eager(kwargs)
        calls = self.backend.graph_calls
        limits = torch._dynamo.config
        with limits.patch(recompile_limit=max(limits.recompile_limit, RECOMPILE_LIMIT),
                          accumulated_recompile_limit=max(limits.accumulated_recompile_limit,
                                                          ACCUMULATED_RECOMPILE_LIMIT),
                          capture_scalar_outputs=True):
            try:
                out = self._compiled_forward(**kwargs)
            except torch._dynamo.exc.TorchDynamoException as exc:
                return self._untraceable(exc, kwargs)
        if self.backend.graph_calls == calls and ids is not None \
                and ids.shape[1] >= self.backend.config.effective_min_tokens:
            self.backend._warn("uniprefill: a prefill ran outside the compiled graph (torch.compile fell back "
                               "to eager, e.g. at its recompile limit): it ran unaccelerated")
        history = self.history
        if not (history is not None and history.points):
            return out
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and history.rows == 1:
            # positions of padding tokens: the layers before the first drop cache them, and a
            # decode step must not attend to them (the plain model's mask hides them)
            pads = torch.nonzero(~mask[0].bool()).flatten().cpu()
            history.pad_positions = pads if pads.numel() else None
        cache_out = _output_cache(out)
        if cache_out is not None:
            # the cache carries its history (copies of the cache copy it too): decode steps on
            # it read it, whatever prefill the model ran since
            setattr(cache_out, HISTORY_ATTRIBUTE, history)
        return out

    def _untraceable(self, exc: Exception, kwargs):
        """torch.compile failed on this call. A bad setting (a ValueError of ours, wrapped by dynamo)
        is raised as itself; a model dynamo cannot trace runs eagerly, unaccelerated, saying why."""
        inner = exc.__cause__ or getattr(exc, "inner_exception", None)
        if isinstance(inner, ValueError):
            raise inner
        if self.backend.config.strict:
            raise exc
        self._unaccelerated(Unaccelerated(f"torch.compile cannot compile this model ({_what_failed(exc)})",
                                          Kind.NOT_COMPILABLE))
        return self._eager(kwargs)

    def _prefill_rows(self, ids, kwargs):
        out, histories = prefill_rows(self.model, self._prefill, lambda: self.history, ids, kwargs)
        object.__setattr__(self, "row_histories", histories)
        return out

    def _decode_rows(self, caches: RowCaches, ids, kwargs):
        return decode_rows(self.model, self._decode_step, caches, ids, kwargs)

    def _decode_step(self, history: DropHistory, ids, **kwargs):
        if ids.shape[0] != 1 or ids.shape[1] != 1:
            raise NotImplementedError(
                f"after a dropped prefill only one-token decode steps are supported (got {tuple(ids.shape)})")
        register_decode_attention()
        history.decoded += 1
        windows = self.backend.layer_windows()
        compacted = self.backend.config.window_positions == "compacted"
        # the attention implementation is switched on the model's config for the step: one step
        # at a time, so another thread's step never sees it switched back halfway
        state = (history, windows, compacted)
        with self._lock, _attention_implementation(self.model, ATTENTION_NAME), decode_kernels():
            token = _DECODE_STATE.set(state)
            try:
                return type(self.model).forward(self.model, uniprefill_decode=state, **kwargs)
            finally:
                _DECODE_STATE.reset(token)

    def generate(self, *args, **kwargs):
        """`transformers` generation with prefill through the backend and decode on the compacted caches."""
        model = self.model
        forward = type(model).forward
        try:
            named = _as_keywords(model, args, kwargs, type(model).generate)
        except TypeError:  # a generate taking *args (GraniteSpeech's): the assisted options are keywords anyway
            named = kwargs
        cache = named.get("past_key_values")
        history = getattr(cache, HISTORY_ATTRIBUTE, None)
        if history is not None and not removed_nothing(history):  # a cache a drop compacted: only we continue it
            assisted = assisted_options(model, named)
            if assisted:
                raise ValueError(
                    f"assisted generation ({', '.join(assisted)}) cannot continue a cache a dropped prefill "
                    "compacted: it checks several candidate tokens per forward and crops the cache to reject them, "
                    "which a cache holding fewer tokens in later layers cannot follow. Continue it without "
                    "assistance, or prefill the prompt with p = 1 (or with assistance, which then runs the plain "
                    "model)")
        else:
            why = multi_token_generation(model, named) or chunked_prefill(
                model, named, _prompt_length(named) - _cache_length(cache))
            if why is not None:  # decided before any prefill drops: the plain model's generate, unrouted
                self._unaccelerated(Unaccelerated(why, Kind.CACHE_NOT_DECODABLE))
                return type(model).generate(model, *args, **kwargs)

        routing = self._routing

        @functools.wraps(forward)
        def routed(*a, **k):
            if threading.get_ident() in routing:
                return self._forward(a, k, from_generate=True)
            return forward(model, *a, **k)  # the plain model, called by a thread that runs no generate() of ours

        me = threading.get_ident()
        with self._lock:
            if not routing:
                model.forward = routed
            routing[me] = routing.get(me, 0) + 1
        try:
            return type(model).generate(model, *args, **kwargs)
        finally:
            with self._lock:
                routing[me] -= 1
                if not routing[me]:
                    del routing[me]
                if not routing:
                    del model.forward

    # transformers' continuous batching, on the plain model, unaccelerated, saying why (`_CONTINUOUS_BATCHING`)
    def generate_batch(self, *args, **kwargs):
        return self._plain_continuous_batching("generate_batch", args, kwargs)

    def init_continuous_batching(self, *args, **kwargs):
        return self._plain_continuous_batching("init_continuous_batching", args, kwargs)

    def continuous_batching_context_manager(self, *args, **kwargs):
        return self._plain_continuous_batching("continuous_batching_context_manager", args, kwargs)

    def _plain_continuous_batching(self, method: str, args, kwargs):
        self._unaccelerated(Unaccelerated(_CONTINUOUS_BATCHING, Kind.CACHE_NOT_DECODABLE))
        return getattr(self.model, method)(*args, **kwargs)


_CONTINUOUS_BATCHING = (
    "transformers' continuous batching (generate_batch) packs requests into one paged cache whose blocks every "
    "layer shares, which a drop cannot compact per layer: it runs the plain model, unaccelerated (use generate, "
    "or uniprefill's vLLM option for serving)")

# keyword arguments a row-by-row batch understands; generation's own bookkeeping
# (positions, cache positions, the padded mask) is rebuilt per row from the row's cache
_ROW_KWARGS = frozenset({"input_ids", "inputs_embeds", "attention_mask", "cache", "past_key_values", "use_cache",
                         "logits_to_keep", "cache_position", "position_ids", "return_dict"})


def _as_keywords(model, args: tuple, kwargs: dict, method=None) -> dict:
    """The call's arguments by name (`model(ids, mask)` is `model(input_ids=ids, attention_mask=mask)`); `method`:
    the model class's method called (default `forward`)."""
    if not args:
        return kwargs
    signature = inspect.signature(method or type(model).forward)
    bound = signature.bind_partial(model, *args, **kwargs)
    named = dict(bound.arguments)
    named.pop(next(iter(signature.parameters)), None)  # self
    for key, value in list(named.items()):
        param = signature.parameters[key]
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            named.pop(key)
            named.update(value)
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            raise TypeError(f"{type(model).__name__}.{(method or type(model).forward).__name__} takes "
                            "extra positional arguments; pass them by name")
    return named


def _cache_keyword_for(model, kwargs: dict) -> dict:
    """Pass a cache under the name this transformers version reads.

    transformers 5.24 reads `cache=` (and still `past_key_values=`); 5.17 reads only
    `past_key_values=` and would silently ignore `cache=`, prefilling a cache of its own
    while the caller's stays empty. Renames `cache` to `past_key_values` where needed.
    """
    if "cache" not in kwargs:
        return kwargs
    if "past_key_values" in kwargs:
        raise TypeError("pass the cache once: as `cache=` or as `past_key_values=`, not both")
    if "cache" in inspect.signature(type(model).forward).parameters:
        return kwargs
    kwargs = dict(kwargs)
    kwargs["past_key_values"] = kwargs.pop("cache")
    return kwargs


def decode_unsupported(model) -> str:
    """Why decode steps after a drop cannot run on this model ("" when they can).

    They replace the attention through transformers' attention interface, which some attention
    classes bypass; they find a layer's kept tokens by the attention module's `layer_idx`, which a
    module shared by several layers lacks; and they model full and sliding-window layers, not
    chunked local attention (Llama-4's `chunked_attention` layers see only the keys of their own chunk)."""
    text = getattr(model.config, "text_config", None) or model.config
    if "chunked_attention" in (getattr(text, "layer_types", None) or ()):
        return ("the model has chunked local-attention layers, whose decode steps see only their own chunk, which "
                "decode after a drop does not model: a call that fills a cache runs unaccelerated "
                "(use_cache=False prefills are accelerated)")
    from ..passes.causal_table import is_table_shaped

    attention = [m for m in model.modules() if "Attention" in type(m).__name__ and (hasattr(m, "layer_idx") or any(
        is_table_shaped(b) for b in m.buffers(recurse=False)))]  # GPT-Neo's hold a mask table and no layer_idx
    shared = next((m for m in attention if not isinstance(getattr(m, "layer_idx", 0), int)), None)
    if shared is not None:  # one attention module serving several layers (Zamba's shared block)
        return (f"{type(shared).__name__} has no layer index of its own (layer_idx={shared.layer_idx!r}: one module "
                "serves several layers), so a decode step cannot tell which layer's kept tokens its cache holds: a "
                "call that fills a cache runs unaccelerated (use_cache=False prefills are accelerated)")
    classes = {type(m) for m in attention}
    for cls in classes:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        if "ALL_ATTENTION_FUNCTIONS" not in source and "attention_interface" not in source \
                and "AttentionInterface" not in source:
            return (f"{cls.__name__} computes attention itself, not through transformers' attention interface, so "
                    "decode steps cannot attend over compacted caches: a call that fills a cache runs unaccelerated "
                    "(use_cache=False prefills are accelerated)")
    return ""


def _compacted(cache) -> bool:
    """Whether full-attention layers of a transformers cache hold different token counts."""
    lengths = set()
    for layer in getattr(cache, "layers", ()):
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() >= 2 and not getattr(layer, "is_sliding", False):
            lengths.add(keys.shape[-2])
    return len(lengths) > 1


def _output_cache(out):
    """The cache object a forward returned (ModelOutput or tuple), or None."""
    items = out.values() if hasattr(out, "values") else (out if isinstance(out, tuple) else ())
    return next((item for item in items if hasattr(item, "get_seq_length")), None)


def _prompt_length(kwargs: dict) -> int:
    """The token count of a `generate` call's prompt (`inputs`, `input_ids` or `inputs_embeds`; 0 if none)."""
    tokens = kwargs["inputs"] if isinstance(kwargs.get("inputs"), torch.Tensor) else new_tokens(kwargs)[1]
    return tokens.shape[1] if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 else 0


def _cache_length(cache) -> int:
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001  (caches without the method count as empty)
        return 0


def _what_failed(exc: Exception) -> str:
    """"Type: message" of the error that made torch.compile fail: dynamo's wrapper says only
    "backend=... raised:" on its first line, so name the exception it wraps."""
    inner = exc.__cause__ or getattr(exc, "inner_exception", None) or exc
    lines = [line for line in str(inner).strip().splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0][:200]}" if lines else type(inner).__name__
