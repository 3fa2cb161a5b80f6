"""Attention metadata for the layers after a drop point in vLLM: the token layouts of one step.

Plain tensors and dataclasses: nothing here imports vLLM (CI cannot install it). The vLLM
plugin copies these fields into vLLM's per-layer metadata (`CommonAttentionMetadata.replace`
takes the names `TokenLayout.metadata_fields` returns).

Vocabulary. One vLLM step runs a flat batch of T tokens from R requests: request r owns the
rows `query_start_loc[r]:query_start_loc[r + 1]` and already has `num_computed_tokens[r]`
(ctx_r) tokens in its KV cache (prefix cache, earlier chunks, earlier decode steps). vLLM
writes the i-th token of request r at logical KV index ctx_r + i, i.e. at slot
`block_table[r, (ctx_r + i) // B] * B + (ctx_r + i) % B` of each KV-cache group.

A `TokenLayout` is that batch as one run of layers sees it. `batch_layout` builds the one vLLM
gave; `compact` keeps a sorted subset of its rows (a drop point) and recomputes
`query_start_loc`, `seq_lens`, the maxima and one slot mapping per KV-cache group, so that the
kept token i of request r goes to logical index `ctx_r - kv_removed_r + i`. `kv_removed_r` is
how many KV entries these layers hold for request r fewer than vLLM counts, because an EARLIER
step (its prefill) dropped tokens; it is 0 for a request dropping now and for every request
without a drop history. Positions stay ORIGINAL (RoPE stays right) and `source_index` maps
each row back to the step's original batch, so logits are read at each request's true last
token (`logits_indices`). Compacting a compacted layout composes (cumulative policy).

Host syncs. `compact` takes the kept counts on the host (the selection op produces them with
the drop point's one device-to-host copy) and never reads a device tensor under the default
`validate="shapes"`: it adds no sync. `validate="full"` also checks index contents (sorted,
inside their request, last token kept, slot mapping consistent with the block table) and
reads device tensors: for tests and debugging.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from uniprefill.kernels._common import to_device
from uniprefill.kernels.layout_rows import layout_rows

from .host_arrays import _ranges, _to_device, offsets_np, ranges_np  # noqa: F401  (re-exported)
from .layout_checks import (
    _host_int, _check_shape, _check_group, _check_counts, _check_blocks, _check_kept_contents, _check_batch_contents,
)

Validate = Literal["shapes", "full"]
_ABSENT = -(2 ** 40)  # position sentinel in the window tables: never inside a window


# ----------------------------------------------------------------------------- layouts
@dataclass(frozen=True, eq=False)
class KVCacheGroup:
    """One vLLM KV-cache group (layers sharing a block table), as vLLM gave it for this step."""

    block_table: torch.Tensor  # [R, max_blocks] int32, device
    block_size: int
    slot_mapping: torch.Tensor  # [>= T] int64, device; rows past T are padding (-1)


@dataclass(frozen=True, eq=False)
class TokenLayout:
    """A flat batch as one run of layers sees it; field names follow vLLM where they exist."""

    query_start_loc: torch.Tensor  # [R + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # [R + 1] int64, host
    seq_lens: torch.Tensor  # [R] int32, device: KV entries per request once this step is written
    seq_lens_cpu: torch.Tensor  # [R] int64, host
    num_computed_tokens_cpu: torch.Tensor  # [R] int64, host: vLLM's context count (ctx_r)
    kv_removed_cpu: torch.Tensor  # [R] int64, host: see the module docstring (negative: a right-aligned gap)
    block_tables: tuple[torch.Tensor, ...]  # per KV-cache group, [R, max_blocks]
    block_sizes: tuple[int, ...]
    slot_mappings: tuple[torch.Tensor | None, ...]  # per KV-cache group, [T] int64; None: not computed (`compact`)
    positions: torch.Tensor  # [T] int64, device: ORIGINAL position of each row
    source_index: torch.Tensor  # [T] int64, device: row in the step's original batch
    source_size: int  # rows of the step's original batch
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    row_request: torch.Tensor  # [T] int64, device: each row's request
    row_logical: torch.Tensor  # [T] int64, device: each row's logical KV index (kv_base + its index in its request)
    impl: str = "auto"  # the row kernels' implementation (`kernels.layout_rows`; `compact` passes it on)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.numel()

    @functools.cached_property
    def query_lens_cpu(self) -> torch.Tensor:
        """Host [R] (computed once: a layout is read by many steps of the drop path; do not write into it)."""
        return torch.from_numpy(np.diff(self.query_start_loc_cpu.numpy()))

    @property
    def logits_indices(self) -> torch.Tensor:
        """Row of each request's last token in this layout (vLLM's `query_start_loc[1:] - 1`)."""
        return self.query_start_loc[1:].long() - 1

    def rows_of_source(self, source_rows: torch.Tensor) -> torch.Tensor:
        """Rows here of the given rows of the original batch; -1 where one was dropped."""
        inverse = torch.full((self.source_size,), -1, dtype=torch.long, device=self.source_index.device)
        inverse[self.source_index] = torch.arange(self.num_actual_tokens, device=inverse.device)
        return inverse[source_rows.long()]

    @functools.cached_property
    def kv_base_cpu(self) -> torch.Tensor:
        """Host [R]: KV entries these layers hold for each request before this step's tokens (computed once)."""
        return self.num_computed_tokens_cpu - self.kv_removed_cpu

    def slot_mapping(self, group: int) -> torch.Tensor:
        """KV-cache group `group`'s slot mapping; raises where `compact` was told no layer of the group reads it."""
        slots = self.slot_mappings[group]
        if slots is None:
            raise ValueError(f"group {group}: this layout's slot mapping was not computed (compact's slot_groups "
                             f"named {[g for g, s in enumerate(self.slot_mappings) if s is not None]})")
        return slots

    def metadata_fields(self, group: int = 0) -> dict:
        """The fields of vLLM 0.26's `CommonAttentionMetadata` this layout changes, for `.replace(**...)`.

        Its host copies and caches (`_seq_lens_cpu`, `_num_computed_tokens_cpu`, ...) are
        replaced too: left alone they would describe the uncompacted batch.
        """
        return {
            "query_start_loc": self.query_start_loc,
            "query_start_loc_cpu": self.query_start_loc_cpu.to(torch.int32),
            "seq_lens": self.seq_lens,
            "num_actual_tokens": self.num_actual_tokens,
            "max_query_len": self.max_query_len,
            "max_seq_len": self.max_seq_len,
            "slot_mapping": self.slot_mapping(group),
            "positions": self.positions,
            "seq_lens_cpu_upper_bound": self.seq_lens_cpu.to(torch.int32),
            "_seq_lens_cpu": self.seq_lens_cpu.to(torch.int32),
            "_num_computed_tokens_cpu": self.kv_base_cpu.to(torch.int32),
            "_num_computed_tokens_cache": None,
            "_token_to_req_indices_cache": None,
        }

    def flash_attention_fields(self, group: int = 0) -> dict:
        """The fields of vLLM 0.26's `FlashAttentionMetadata` (the per-layer object that
        `unified_attention_with_output` reads) this layout changes. The block table stays:
        compacted rows are placed through the slots, not through a new table."""
        return {
            "num_actual_tokens": self.num_actual_tokens,
            "max_query_len": self.max_query_len,
            "query_start_loc": self.query_start_loc,
            "max_seq_len": self.max_seq_len,
            "seq_lens": self.seq_lens,
            "slot_mapping": self.slot_mapping(group),
        }


def install_layer_metadata(attn_metadata: dict, slot_mapping: dict, layers: dict[str, int],
                           layout: TokenLayout) -> None:
    """Point the given layers of one vLLM forward context at `layout` (the layers after a drop).

    attn_metadata, slot_mapping: the forward context's dicts keyed by layer name (vLLM shares
        one metadata object among the layers of a KV-cache group; a group spans layers before
        and after a drop, so the layers named here get a copy, one per object vLLM gave them: each
        `dataclasses.replace` is host time on the step's path).
    layers: layer name -> index of its KV-cache group in `layout`.
    FA3's ahead-of-time scheduler metadata (planned for the uncompacted batch; vLLM 0.26 plans
    it whenever FA3 runs and the model has at most one sliding-window size, e.g. Llama) is
    cleared: `flash_attn_varlen_func` then schedules the compacted batch itself.
    Cascade attention (shared-prefix metadata, also computed for the uncompacted batch) raises.
    """
    import dataclasses

    # (id of vLLM's object, group) -> (that object, kept alive so that its id is not reused; its copy for `layout`)
    copies: dict[tuple[int, int], tuple[object, object]] = {}
    for name, group in layers.items():
        if name not in attn_metadata:
            raise KeyError(f"no attention metadata for layer {name!r} in this forward context")
        meta = attn_metadata[name]
        key = (id(meta), group)
        if key not in copies:
            if getattr(meta, "use_cascade", False):
                raise NotImplementedError(f"{name}: cascade attention (shared-prefix metadata) after a drop")
            fields = layout.flash_attention_fields(group)
            if getattr(meta, "scheduler_metadata", None) is not None:
                fields["scheduler_metadata"] = None
            missing = sorted(set(fields) - {f.name for f in dataclasses.fields(meta)})
            if missing:
                raise TypeError(f"{name}: {type(meta).__name__} has no field(s) {missing}")
            copies[key] = (meta, dataclasses.replace(meta, **fields))
        attn_metadata[name] = copies[key][1]
        slot_mapping[name] = layout.slot_mapping(group)


def batch_layout(
    query_start_loc: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    seq_lens: torch.Tensor,
    num_computed_tokens_cpu: torch.Tensor,
    groups: Sequence[KVCacheGroup],
    positions: torch.Tensor | None = None,
    validate: Validate = "shapes",
    impl: str = "auto",
) -> TokenLayout:
    """The layout vLLM built for this step (before any drop point); `impl`: its row kernels' and its compactions'
    (`kernels.layout_rows`)."""
    qsl_cpu = _host_int("query_start_loc_cpu", query_start_loc_cpu, 1)
    num_reqs = qsl_cpu.numel() - 1
    if num_reqs < 0 or int(qsl_cpu[0]) != 0:
        raise ValueError(f"query_start_loc_cpu must start at 0 and have R + 1 entries; got {qsl_cpu.tolist()[:8]}")
    query_lens_np = np.diff(qsl_cpu.numpy())  # host arithmetic in numpy (`host_arrays`)
    if (query_lens_np < 0).any():
        raise ValueError(f"query_start_loc_cpu must not decrease; query lengths are {query_lens_np.tolist()}")
    _check_shape("query_start_loc", query_start_loc, (num_reqs + 1,))
    _check_shape("seq_lens", seq_lens, (num_reqs,))
    ctx = _host_int("num_computed_tokens_cpu", num_computed_tokens_cpu, 1)
    _check_shape("num_computed_tokens_cpu", ctx, (num_reqs,))
    ctx_np = ctx.numpy()
    if (ctx_np < 0).any():
        raise ValueError(f"num_computed_tokens_cpu must be >= 0; got {ctx.tolist()}")
    seq_lens_np = ctx_np + query_lens_np
    if not groups:
        raise ValueError("groups: expected at least one KV-cache group, got none")
    tokens = int(qsl_cpu[-1])
    device = query_start_loc.device
    for g, group in enumerate(groups):
        _check_group(g, group, num_reqs, tokens)
    if positions is not None and (positions.dim() != 1 or positions.shape[0] < tokens):
        raise ValueError(f"positions: expected shape ({tokens},) (one per token, 1-D), got {tuple(positions.shape)}")
    ctx_d, = _to_device([ctx_np], [query_start_loc.dtype], device)  # the logical index of a row is its position
    rows_pos, rows_src, request, logical, _ = layout_rows(query_start_loc, ctx_d, (), 1, tokens,
                                                         positions=positions, impl=impl)
    if positions is None:
        positions, source = rows_pos, rows_src
    else:
        positions, source = positions[:tokens].long(), torch.arange(tokens, device=device)
    layout = TokenLayout(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens,
        seq_lens_cpu=torch.from_numpy(seq_lens_np),
        num_computed_tokens_cpu=ctx,
        kv_removed_cpu=torch.from_numpy(np.zeros(num_reqs, dtype=np.int64)),
        block_tables=tuple(g.block_table for g in groups),
        block_sizes=tuple(int(g.block_size) for g in groups),
        slot_mappings=tuple(g.slot_mapping[:tokens].long() for g in groups),
        positions=positions,
        source_index=source,
        source_size=tokens,
        num_actual_tokens=tokens,
        max_query_len=int(query_lens_np.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens_np.max()) if num_reqs else 0,
        row_request=request,
        row_logical=logical,
        impl=impl,
    )
    if validate == "full":
        _check_batch_contents(layout)
    elif validate != "shapes":
        raise ValueError(f"validate={validate!r} is not one of ('shapes', 'full')")
    return layout


def compact(
    layout: TokenLayout,
    kept: torch.Tensor | None,
    kept_counts_cpu: torch.Tensor | None,
    *,
    kv_removed_cpu: torch.Tensor | None = None,
    align: Literal["left", "right"] = "left",
    validate: Validate = "shapes",
    slot_groups: Collection[int] | None = None,
) -> TokenLayout:
    """The layout of the layers after a drop point that keeps rows `kept` of `layout`.

    kept: sorted int indices into `layout`'s rows (device), or None to keep every row (then
        only `kv_removed_cpu` changes: see `relayout_kv`).
    kept_counts_cpu: host int [R], kept rows per request (ignored when `kept` is None).
    kv_removed_cpu: host int [R], KV entries these layers hold fewer than vLLM counts for each
        request because of EARLIER steps' drops (from `DropHistoryStore.kv_removed`); default:
        the input layout's.
    align: "left" (full-attention layers) puts request r's kept rows at logical indices
        `ctx_r - kv_removed_r + i`; "right" (sliding-window layers, `vllm.window`) puts
        them at the END of the span the entering rows had, `kv_base_r + (entering_r - kept_r) + i`,
        and records the gap as a negative `kv_removed` (kv_base grows by it): the last kept row
        keeps its logical index, and later decode tokens need no shift. `kv_removed_cpu` must
        be None with "right".
    slot_groups: the KV-cache groups whose slot mappings to compute (the groups of the layers that will run
        on this layout; each group is a gather over every row, a kernel on the host's path); None: all.
        The others are None (`TokenLayout.slot_mapping` raises for them).
    Requests whose rows are all kept (decode tokens, requests not eligible to drop) pass
    through: their rows, positions and, with kv_removed 0, slots are unchanged.
    """
    if validate not in ("shapes", "full"):
        raise ValueError(f"validate={validate!r} is not one of ('shapes', 'full')")
    num_reqs = layout.num_reqs
    query_lens = layout.query_lens_cpu
    if kept is None:
        counts = query_lens
    else:
        if kept_counts_cpu is None:
            raise ValueError("kept_counts_cpu: expected host counts per request with `kept`, got None")
        counts = _host_int("kept_counts_cpu", kept_counts_cpu, 1)
        _check_shape("kept_counts_cpu", counts, (num_reqs,))
        if kept.dim() != 1 or kept.numel() != int(counts.numpy().sum()):
            raise ValueError(f"kept: expected a 1-D tensor of sum(kept_counts_cpu) = {int(counts.numpy().sum())} "
                             f"indices, got shape {tuple(kept.shape)}")
        _check_counts(counts, query_lens)
    ctx = layout.num_computed_tokens_cpu
    # the host fields in numpy (`host_arrays`): views of the host tensors, new arrays wrapped without a copy
    counts_np, ctx_np = counts.numpy(), ctx.numpy()
    if align == "right":
        if kv_removed_cpu is not None:
            raise ValueError("kv_removed_cpu: right-aligned layouts shift nothing for earlier steps; pass None")
        # a gap before the kept rows
        removed = torch.from_numpy(layout.kv_removed_cpu.numpy() - (query_lens.numpy() - counts_np))
    elif align == "left":
        removed = layout.kv_removed_cpu if kv_removed_cpu is None else _host_int("kv_removed_cpu", kv_removed_cpu, 1)
    else:
        raise ValueError(f"align={align!r} is not one of ('left', 'right')")
    _check_shape("kv_removed_cpu", removed, (num_reqs,))
    removed_np = removed.numpy()
    if align == "left" and ((removed_np < 0) | (removed_np > ctx_np)).any():
        raise ValueError(f"kv_removed_cpu must lie in [0, num_computed_tokens]; got {removed.tolist()} "
                         f"for num_computed_tokens {ctx.tolist()}")
    if kept is not None and validate == "full":
        _check_kept_contents(layout, kept, counts)

    device = layout.query_start_loc.device
    qsl_np = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts_np, out=qsl_np[1:])
    tokens = int(qsl_np[-1])
    kv_base_np = ctx_np - removed_np  # KV entries before this step's first kept token
    seq_lens_np = kv_base_np + counts_np
    qsl_cpu, kv_base, seq_lens_cpu = (torch.from_numpy(a) for a in (qsl_np, kv_base_np, seq_lens_np))
    _check_blocks(layout.block_tables, layout.block_sizes, kv_base, counts)

    # the new per-request fields in one host-to-device copy, the rows in one kernel per block size
    qsl, kv_base_d, seq_lens = _to_device([qsl_np, kv_base_np, seq_lens_np],
                                          [layout.query_start_loc.dtype, layout.query_start_loc.dtype,
                                           layout.seq_lens.dtype], device)
    by_block: dict[int, list[int]] = {}
    for g, block in enumerate(layout.block_sizes):
        if slot_groups is None or g in slot_groups:
            by_block.setdefault(block, []).append(g)
    slots: list[torch.Tensor | None] = [None] * len(layout.block_sizes)
    gather = {} if kept is None else {"kept": kept, "source": layout.source_index}
    positions, source = layout.positions, layout.source_index
    for i, (block, groups) in enumerate(by_block.items() or [(1, [])]):  # no group asked for: the rows still
        pos, src, request, logical, group_slots = layout_rows(
            qsl, kv_base_d, [layout.block_tables[g] for g in groups], block, tokens, positions=layout.positions,
            impl=layout.impl, **(gather if i == 0 else {}))  # positions and sources gathered once
        if i == 0 and kept is not None:
            positions, source = pos, src
        for g, s in zip(groups, group_slots):
            slots[g] = s
    return TokenLayout(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens_cpu,
        num_computed_tokens_cpu=ctx,
        kv_removed_cpu=removed,
        block_tables=layout.block_tables,
        block_sizes=layout.block_sizes,
        slot_mappings=tuple(slots),
        positions=positions,
        source_index=source,
        source_size=layout.source_size,
        num_actual_tokens=tokens,
        max_query_len=int(counts_np.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens_np.max()) if num_reqs else 0,
        row_request=request,
        row_logical=logical,
        impl=layout.impl,
    )


def relayout_kv(layout: TokenLayout, kv_removed_cpu: torch.Tensor) -> TokenLayout:
    """Same rows, KV shifted for requests whose earlier prefill dropped (decode steps)."""
    return compact(layout, None, None, kv_removed_cpu=kv_removed_cpu)


def _request_of_rows(counts_cpu: torch.Tensor, tokens: int, device) -> torch.Tensor:
    requests = torch.arange(counts_cpu.numel(), device=device)
    return torch.repeat_interleave(requests, to_device(counts_cpu, device), output_size=tokens)


def _slots(table: torch.Tensor, block: int, request: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
    return table[request, logical // block].long() * block + logical % block
