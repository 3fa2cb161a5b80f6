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

`generate()` routes transformers' generation loop through the same forward. A cache that
does not belong to the last dropped prefill, a multi-token continuation or a batch of
several rows after a drop raises instead of decoding garbage.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types

import torch

from .history import DropHistory

ATTENTION_NAME = "uniprefill_decode"
# Every compiled model adds entries to dynamo's cache of the SAME code objects (transformers'
# forward and its decorators), so the ninth model compiled in one process would pass dynamo's
# default recompile_limit (8) and silently run eagerly. Prefill calls raise the limits to at
# least these values, for the duration of the call only.
RECOMPILE_LIMIT = 64
ACCUMULATED_RECOMPILE_LIMIT = 1024


def _decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function for decode steps after a dropped prefill."""
    state = kwargs.get("uniprefill_decode")
    if state is None:
        raise RuntimeError("the uniprefill_decode attention needs the drop history (call through UniPrefillModel)")
    history, windows = state
    layer = module.layer_idx
    cached = key.shape[-2]
    expected = history.layer_positions(layer).numel() + history.decoded
    window = windows.get(layer, 0)
    if window == 0 and cached != expected:
        raise RuntimeError(
            f"layer {layer} holds {cached} cached keys but the last dropped prefill predicts {expected}: "
            "this cache does not belong to that prefill")
    positions = history.key_positions(layer, cached).to(key.device)
    query_position = history.seq_len + history.decoded - 1
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    gqa = query.shape[1] != key.shape[1]
    out = torch.ops.uniprefill.decode_attention(query, key, value, positions, query_position, window, scale, gqa)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from .. import ops  # noqa: F401  (registers uniprefill::decode_attention)

    AttentionInterface.register(ATTENTION_NAME, _decode_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@contextlib.contextmanager
def _attention_implementation(model, name: str):
    configs = [c for c in {id(model.config): model.config, **{id(getattr(model.config, k)): getattr(model.config, k)
               for k in ("text_config",) if hasattr(model.config, k)}}.values()]
    previous = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = name
        yield
    finally:
        for c, old in zip(configs, previous):
            c._attn_implementation = old


class UniPrefillModel(torch.nn.Module):
    """A causal LM whose prefills run through the uniprefill backend; see the module docstring."""

    def __init__(self, model: torch.nn.Module, backend, compiled_module=None) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "backend", backend)
        bound = types.MethodType(type(model).forward, model)
        object.__setattr__(self, "_compiled_forward", torch.compile(bound, backend=backend, dynamic=True))
        object.__setattr__(self, "_cache_id", None)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)

    @property
    def history(self) -> DropHistory | None:
        return self.backend.recorder.last

    def forward(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        history = self.history
        dropped = history is not None and history.points
        continuing = cache is not None and _cache_length(cache) > 0
        if ids is not None and continuing and ids.shape[1] < self.backend.config.effective_min_tokens:
            if dropped:
                return self._decode(history, (cache, ids), *args, **kwargs)
            # a short continuation of an undropped prefill: nothing to drop, run it eagerly
            return type(self.model).forward(self.model, *args, **kwargs)
        # a prefill: forget the previous history first, so a call that never reaches the
        # compiled graph (dynamo falling back to eager) cannot leave a stale one behind
        self.backend.recorder.last = None
        calls = self.backend.graph_calls
        limits = torch._dynamo.config
        with limits.patch(recompile_limit=max(limits.recompile_limit, RECOMPILE_LIMIT),
                          accumulated_recompile_limit=max(limits.accumulated_recompile_limit,
                                                          ACCUMULATED_RECOMPILE_LIMIT)):
            out = self._compiled_forward(*args, **kwargs)
        if self.backend.graph_calls == calls and ids is not None \
                and ids.shape[1] >= self.backend.config.effective_min_tokens:
            self.backend._warn("uniprefill: a prefill ran outside the compiled graph (torch.compile fell back "
                               "to eager, e.g. at its recompile limit): it ran unaccelerated")
        history = self.history
        cache_out = getattr(out, "past_key_values", None)
        object.__setattr__(self, "_cache_id", id(cache_out) if history is not None and history.points else None)
        return out

    def _decode(self, history: DropHistory, cache_and_ids, *args, **kwargs):
        cache, ids = cache_and_ids
        if id(cache) != self._cache_id:
            raise RuntimeError("this cache does not belong to the last dropped prefill of this model; "
                               "start a new prompt with a fresh cache")
        if ids.shape[0] != 1 or ids.shape[1] != 1:
            raise NotImplementedError(
                f"after a dropped prefill only one-token decode steps of one row are supported (got {tuple(ids.shape)})")
        _register_attention()
        history.decoded += 1
        windows = self.backend.layer_windows()
        with _attention_implementation(self.model, ATTENTION_NAME):
            return type(self.model).forward(self.model, *args, uniprefill_decode=(history, windows), **kwargs)

    def generate(self, *args, **kwargs):
        """`transformers` generation with prefill through the backend and decode on the compacted caches."""
        model = self.model
        original = model.forward

        @functools.wraps(original)
        def routed(*a, **k):
            return self.forward(*a, **k)

        model.forward = routed
        try:
            return type(model).generate(model, *args, **kwargs)
        finally:
            del model.forward


def _cache_length(cache) -> int:
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001  (caches without the method count as empty)
        return 0
