"""Decode steps under vLLM's CUDA graphs (`cudagraph_mode=FULL_DECODE_ONLY`) after drops.

A graph replays the kernels recorded when vLLM captured it, with a dummy batch and no request
history; no Python runs at replay. The layers after a drop point must nevertheless attend, for
each request, over the KV entries they hold: vLLM's `seq_lens` minus what the request's prefill
dropped before them (`DropHistoryStore.kv_removed`), and write the new token's KV at the slot of
that shorter logical index. So here everything a later layer needs is computed ON THE DEVICE,
inside the graph, from buffers whose addresses the graph keeps:

* vLLM's own persistent inputs, which it refills before every replay: the group's `seq_lens`,
  `block_table` and `slot_mapping` (read from the metadata vLLM built for the capture);
* `DecodeTables.table`, `[columns, max_num_reqs]` int32: KV entries removed per request
  at the layers after each drop point, which `fill` (called by the model-runner hook before
  every step, `vllm.runner_hook`) refills from the drop histories, in the step's batch order.

`segment_metadata` is that computation, and the same formula the host path (`compact` with
`kv_removed_cpu`) applies on the host: tested equal on CPU. A decode step has one token per
request (speculative decoding is refused), so rows and requests coincide.

Sliding-window layers after a drop (Gemma-3) store their KV right-aligned (`vllm.window`), so a
decode token sits at its natural index and vLLM's own seq_lens and slots stay theirs. What they
need per row is the number of cache entries within the window over ORIGINAL positions: with a
`max_window`, the buffer also holds the store's window tables (`DropHistoryStore.window_tables`:
kept prompt positions near each prompt's end, prompt ends, has-history flags), refilled with the
removed table, and `window_rows` counts on the device what `window_first_visible` counts on the
host (tested equal on CPU, and through a recorded capture replayed for later steps).
"""

from __future__ import annotations

import dataclasses

import torch

from uniprefill.kernels.layout_rows import decode_segment, decode_window

from .. import env
from .drop_records import WindowRows
from .layout import _ABSENT
from .metadata import DropHistoryStore


class DecodeTables:
    """The device tables decode graphs read for the current step: KV entries removed per (column, request) and,
    with sliding layers after a drop, the window tables."""

    def __init__(self, columns: int, max_num_reqs: int, max_window: int = 0) -> None:
        if columns < 1 or max_num_reqs < 1 or max_window < 0:
            raise ValueError(f"columns={columns}, max_num_reqs={max_num_reqs}, max_window={max_window}: "
                             "expected >= 1, >= 1, >= 0")
        self.columns, self.max_num_reqs, self.max_window = columns, max_num_reqs, max_window
        self.table: torch.Tensor | None = None  # allocated once, on the first device seen; never reallocated
        # with sliding layers after a drop (max_window > 0): the store's window tables, same life
        self.tail: torch.Tensor | None = None  # [columns, max_num_reqs, max_window] int64
        self.prompt_end: torch.Tensor | None = None  # [max_num_reqs] int64
        self.has: torch.Tensor | None = None  # [max_num_reqs] bool
        self._filled: tuple | None = None  # (store version, request ids) of the current contents

    def on(self, device: torch.device) -> torch.Tensor:
        """The table, allocated zeroed on `device` the first time (a captured graph keeps its
        address). Call it outside any capture: the zero-fill would be captured and replayed."""
        if self.table is None:
            self.table = torch.zeros(self.columns, self.max_num_reqs, dtype=torch.int32, device=device)
            if self.max_window:
                self.tail = torch.full((self.columns, self.max_num_reqs, self.max_window), _ABSENT,
                                       dtype=torch.long, device=device)
                self.prompt_end = torch.zeros(self.max_num_reqs, dtype=torch.long, device=device)
                self.has = torch.zeros(self.max_num_reqs, dtype=torch.bool, device=device)
        elif self.table.device != torch.device(device):
            raise RuntimeError(f"the decode-removed table lives on {self.table.device}, asked for on {device}")
        return self.table

    def fill(self, store: DropHistoryStore, request_ids: tuple[str, ...]) -> None:
        """Rows 0..R-1 of every column from the requests' drop histories; the rest zero.
        Skipped when neither the requests nor the store changed since the last fill."""
        if self.table is None:
            return  # no forward has run: nothing was captured yet, and eager steps do not read it
        if len(request_ids) > self.max_num_reqs:
            raise RuntimeError(f"{len(request_ids)} requests in a step, more than max_num_reqs={self.max_num_reqs}")
        key = (store.version, request_ids)
        if key == self._filled:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the decode tables are refilled inside a CUDA graph capture: the capture would replay "
                               "the copy from a staging buffer that is reused after it")
        rows = store.rows_for(request_ids)
        host = torch.zeros(self.columns, self.max_num_reqs, dtype=torch.int32)
        for c in range(self.columns):
            host[c, :len(request_ids)] = store.kv_removed(rows, c + 1)
        upload(self.table, host)  # stream-ordered before the step's forward or graph replay
        if self.max_window:
            tail, prompt_end, has = store.window_tables(rows)
            count = len(request_ids)
            self.tail[:, count:] = _ABSENT
            upload(self.tail[:, :count], tail.transpose(0, 1))
            upload(self.prompt_end.zero_()[:count], prompt_end)
            upload(self.has.zero_()[:count], has)
        self._filled = key


def upload(destination: torch.Tensor, host: torch.Tensor) -> None:
    """`destination.copy_(host)`, without stopping the host on a CUDA device: a blocking host-to-device copy
    synchronizes the stream (the host waits for the previous step's kernels, which vLLM's asynchronous scheduling
    overlaps with this host code); a non-blocking one from pinned memory is only queued behind them. The pinned
    staging tensor comes from PyTorch's caching host allocator, which keeps it until the queued copy has read it; it
    is contiguous whatever `host`'s strides, because `copy_` would otherwise make a pageable contiguous copy first."""
    if destination.device.type == "cuda":
        staging = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        destination.copy_(staging.copy_(host), non_blocking=True)
    else:
        destination.copy_(host)


def segment_metadata(seq_lens: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                     removed: torch.Tensor, block_size: int, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_lens, slot_mapping) of a layer after a drop point, for a decode step of R requests.

    seq_lens int [R] (vLLM's, every token ever written), block_table [R, max_blocks],
    slot_mapping [T >= R] (vLLM's, -1 on padding rows), removed int [R]: device tensors.
    The new token of request r sits at logical index `seq_lens[r] - removed[r] - 1` of the
    layer's KV; padding rows keep vLLM's -1. Device ops only: no host sync, capturable; one kernel
    (`kernels.layout_rows.decode_segment`; `impl` as the config's).
    """
    return decode_segment(seq_lens, block_table, slot_mapping, removed, block_size, impl=impl)


def window_rows(seq_lens: torch.Tensor, block_table: torch.Tensor, tail: torch.Tensor, prompt_end: torch.Tensor,
                has: torch.Tensor, window: int, removed: torch.Tensor | None = None, impl: str = "auto") -> WindowRows:
    """A sliding layer's rows for a decode step of R requests after drops, on the device.

    seq_lens [R] (vLLM's, the new token included: it sits at logical index seq_lens - 1, its
    position), block_table [R, max_blocks] (vLLM's, of the layer's group), tail [>= R, max_window]
    (kept prompt positions of this layer's drop column), prompt_end / has [>= R]. Each row sees the
    cached keys at positions > pos - window: its kept prompt keys there plus its decoded tokens, or
    min(pos + 1, window) for a request without a history (`DropHistoryStore.window_first_visible`).
    Padding rows (seq_lens 0) read their request's first entry. `removed` [>= R] (the drop column's KV
    entries removed per request): rows of requests that removed none are marked `vllm_rows` (vLLM's own attention
    is exact there). Device ops only: capturable; one kernel (`kernels.layout_rows.decode_window`)."""
    request, logical, count, vllm_rows = decode_window(seq_lens, tail, prompt_end, has, window, removed, impl=impl)
    return WindowRows(block_table[:seq_lens.shape[0]], request, logical, count, vllm_rows=vllm_rows)


def keeps_vllm_rows(config) -> bool:
    """Whether an engine's decode graphs give the rows of requests that removed no KV entry vLLM's own attention in
    the sliding layers after a drop (`WindowRows.vllm_rows`): an engine at p = 1 that drops only for requests bringing
    their own p, whose other requests keep standard's bits."""
    return config.p >= 1.0 and config.keep_ratio is None


_VLLM_BASE = "_uniprefill_vllm_base"  # on metadata a capture installed: (vLLM's metadata, slot mapping) it came from


def _runtime_mode(context) -> str | None:
    """The forward context's CUDA-graph runtime mode by name (an enum's name is compared, so vLLM is not imported)."""
    mode = getattr(context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", mode)


def _capturing_full_graph(context) -> bool:
    """Whether this forward is being captured into a CUDA graph: the current CUDA stream is
    capturing (vLLM 0.26's runner V2 captures its FULL graphs with the forward context's mode set
    to NONE, read in `CudaGraphManager.capture`), or the forward context says FULL (runner V1). The tables such a
    graph reads are refilled only before steps the runners report as FULL (`runner_hook`): a graph of another mode
    captured through a drop point (none in vLLM 0.26: its breakable graphs run uncompiled) would replay stale ones."""
    if _runtime_mode(context) == "FULL":
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _piecewise_graph_step(context) -> bool:
    """Whether this forward runs (replays or captures) vLLM's piecewise CUDA graphs (mode 3): the
    forward context says PIECEWISE (runners V1 and V2)."""
    return _runtime_mode(context) == "PIECEWISE"


def graph_decode_point(runtime, context, q: torch.Tensor, layer: int) -> torch.Tensor:
    """The drop point of `runtime` (a `VllmDropRuntime`) while vLLM captures a decode CUDA graph: nothing drops (decode); the
    later layers get seq_lens and slots computed on the device from vLLM's persistent inputs
    and the removed-KV table (`vllm.graph_decode`), so that replays follow each
    step's requests. Every row is kept.

    vLLM may run one capture batch's forward more than once over the same metadata dicts
    (warm-up, then capture): what an earlier run installed is traced back to vLLM's own
    metadata (`_VLLM_BASE`), never computed from again, since it is not refilled at replay."""
    metadata, slot_mapping = context.attn_metadata, context.slot_mapping
    if not runtime.step.graph_base:  # the forward's first drop point
        runtime.totals.decode_graph_captures += 1
        runtime.step.graph_base = {name: getattr(metadata[name], _VLLM_BASE, None) or (metadata[name], slot_mapping[name])
                                for name in runtime.layer_names if name in metadata}
    column = runtime.drop_layers.index(layer) + 1
    table = runtime.graph_decode.table
    if table is None:
        raise RuntimeError("uniprefill: a decode CUDA graph is being captured before any eager forward allocated "
                           "the removed-KV table (vLLM runs a profiling forward first; this one did not)")
    installed = {}  # id(vLLM's metadata object): one per KV-cache group
    # (vLLM's seq_lens tensor, window): the rows' requests, positions and counts, shared by the KV-cache groups (vLLM
    # hands every group one seq_lens; Gemma-3-270M's 15 sliding layers are 5 groups): per group only its block table
    windowed = {}
    # an engine that drops only for requests bringing their own p (config p = 1, no keep_ratio): vLLM's attention
    # for every row, then the window kernel over the rows of requests that removed KV entries (it reads nothing for
    # the others: `skip`), so that the other requests' decode keeps standard's bits there (eager steps decide for the
    # whole step: a step holding a request that dropped runs the window kernel for all); an engine that drops by
    # default runs the window kernel alone
    exact = keeps_vllm_rows(runtime.config)
    buffer = runtime.graph_decode
    for name in runtime.layer_names[layer + 1:]:
        if name not in runtime.step.graph_base:
            continue
        meta, slots = runtime.step.graph_base[name]
        if meta.seq_lens.shape[0] != q.shape[0]:
            raise RuntimeError(f"uniprefill: vLLM captures a decode graph of {q.shape[0]} tokens for "
                               f"{meta.seq_lens.shape[0]} requests; decoding under CUDA graphs after a drop "
                               "needs one token per request (no speculative decoding)")
        if name in runtime.windows:  # right-aligned: vLLM's seq_lens and slots stay; the window's rows
            key = (meta.seq_lens.data_ptr(), meta.seq_lens.shape[0], runtime.windows[name])
            if key not in windowed:
                windowed[key] = window_rows(meta.seq_lens, meta.block_table, buffer.tail[column - 1], buffer.prompt_end,
                                            buffer.has, runtime.windows[name], table[column - 1] if exact else None,
                                            runtime.config.impl)
            rows = windowed[key]
            runtime.step.window_rows[name] = dataclasses.replace(rows, block_table=meta.block_table[:rows.count.shape[0]])
            continue
        if id(meta) not in installed:
            if getattr(meta, "use_cascade", False):
                raise NotImplementedError(f"{name}: cascade attention in a captured decode graph after a drop")
            lens, new_slots = segment_metadata(meta.seq_lens, meta.block_table, slots, table[column - 1],
                                               runtime.block_size_fn(name), runtime.config.impl)
            fields = {"seq_lens": lens, "slot_mapping": new_slots}
            # planned for vLLM's lengths: FA3 plans these itself. `env.debug_keep_fa3_plan()`, a diagnosis aid
            # sound at p = 1 only (no request holds fewer KV entries), keeps vLLM's plan (defaults_grid `p1keepplan`).
            # One plan per KV group and drop point for the shorter lengths, shared by the layers up to the next drop
            # point (4 planning kernels a step instead of 16 on the Llama-3.1-8B shape), showed no faster decode and
            # gave other bits than FA3's own plan (H100, 2026-12-07, docs/results/vllm-decode-profile-*): not done
            if getattr(meta, "scheduler_metadata", None) is not None and not env.debug_keep_fa3_plan():
                fields["scheduler_metadata"] = None
            ours = dataclasses.replace(meta, **fields)
            object.__setattr__(ours, _VLLM_BASE, (meta, slots))
            installed[id(meta)] = ours
        metadata[name] = installed[id(meta)]
        slot_mapping[name] = installed[id(meta)].slot_mapping
    rows = runtime._static_rows  # the runtime's persistent row numbers, made by an eager step before any capture
    if rows is not None and rows.numel() >= q.shape[0] and rows.device == q.device:
        return rows[:q.shape[0]]  # a view: no kernel in the graph
    return torch.arange(q.shape[0], device=q.device)  # recorded in the graph: one kernel at every replay
