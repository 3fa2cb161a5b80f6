"""Checks of the vLLM token layouts (`uniprefill.vllm.layout`): shapes always, index contents on request.

`validate="shapes"` (the default) runs the shape and host-count checks, which read no device
tensor; `validate="full"` also reads index contents (sorted, inside their request, last token
kept, slot mapping consistent with the block table), for tests and debugging.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .layout import KVCacheGroup, TokenLayout


def _host_int(name: str, t: torch.Tensor, dim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a host tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: expected a host (cpu) tensor, got one on {t.device} (reading it would sync)")
    if t.dim() != dim or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected a {dim}-D integer tensor, got {t.dim()}-D {t.dtype}")
    return t.long()


def _check_shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def _check_group(g: int, group: KVCacheGroup, num_reqs: int, tokens: int) -> None:
    if isinstance(group.block_size, bool) or not isinstance(group.block_size, int) or group.block_size < 1:
        raise ValueError(f"group {g}: block_size must be an integer >= 1, got {group.block_size!r}")
    if group.block_table.dim() != 2 or group.block_table.shape[0] < num_reqs:
        raise ValueError(f"group {g}: block_table: expected shape ({num_reqs}, max_blocks), got {tuple(group.block_table.shape)}")
    if group.slot_mapping.dim() != 1 or group.slot_mapping.shape[0] < tokens:
        raise ValueError(f"group {g}: slot_mapping: expected shape ({tokens},) (or longer, padded), "
                         f"got {tuple(group.slot_mapping.shape)}")


def _check_counts(counts: torch.Tensor, query_lens: torch.Tensor) -> None:
    c, q = counts.numpy(), query_lens.numpy()  # host tensors, read as numpy: no torch op per comparison
    bad = (c < 0) | (c > q) | ((q > 0) & (c == 0))
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise ValueError(f"kept_counts_cpu[{r}] = {int(c[r])}: expected 1..{int(q[r])} (a request keeps "
                         f"at least its last token and at most its {int(q[r])} tokens)")


def _check_blocks(tables: tuple[torch.Tensor, ...], blocks: tuple[int, ...], kv_base: torch.Tensor,
                  counts: torch.Tensor) -> None:
    """Every group's block table reaches the last KV index a request writes (one host reduction for all groups)."""
    c = counts.numpy()
    live = c > 0
    if not live.any():
        return
    last = int((kv_base.numpy() + c - 1)[live].max())
    for g, (table, block) in enumerate(zip(tables, blocks)):
        need = last // block + 1
        if need > table.shape[1]:
            raise ValueError(f"group {g}: block_table has {table.shape[1]} columns, expected at least {need} "
                             f"for the longest request")


def _check_kept_contents(layout: TokenLayout, kept: torch.Tensor, counts: torch.Tensor) -> None:
    k = kept.long().cpu()  # reads a device tensor: "full" validation only
    if k.numel() and (k[0] < 0 or k[-1] >= layout.num_actual_tokens or (k[1:] <= k[:-1]).any()):
        raise ValueError(f"kept: expected strictly increasing indices in [0, {layout.num_actual_tokens}), "
                         f"got {k.tolist()[:8]}...")
    qsl = layout.query_start_loc_cpu
    per_request = torch.bincount(torch.bucketize(k, qsl[1:], right=True), minlength=layout.num_reqs)
    if not torch.equal(per_request[: layout.num_reqs], counts):
        raise ValueError(f"kept: indices fall per request as {per_request.tolist()}, expected kept_counts_cpu "
                         f"{counts.tolist()}")
    last = (qsl[1:] - 1)[layout.query_lens_cpu > 0]
    missing = last[~torch.isin(last, k)]
    if missing.numel():
        raise ValueError(f"kept: expected every request's last token to be kept; rows {missing.tolist()[:8]} are not")


def _check_batch_contents(layout: TokenLayout) -> None:
    from .layout import _request_of_rows, _slots  # the layout module imports this one

    seq = layout.seq_lens.long().cpu()
    if not torch.equal(seq, layout.seq_lens_cpu):
        raise ValueError(f"seq_lens: expected num_computed_tokens + query lens = {layout.seq_lens_cpu.tolist()}, "
                         f"got {seq.tolist()}")
    if not torch.equal(layout.query_start_loc.long().cpu(), layout.query_start_loc_cpu):
        raise ValueError("query_start_loc and query_start_loc_cpu differ")
    qsl = layout.query_start_loc_cpu
    request = _request_of_rows(layout.query_lens_cpu, layout.num_actual_tokens, torch.device("cpu"))
    logical = layout.num_computed_tokens_cpu[request] + torch.arange(layout.num_actual_tokens) - qsl[request]
    positions = layout.positions.long().cpu()
    if not torch.equal(positions, logical):
        i = int(torch.nonzero(positions != logical)[0])
        raise ValueError(f"positions[{i}] = {int(positions[i])}, expected num_computed_tokens + index in request "
                         f"= {int(logical[i])}")
    for g, (table, block, slots) in enumerate(zip(layout.block_tables, layout.block_sizes, layout.slot_mappings)):
        if slots is None:  # not computed (`compact`'s slot_groups)
            continue
        expected = _slots(table.cpu(), block, request, logical)
        actual = slots.cpu()
        if not torch.equal(expected, actual):
            i = int(torch.nonzero(expected != actual)[0])
            raise ValueError(f"group {g}: slot_mapping[{i}] = {int(actual[i])}, expected {int(expected[i])} from "
                             f"block_table at logical KV index {int(logical[i])}")
