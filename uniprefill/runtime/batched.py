"""Batches of several rows that fill a cache: one dropped prefill and one cache per row.

Rows keep different numbers of tokens at every drop point, so after a drop their caches
cannot share one dense `[B, heads, T, dim]` tensor without padding and per-row masks in
every layer. `UniPrefillModel` therefore splits a left-padded batch that fills a cache into
its rows: each row (pads stripped) is prefilled through the compiled graph on its own and
gets its own transformers cache and `DropHistory`; every decode step runs each row against
its own cache and stacks the logits. `RowCaches` carries the per-row state through
transformers' generation loop, which only asks it for the (padded) length it has seen.
`prefill_rows` and `decode_rows` are those steps (`UniPrefillModel` calls them); several new
tokens at once (a batched chat's next turn) continue each row's cache as a batch of one would.

Each row's result is exactly that row run alone (the tests check it). The price is a
Python loop over rows at every decode step: fine for `generate()` on a few long prompts,
not a serving engine (the vLLM integration batches decode through its own metadata).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass

import torch

from .continuation import (
    check_step_mask, continue_token_by_token, new_tokens, removed_nothing, step_kwargs_not_taken,
)
from .history import DropHistory


@dataclass
class Row:
    cache: object  # a transformers cache holding this row's tokens only
    history: DropHistory | None  # None: the row was too short to drop (its cache is complete)
    # what to subtract from the batch's position ids to get this row's: its left pads where the prefill took no
    # position ids (the plain model then counted them from the pads, the row from its first real token), else 0
    position_offset: int = 0


def _base_cache_class():
    from transformers import DynamicCache

    return DynamicCache


class RowCaches(_base_cache_class()):
    """Per-row caches of one batch, seen by transformers' generation loop as one cache."""

    def __init__(self, rows: list[Row], padded_length: int) -> None:
        super().__init__()
        self.rows = rows
        self.padded_length = padded_length
        self.steps = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.padded_length + self.steps

    def update(self, *args, **kwargs):
        raise RuntimeError("RowCaches is filled by UniPrefillModel only; pass it back to the same model")

    # Beam search, contrastive search and num_return_sequences reorder, repeat or select the
    # batch's rows in place. A row that appears twice afterwards gets its own copy: each copy
    # appends its own decoded tokens to its cache and counts its own steps in its history.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.rows = _take_rows(self.rows, [int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.rows = _take_rows(self.rows, [int(i) for i in indices.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.rows = _take_rows(self.rows, [r for r in range(len(self.rows)) for _ in range(repeats)])

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a batch prefilled row by row cannot be cropped (assisted decoding is not supported)")


def _take_rows(rows: list[Row], order: list[int]) -> list[Row]:
    taken, used = [], set()
    for i in order:
        row = rows[i]
        if i in used:
            history = None if row.history is None else dataclasses.replace(row.history, points=list(row.history.points),
                                                                             _positions={})
            row = dataclasses.replace(row, cache=copy.deepcopy(row.cache), history=history)
        used.add(i)
        taken.append(row)
    return taken


def left_pad_counts(attention_mask: torch.Tensor | None, rows: int, length: int) -> list[int]:
    """Left-pad length of every row; `ValueError` for right padding or holes."""
    if attention_mask is None:
        return [0] * rows
    mask = attention_mask.to(torch.bool).cpu()
    if mask.shape != (rows, length):
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} for input_ids of shape {(rows, length)}")
    pads = []
    for r in range(rows):
        real = int(mask[r].sum())
        if real == 0:
            raise ValueError(f"row {r} of the batch holds no real token")
        if not bool(mask[r, length - real:].all()):
            raise ValueError(
                f"row {r} is not left-padded (a pad after a real token): uniprefill batches need left padding")
        pads.append(length - real)
    return pads


def stack_rows(outputs: list, pads: list[int], length: int, cache_key: str, cache) -> object:
    """One output for the batch: per-row logits right-aligned into `[B, L, V]`, pads zero."""
    logits = [o.logits for o in outputs]
    width = max(x.shape[1] for x in logits)
    # rows stripped of their pads return shorter logits: right-align them into the padded
    # length, unless every row returned the same few last positions (logits_to_keep)
    full = all(x.shape[1] == length - pad for x, pad in zip(logits, pads)) and any(pads)
    if all(x.shape[1] == width for x in logits) and not full:
        stacked = torch.cat(logits, dim=0)
    else:  # full-length logits of rows of different lengths: right-align, pads hold zeros
        stacked = logits[0].new_zeros((len(logits), length, logits[0].shape[-1]))
        for r, x in enumerate(logits):
            stacked[r, pads[r]:] = x[0]
    first = outputs[0]
    fields = {k: v for k, v in first.items() if k not in ("logits", "cache", "past_key_values")}
    fields["logits"] = stacked
    fields[cache_key] = cache
    return type(first)(**fields)


def output_cache_key(out) -> str:
    """The keyword under which a forward's output carries its cache ("cache" from transformers 5.x on)."""
    return "cache" if "cache" in out else "past_key_values"


def _row_kwargs(kwargs) -> tuple[str, dict]:
    cache_key = "cache" if "cache" in kwargs else "past_key_values"
    common = {"use_cache": True}
    if kwargs.get("logits_to_keep") is not None:
        common["logits_to_keep"] = kwargs["logits_to_keep"]
    return cache_key, common


def prefill_rows(model, prefill, last_history, ids: torch.Tensor | None, kwargs: dict) -> tuple[object, list]:
    """Each row of a left-padded batch, pads stripped, through `prefill(row_ids, input_ids=..., cache=...)` (the
    wrapper's dropped prefill) into a cache of its own; `last_history()` is the history that prefill recorded. The
    batch's output (logits right-aligned, `RowCaches`) and the rows' histories (None: the row did not drop).
    A batch given as `inputs_embeds` (`ids` None; `generate(inputs_embeds=...)`) passes each row's embeddings."""
    from transformers import DynamicCache

    cache_key, common = _row_kwargs(kwargs)
    embeds = kwargs.get("inputs_embeds") if ids is None else None
    rows, length = (ids if ids is not None else embeds).shape[:2]
    pads = left_pad_counts(kwargs.get("attention_mask"), rows, length)
    outs, states = [], []
    for r in range(rows):
        cache = DynamicCache(config=model.config)
        row_ids = ids[r:r + 1, pads[r]:] if ids is not None else None
        extra = {"input_ids": row_ids} if ids is not None else {"inputs_embeds": embeds[r:r + 1, pads[r]:]}
        if kwargs.get("position_ids") is not None:
            positions = kwargs["position_ids"]
            extra["position_ids"] = positions[min(r, positions.shape[0] - 1):][:1, pads[r]:]
        out = prefill(row_ids, **{cache_key: cache}, **common, **extra)
        history = last_history()
        states.append(Row(cache, history if history is not None and history.points else None,
                          0 if kwargs.get("position_ids") is not None else pads[r]))
        outs.append(out)
    caches = RowCaches(states, length)
    return stack_rows(outs, pads, length, output_cache_key(outs[0]), caches), [row.history for row in states]


def _row_positions(positions: torch.Tensor | None, r: int, row: Row) -> dict:
    """Row r's share of the batch's `position_ids` for the new tokens, in the row's own count (`Row.position_offset`);
    none given: none (the row's cache counts them)."""
    if positions is None:
        return {}
    return {"position_ids": positions[min(r, positions.shape[0] - 1):][:1] - row.position_offset}


def decode_rows(model, decode_step, caches: RowCaches, ids: torch.Tensor | None, kwargs: dict):
    """The next tokens of every row of a batch `prefill_rows` filled: one token (a decode step; a row without a
    history runs the plain model), or several (`_continue_rows`). `decode_step(history, ids, **step)` is the
    wrapper's one-token decode on a compacted cache. The tokens come as `input_ids` or as `inputs_embeds`."""
    key, ids = new_tokens(kwargs)
    if ids is None or ids.dim() != (2 if key == "input_ids" else 3) or ids.shape[0] != len(caches.rows):
        raise NotImplementedError(
            f"a batch prefilled row by row continues with steps of all its {len(caches.rows)} rows as keyword "
            f"arguments (got {key} of shape {None if ids is None else tuple(ids.shape)})")
    extra = step_kwargs_not_taken(kwargs)
    if extra:
        raise NotImplementedError(f"a batch prefilled row by row continues each row on its own cache, which does "
                                  f"not take {extra}")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] != caches.get_seq_length() + ids.shape[1]:
        raise ValueError(f"attention_mask covers {mask.shape[-1]} positions; the batch's cache holds "
                         f"{caches.get_seq_length()} and {ids.shape[1]} are new")
    if ids.shape[1] > 1:
        return _continue_rows(model, decode_step, caches, ids, kwargs)
    cache_key, common = _row_kwargs(kwargs)
    outs = []
    positions = kwargs.get("position_ids")
    for r, row in enumerate(caches.rows):
        step = {key: ids[r:r + 1], cache_key: row.cache, **common, **_row_positions(positions, r, row)}
        if row.history is None:
            outs.append(type(model).forward(model, **step))
        else:
            outs.append(decode_step(row.history, ids[r:r + 1], **step))
    caches.steps += 1
    return stack_rows(outs, [0] * len(outs), 1, output_cache_key(outs[0]), caches)


def _one_token(decode_step, history, **step):
    return decode_step(history, new_tokens(step)[1], **step)


def _continue_rows(model, decode_step, caches: RowCaches, ids: torch.Tensor, kwargs: dict):
    """Several new tokens on a batch prefilled row by row (a batched chat's next turn): each row continues its
    own cache as a batch of one would. A row whose cache is whole (too short to drop, or nothing removed) runs
    the plain model over all the tokens; a compacted row continues token by token
    (`continuation.continue_token_by_token`; recurrent layers too: `continuation.recurrent_layers`)."""
    key = new_tokens(kwargs)[0]
    count = ids.shape[1]
    check_step_mask(kwargs.get("attention_mask"), count)
    cache_key, common = _row_kwargs(kwargs)
    positions = kwargs.get("position_ids")
    outs = []
    for r, row in enumerate(caches.rows):
        step = {key: ids[r:r + 1], cache_key: row.cache, **common, **_row_positions(positions, r, row)}
        if row.history is None or removed_nothing(row.history):
            outs.append(type(model).forward(model, **step))
            if row.history is not None:
                row.history.decoded += count
            continue
        one_token = functools.partial(_one_token, decode_step, row.history)
        outs.append(continue_token_by_token(one_token, ids[r:r + 1], step))
    caches.steps += count
    return stack_rows(outs, [0] * len(outs), count, output_cache_key(outs[0]), caches)
