"""Batches of several rows that fill a cache: one dropped prefill and one cache per row.

Rows keep different numbers of tokens at every drop point, so after a drop their caches
cannot share one dense `[B, heads, T, dim]` tensor without padding and per-row masks in
every layer. `UniPrefillModel` therefore splits a left-padded batch that fills a cache into
its rows: each row (pads stripped) is prefilled through the compiled graph on its own and
gets its own transformers cache and `DropHistory`; every decode step runs each row against
its own cache and stacks the logits. `RowCaches` carries the per-row state through
transformers' generation loop, which only asks it for the (padded) length it has seen.

Each row's result is exactly that row run alone (the tests check it). The price is a
Python loop over rows at every decode step: fine for `generate()` on a few long prompts,
not a serving engine (the vLLM integration batches decode through its own metadata).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from .history import DropHistory


@dataclass
class Row:
    cache: object  # a transformers cache holding this row's tokens only
    history: DropHistory | None  # None: the row was too short to drop (its cache is complete)


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
            row = Row(copy.deepcopy(row.cache), history)
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
