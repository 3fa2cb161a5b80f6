"""Which continuations of a prefill the drop-history runtime can serve, decided before the prefill.

A prefill that drops leaves caches holding only the kept tokens; the runtime then continues them
one token at a time (`UniPrefillModel._decode_step`). Three ordinary doors of transformers need
more, and the prefill must know before it drops, since a compacted cache cannot be undone:

* fixed-size caches (`StaticCache`, `cache_implementation="static"`, and every cache whose layers
  are `StaticLayer`s): their layers are preallocated per position, so a layer after a drop point
  would hold holes where its dropped tokens were, and a decode step would attend to them;
* generation that feeds several tokens per step (assisted generation: `assistant_model`,
  `prompt_lookup_num_tokens`, `assistant_early_exit`, multi-token prediction `use_mtp`): the
  candidates are checked in one forward over the compacted cache, which the runtime's one-token
  decode does not model;
* chunked prefill (`prefill_chunk_size` shorter than the prompt): the drop needs the whole prompt in one
  forward, and the chunks after a dropped first one would continue its compacted cache token by token.

Such calls run the plain model, unaccelerated, saying why (`Kind.CACHE_NOT_DECODABLE`); assisted generation on a
cache a drop already compacted raises (it crops the cache to reject candidates). A prefill
that removed nothing (p = 1) leaves every cache whole: a continuation of several tokens on it runs
the plain model, exactly (`removed_nothing`).
"""

from __future__ import annotations

import copy

import torch

from .history import DropHistory

_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


def fixed_size_cache(cache) -> str | None:
    """Why `cache` cannot hold a dropped prefill (None: it can, or there is none)."""
    if cache is None:
        return None
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:  # a transformers without layered caches: nothing here is static
        return None
    static = [type(layer).__name__ for layer in getattr(cache, "layers", ()) if isinstance(layer, StaticLayer)]
    if not static:
        return None
    return (f"a fixed-size cache ({type(cache).__name__} with {static[0]} layers: cache_implementation='static' or "
            "a static cache passed in) keeps a slot per position, so the layers after a drop point would hold "
            "holes where dropped tokens were: the call runs unaccelerated (use a DynamicCache, the default)")


def multi_token_generation(model, kwargs: dict) -> str | None:
    """Why `model.generate(**kwargs)` would feed several tokens per step after the prefill (None: one token per
    step)."""
    named = assisted_options(model, kwargs)
    if not named:
        return None
    return (f"assisted generation ({', '.join(named)}) checks several candidate tokens per forward, and "
            "decode after a drop runs one token per step: the call runs unaccelerated")


def assisted_options(model, kwargs: dict) -> list[str]:
    """The assisted-generation options that make `model.generate(**kwargs)` run assisted generation (empty: it does
    not). Reads the call's generation config as transformers does: `generation_config` or the model's, updated
    with the call's keyword arguments."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    named = [k for k in _ASSISTED
             if (kwargs[k] if k in kwargs else getattr(config, k, None) if k != "assistant_model" else None)
             not in (None, False)]
    if named and config is not None:
        config = copy.deepcopy(config)
        config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
        try:
            mode = config.get_generation_mode(kwargs.get("assistant_model"))
        except Exception:  # noqa: BLE001  (an invalid config: transformers' own generate will say so)
            mode = None
        if mode is not None and getattr(mode, "value", mode) != "assisted_generation":
            return []  # transformers falls back to its base mode (beam search, ...) and warns
    return named


def chunked_prefill(model, kwargs: dict, prompt_length: int) -> str | None:
    """Why `model.generate(**kwargs)` would prefill a prompt of `prompt_length` uncached tokens in several forwards
    (transformers' `prefill_chunk_size`; None: in one). The drop scores the last queries of the whole prompt in one
    forward; a dropped first chunk would score that chunk's own queries, and every later chunk would continue the
    compacted cache one token at a time (hundreds of times slower than the chunk's forward)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    size = kwargs["prefill_chunk_size"] if "prefill_chunk_size" in kwargs else getattr(config, "prefill_chunk_size",
                                                                                        None)
    if size is None or prompt_length <= size:
        return None
    return (f"chunked prefill (prefill_chunk_size={size}) splits the {prompt_length}-token prompt into several "
            "forwards, and the drop needs the whole prompt in one: the call runs unaccelerated (leave "
            "prefill_chunk_size unset to accelerate; after the first drop layer, the drop itself cuts the "
            "prefill's activation memory)")


def removed_nothing(history: DropHistory) -> bool:
    """Whether the prefill's caches are the plain model's: every drop point kept every token (p = 1) and the prompt
    had no padding (the first drop point keeps real tokens only, so the layers after it hold no pad entries, which
    the plain model's do)."""
    return history.pad_positions is None and all(
        p.kept == p.entering and all(e == history.seq_len for e in p.entering) for p in history.points)


def check_step_mask(mask, count: int) -> None:
    """Decode steps on a compacted cache hide the prompt's pads only (the history's): a mask over the `count` new
    tokens (a 4-D tree of candidates, a zero among them) is not modelled, so it raises rather than being ignored."""
    if isinstance(mask, torch.Tensor) and (mask.dim() != 2 or not bool(mask[:, -count:].bool().all())):
        raise NotImplementedError(
            f"a continuation of {count} token(s) on a cache a drop compacted takes a 2-D attention mask whose last "
            f"{count} columns are ones (got {mask.dim()}-D{'' if mask.dim() != 2 else ' with zeros over the new tokens'})")


def recurrent_layers(model) -> list[int]:
    """Layers whose cache is a running state (recurrent or convolutional mixers, `LayerKind.LINEAR` / `OTHER`). A
    step of several tokens through such a state is the model's own code path: on a compacted cache uniprefill runs
    those tokens as one-token decode steps (`continue_token_by_token`), which give what the plain model's one-token
    steps and its forward over the whole sequence give. The plain model's several-token step agrees with them to
    rounding on tiny Qwen3-Next, Qwen3.5, LFM2 and GraniteMoeHybrid (5e-7), not on tiny Jamba, whose several-token
    step through a cached Mamba state is 2e-4 off its own whole-sequence forward (9e-4 off its one-token steps in the
    fuzzer's round 6c, which had such continuations raise until 2026-12-05)."""
    from ..models.layer_kinds import LayerKind, layer_kinds

    return [i for i, kind in enumerate(layer_kinds(model.config)) if kind in (LayerKind.LINEAR, LayerKind.OTHER)]


# what a continuation split into one-token steps passes on, per token (`continue_token_by_token`)
_STEP_KWARGS = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache_position", "cache",
                          "past_key_values", "use_cache", "logits_to_keep", "return_dict"})


def new_tokens(kwargs: dict) -> tuple[str, torch.Tensor | None]:
    """The new tokens of a call and the keyword they came by: `input_ids` ([rows, count]), else `inputs_embeds`
    ([rows, count, hidden]: a soft prompt, a multimodal turn), else ("input_ids", None)."""
    if kwargs.get("input_ids") is not None:
        return "input_ids", kwargs["input_ids"]
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds", kwargs["inputs_embeds"]
    return "input_ids", None


def step_kwargs_not_taken(kwargs: dict) -> list[str]:
    """The arguments of a call on a compacted cache (or on a batch prefilled row by row) that its steps would drop
    without a word: any argument set beyond `_STEP_KWARGS`, and `return_dict=False` (the steps return a ModelOutput)."""
    extra = sorted(k for k in set(kwargs) - _STEP_KWARGS if kwargs[k] is not None and kwargs[k] is not False)
    return extra + (["return_dict=False"] if kwargs.get("return_dict") is False else [])


def continue_token_by_token(decode_step, ids, kwargs: dict):
    """Several new tokens (a chat's next turn reusing the cache, a chunked continuation) on a cache a drop
    compacted: one decode step per token (`decode_step(input_ids=..., **step)`, the runtime's decode; or
    `inputs_embeds=...` where the tokens came as embeddings, `ids` then [1, count, hidden]), each token
    attending over the kept prompt keys, the decoded ones and the new ones before it: what the same tokens fed one
    at a time give. The logits of all of them come back as one call's would (`logits_to_keep` applied after)."""
    key = new_tokens(kwargs)[0]
    extra = step_kwargs_not_taken(kwargs)
    if extra or ids.dim() != (2 if key == "input_ids" else 3) or ids.shape[0] != 1:
        raise NotImplementedError(
            f"a continuation of {tuple(ids.shape)} tokens on a cache a drop compacted runs as one-token decode steps, "
            f"which do not take {extra or 'several rows'}")
    count = ids.shape[1]
    mask, positions, cache_position = (kwargs.get(k) for k in ("attention_mask", "position_ids", "cache_position"))
    check_step_mask(mask, count)
    outs = []
    for i in range(count):
        step = {k: v for k, v in kwargs.items() if k != "logits_to_keep"}
        step[key] = ids[:, i:i + 1]
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # covers the cached tokens and these
            step["attention_mask"] = mask[:, :mask.shape[1] - (count - 1 - i)]
        if isinstance(positions, torch.Tensor):
            step["position_ids"] = positions[..., i:i + 1]
        if isinstance(cache_position, torch.Tensor):
            step["cache_position"] = cache_position[i:i + 1]
        outs.append(decode_step(**step))
    logits = torch.cat([out.logits for out in outs], dim=1)
    keep = kwargs.get("logits_to_keep")
    if isinstance(keep, int) and keep > 0:
        logits = logits[:, -keep:]
    elif isinstance(keep, torch.Tensor):
        logits = logits[:, keep]
    out = outs[-1]
    out["logits"] = logits
    return out
