"""The selection at a vLLM drop point: which rows of one step each request keeps (the method's score and
select over each eligible request's own rows, `kernels.api.score_and_select`), for `VllmDropRuntime`.

Index arithmetic runs on the host, vectorised; one gather of q and k per forced-sink count; one host sync for the
kept counts (inside `score_and_select`). Under tensor parallelism `group` sums the block scores across ranks, so
every rank keeps the same rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from uniprefill.config import UniPrefillConfig

from .layout import TokenLayout, _offsets, _ranges


def select_rows(config: UniPrefillConfig, q: torch.Tensor, k: torch.Tensor, layout: TokenLayout, eligible: torch.Tensor,
                drop_index: int, num_drop_points: int, p_of: Callable[[torch.Tensor], float | torch.Tensor],
                group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept rows and host counts per request: selected for the eligible requests, all rows
    for the others. Index arithmetic on the host (vectorised), one gather of q and k per sink count.

    The sinks are the prompt's first `sink` tokens: a request whose step starts after some of them
    (the last chunk of a chunked prefill, a prefix-cache hit; their context stays whole) forces only
    the `sink - context` of them its step holds (rounded up to whole blocks), none once its context
    covers them. Requests are
    selected in groups of one forced-sink count (usually one group; the same groups on every
    tensor-parallel rank, which sum their block scores per call)."""
    cfg = config
    qsl, qlen = layout.query_start_loc_cpu, layout.query_lens_cpu
    chosen = torch.nonzero(eligible).flatten()
    lacking = torch.clamp(cfg.sink - layout.num_computed_tokens_cpu[chosen], min=0)
    # A partial count goes up to whole blocks (the rule forces "blocks touching the first sink tokens": the
    # same blocks), capped at `sink` (a request without context keeps the config's rule exactly): so the
    # values are 0, `sink` or multiples of the block size, not every count a context length leaves
    sinks = torch.minimum((lacking + cfg.block_size - 1) // cfg.block_size * cfg.block_size,
                          torch.tensor(cfg.sink))
    counts = qlen.clone()
    parts = []
    for sink in torch.unique(sinks).tolist():
        members = chosen[sinks == sink]
        rows, kept_counts = _select_group(config, q, k, qsl, qlen, members, drop_index, num_drop_points, int(sink),
                                          p_of, group)
        parts.append(rows)
        counts[members] = kept_counts
    others = torch.nonzero(~eligible).flatten()
    if others.numel():
        parts.append(_ranges(qsl[:-1][others], qlen[others]).to(q.device, non_blocking=True))
    kept = parts[0] if len(parts) == 1 else torch.sort(torch.cat(parts)).values  # requests' rows are disjoint ranges
    return kept, counts


def _select_group(config: UniPrefillConfig, q: torch.Tensor, k: torch.Tensor, qsl: torch.Tensor, qlen: torch.Tensor,
                  chosen: torch.Tensor, drop_index: int, num_drop_points: int, sink: int, p_of, group
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`score_and_select` over the requests `chosen` (host indices) with `sink` forced sink tokens:
    their kept rows (device, batch row numbers) and kept counts (host)."""
    from uniprefill.kernels.api import SelectionRule, score_and_select

    cfg = config
    device = q.device
    lens = qlen[chosen]
    n_q = torch.clamp(lens, max=cfg.last_q)
    ends = qsl[1:][chosen]
    key_rows = _ranges(ends - lens, lens)
    query_rows = _ranges(ends - n_q, n_q)
    cu_k, cu_q = _offsets(lens), _offsets(n_q)
    key_rows_d = key_rows.to(device, non_blocking=True)
    rule = dataclasses.replace(SelectionRule.from_config(cfg, drop_index, num_drop_points), sink=sink)
    if rule.keep_ratio is None:  # top-p: a request may bring its own p
        rule = dataclasses.replace(rule, p=p_of(chosen))
    selection = score_and_select(
        q[query_rows.to(device, non_blocking=True)], k[key_rows_d],
        cu_q.to(device, torch.int32), cu_k.to(device, torch.int32), int(lens.max()), rule,
        scale=q.shape[-1] ** -0.5, impl=cfg.impl, host_cu_seqlens=(cu_q.tolist(), cu_k.tolist()),
        group=group,
    )
    return key_rows_d[selection.kept_idx], torch.tensor(selection.kept_counts, dtype=qlen.dtype)
