"""The attention of decode steps after a dropped prefill, registered with transformers.

`decode_attention` is the attention-interface function "uniprefill_decode": it attends over
exactly the keys each layer cached, at their ORIGINAL positions (`DropHistory.key_positions`):
full layers see every cached key, sliding layers the keys whose original position lies inside
the window. A layer whose prefill ran eager attention (`sink_ops`: learned per-head sinks, logit
soft-capping, a float32 softmax; the form is in `DropHistory.attention`) decodes in the same form
(`sink_ops.decode_sink_attention`, the sinks from the model's `s_aux`); any other layer as SDPA.
`UniPrefillModel` (`runtime.generation`) switches a model to it for decode steps
(`_attention_implementation`) and hands it the drop history through `_DECODE_STATE`.
`uniprefill.compat.register_decode_attention` registers it with transformers' `AttentionInterface`
(the one global side effect; idempotent, it adds a name without replacing any).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.nn.functional as F

ATTENTION_NAME = "uniprefill_decode"
# The drop history of the decode step running in this context: models whose attention does not
# forward extra keyword arguments to the attention function (StableLM) still reach it.
_DECODE_STATE: contextvars.ContextVar = contextvars.ContextVar("uniprefill_decode_state", default=None)


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function for decode steps after a dropped prefill."""
    state = kwargs.get("uniprefill_decode") or _DECODE_STATE.get()
    if state is None:
        return _plain_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    history, windows, compacted = state
    layer = module.layer_idx
    # the form the prefill graph ran this layer's attention in (passes.sink_attention), not what the
    # keyword arguments suggest: an SDPA prefill ignored any softcap or s_aux the model passes
    softcap, upcast, has_sinks = history.attention.get(layer, (0.0, False, False))
    if layer in history.key_bias_layers:
        raise RuntimeError(f"layer {layer}'s prefill added a per-key bias (ALiBi), which decode steps after a drop "
                           "do not model: they cannot compute the same attention")
    sinks = _sinks(module, kwargs) if has_sinks else None
    if has_sinks and sinks is None:
        raise RuntimeError(f"layer {layer}'s prefill applied learned sinks, and this decode step was passed none "
                           "(s_aux): it cannot compute the same attention")
    cached = key.shape[-2]
    expected = history.layer_positions(layer).numel() + history.decoded
    # the window a prefill graph read from its mask, else the one the model hands its attention function: a prefill
    # shorter than the window traced no band (its graph reads the layer as unbounded), and decode steps pass it
    window = windows.get(layer, 0) or _module_window(kwargs)
    if window == 0 and cached != expected:
        raise RuntimeError(
            f"layer {layer} holds {cached} cached keys but the last dropped prefill predicts {expected}: "
            "this cache does not belong to that prefill")
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    gqa = query.shape[1] != key.shape[1]
    query_position = history.seq_len + history.decoded - 1
    if window and compacted and cached > window:
        # window_positions="compacted": the window counts cached (kept) tokens, i.e. the
        # query sees the last `window` of them (a sliding cache holds no more than that; a
        # full cache given to a sliding layer holds more)
        key, value = key[..., cached - window:, :], value[..., cached - window:, :]
    needs_positions = (window and not compacted) or history.pad_positions is not None
    positions = history.key_positions(layer, key.shape[-2]) if needs_positions else None
    if positions is not None and history.pad_positions is not None:
        # padding tokens the cache holds (layers before the first drop): place them after the
        # query, where the decode mask hides them
        positions = torch.where(torch.isin(positions, history.pad_positions), query_position + 1, positions)
    if sinks is not None or softcap or upcast:
        from ..ops import to_device

        out = torch.ops.uniprefill.decode_sink_attention(
            query, key, value, None if positions is None else to_device(positions, key.device), query_position,
            0 if compacted else window, scale, sinks, softcap, upcast)
    elif positions is None or (history.pad_positions is None and (window == 0 or compacted
                                                                 or query_position - int(positions[0]) < window)):
        # every cached key is visible (one query at the newest position; a full layer, or a
        # window that covers the oldest cached key): no mask, as the baseline's SDPA does
        out = F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=gqa)
    else:
        from ..ops import to_device

        out = torch.ops.uniprefill.decode_attention(query, key, value, to_device(positions, key.device),
                                                    query_position, 0 if compacted else window, scale, gqa)
    return out.transpose(1, 2).contiguous(), None


def _module_window(kwargs) -> int:
    """The `sliding_window` transformers' attention layers pass their attention function (None or absent on a layer
    that does not slide): 0 unless a positive int."""
    window = kwargs.get("sliding_window")
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else 0


def _sinks(module, kwargs) -> torch.Tensor | None:
    """The learned per-head sinks the model hands its attention function (`s_aux`, GPT-OSS), or None.

    A module that holds sinks but passes none would have its decode steps computed without them:
    refused rather than answered wrongly."""
    sinks = kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        raise RuntimeError(f"{type(module).__name__} holds attention sinks but passed none (s_aux) to the attention "
                           "function: decode steps after a drop cannot apply them")
    return sinks


def decode_kernels():
    """SDPA kernels for decode steps: flash, memory-efficient or math, never cuDNN.

    On the H200 (torch 2.11, cuDNN 9) SDPA picks cuDNN for a one-query step and cuDNN builds
    an execution plan for every new key length, i.e. at every step: Gemma-3-270M after a
    32K prefill decoded at 6.5-9.9 tokens/s with it and 37-39 without it (same cache, same
    tokens; docs/results/decode-gemma-270m-32k-h200.json).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _plain_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """A call of the plain model (another thread's) while a decode step has switched the model's attention to
    "uniprefill_decode": the model's own SDPA attention (the mask was built for SDPA too: `compat`). A model whose
    plain attention is another builds its masks otherwise, so that call raises instead of answering wrongly."""
    plain = getattr(getattr(module, "config", None), "_uniprefill_plain_attention", None)
    if plain == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    raise RuntimeError(
        f"the uniprefill_decode attention ran without a drop history: a call of the plain model while a decode step "
        f"of its UniPrefillModel switched the model's attention (its own: {plain!r}, not 'sdpa'); in threads, "
        "give each its own model object, or call through the UniPrefillModel")


@contextlib.contextmanager
def _attention_implementation(model, name: str):
    configs = [c for c in {id(model.config): model.config, **{id(getattr(model.config, k)): getattr(model.config, k)
               for k in ("text_config",) if hasattr(model.config, k)}}.values()]
    previous = [c._attn_implementation for c in configs]
    try:
        for c, old in zip(configs, previous):
            c._attn_implementation = name
            c._uniprefill_plain_attention = old  # for another thread's call of the plain model meanwhile
        yield
    finally:
        for c, old in zip(configs, previous):
            c._attn_implementation = old
            del c._uniprefill_plain_attention
