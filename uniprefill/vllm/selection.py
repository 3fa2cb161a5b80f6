"""The selection at a vLLM drop point: which rows of one step each request keeps (the method's score and
select over each eligible request's own rows, `kernels.api.score_and_select`), for `VllmDropRuntime`.

Index arithmetic runs on the host, vectorised (numpy, `host_arrays`), its results on the device in one copy per
dtype; one gather of q and k and one selection call (one sink count per request); one host sync for the kept counts
(inside `score_and_select`).
Under tensor parallelism `group` sums the block scores across ranks, so every rank keeps the same rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from uniprefill.config import UniPrefillConfig
from uniprefill.kernels._common import to_device

from .host_arrays import _to_device, offsets_np, ranges_np
from .layout import TokenLayout


def select_rows(config: UniPrefillConfig, q: torch.Tensor, k: torch.Tensor, layout: TokenLayout, eligible: torch.Tensor,
                drop_index: int, num_drop_points: int, p_of: Callable[[torch.Tensor], float | torch.Tensor],
                group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept rows and host counts per request: selected for the eligible requests, all rows
    for the others. Index arithmetic on the host (vectorised), one gather of q and k, one selection call.

    The sinks are the prompt's first `sink` tokens: a request whose step starts after some of them
    (the last chunk of a chunked prefill, a prefix-cache hit; their context stays whole) forces only
    the `sink - context` of them its step holds (rounded up to whole blocks), none once its context
    covers them: the selection takes one sink count per request (`SelectionRule.sink` as a tensor), so a
    step whose requests have different counts still makes one call (one host sync; on
    a tensor-parallel engine, one all-reduce of the block scores)."""
    cfg = config
    qsl, qlen = layout.query_start_loc_cpu.numpy(), layout.query_lens_cpu.numpy()  # host arithmetic in numpy
    eligible = eligible.numpy().astype(bool, copy=False)
    chosen = np.flatnonzero(eligible)
    lacking = np.maximum(cfg.sink - layout.num_computed_tokens_cpu.numpy()[chosen], 0)
    # A partial count goes up to whole blocks (the rule forces "blocks touching the first sink tokens": the
    # same blocks), capped at `sink` (a request without context keeps the config's rule exactly)
    sinks = np.minimum((lacking + cfg.block_size - 1) // cfg.block_size * cfg.block_size, cfg.sink)
    counts = qlen.astype(np.int64)  # a copy
    rows, kept_counts = _select(config, q, k, qsl, qlen, chosen, drop_index, num_drop_points, sinks, p_of, group)
    counts[chosen] = kept_counts
    parts = [rows]
    others = np.flatnonzero(~eligible)
    if others.size:
        parts.append(to_device(torch.from_numpy(ranges_np(qsl[:-1][others], qlen[others])), q.device))
    kept = parts[0] if len(parts) == 1 else torch.sort(torch.cat(parts)).values  # requests' rows are disjoint ranges
    return kept, torch.from_numpy(counts)


def _select(config: UniPrefillConfig, q: torch.Tensor, k: torch.Tensor, qsl: np.ndarray, qlen: np.ndarray,
            chosen: np.ndarray, drop_index: int, num_drop_points: int, sinks: np.ndarray, p_of, group
            ) -> tuple[torch.Tensor, np.ndarray]:
    """`score_and_select` over the requests `chosen` (host indices), each with its forced sink count `sinks`:
    their kept rows (device, batch row numbers) and kept counts (host)."""
    from uniprefill.kernels.api import SelectionRule, score_and_select

    cfg = config
    device = q.device
    lens = qlen[chosen].astype(np.int64)
    n_q = np.minimum(lens, cfg.last_q)
    ends = qsl[1:][chosen].astype(np.int64)
    key_rows = ranges_np(ends - lens, lens)
    query_rows = ranges_np(ends - n_q, n_q)
    cu_k, cu_q = offsets_np(lens), offsets_np(n_q)
    key_rows_d, query_rows_d, cu_q_d, cu_k_d = _to_device(  # one copy per dtype
        [key_rows, query_rows, cu_q, cu_k], [torch.int64, torch.int64, torch.int32, torch.int32], device)
    # always a tensor, even where every count is the same: one kernel variant for every step (the one the
    # engine's warm-up compiles, `VllmDropRuntime._warm_up_kernels`)
    rule = dataclasses.replace(SelectionRule.from_config(cfg, drop_index, num_drop_points),
                               sink=torch.from_numpy(sinks.astype(np.int64)))
    if rule.keep_ratio is None:  # top-p: a request may bring its own p
        rule = dataclasses.replace(rule, p=p_of(torch.from_numpy(chosen)))
    selection = score_and_select(
        q[query_rows_d], k[key_rows_d], cu_q_d, cu_k_d,
        int(lens.max()), rule, scale=q.shape[-1] ** -0.5, impl=cfg.impl,
        host_cu_seqlens=(cu_q.tolist(), cu_k.tolist()), group=group,
    )
    return key_rows_d[selection.kept_idx], np.asarray(selection.kept_counts, dtype=np.int64)
