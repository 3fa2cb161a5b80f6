"""The records of the vLLM drop point's runtime (`uniprefill.vllm.drop`): what one step's drop
points did (`StepDrops`, `DropPointRecord`), the running totals of a runtime (`DropTotals`), and
what a sliding-window layer after a drop needs (`WindowLayer`, `WindowRows`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layout import TokenLayout


@dataclass(frozen=True)
class WindowLayer:
    """What `window_attention` needs of one vLLM sliding-window layer."""

    key_cache: torch.Tensor  # [num_blocks, B, Hk, D] (a view of vLLM's FlashAttention cache)
    value_cache: torch.Tensor
    scale: float
    softcap: float | None = None
    window: int | None = None  # the layer's own window, when known: checked against the runtime's


@dataclass(frozen=True)
class WindowRows:
    """A sliding layer's rows after a drop: request, own logical KV index and visible count; `kernel` says which
    window kernel runs them (`window.kernel_plan`): "per_row" (decode steps), "tiled" (requests of many rows), or
    "mixed": the rows `tiled_rows` on the tiled kernel, `per_row_rows` on the per-row one."""

    block_table: torch.Tensor
    request: torch.Tensor
    logical: torch.Tensor
    count: torch.Tensor
    kernel: str = "per_row"
    tiled_rows: torch.Tensor | None = None
    per_row_rows: torch.Tensor | None = None
    vllm_rows: torch.Tensor | None = None  # device bool [R] (decode graphs of an engine at p = 1): rows whose request
    # removed no KV entry before this layer take vLLM's own attention (its window over entries is then the window
    # over positions, and its bits standard's)


@dataclass(frozen=True)
class DropPointRecord:
    layer: int
    entering: list[int]  # rows per request entering the drop point
    kept: list[int]  # rows per request kept
    source_rows: torch.Tensor  # device int64: the kept rows as rows of the step's original batch


@dataclass
class DropTotals:
    """Running totals of one runtime (one compiled graph): what dropping did so far."""

    forwards: int = 0  # forwards with attention metadata and requests (not vLLM's dummy runs)
    forwards_without_requests: int = 0  # with attention metadata but no request ids (dummy runs, or an unwrapped runner)
    dropping_forwards: int = 0  # ... in which at least one request dropped
    requests_dropped: int = 0  # requests that went through the drop points (at p = 1 without a row removed, too)
    requests_removing_rows: int = 0  # ... of which at least one prompt row was removed
    rows_in: int = 0  # prompt rows of the dropping requests entering the first drop point
    rows_kept: int = 0  # ... left after the last drop point
    # KV entries the dropping requests' prompts put in the cache, summed over the attention
    # layers: standard vLLM writes every prompt row at every layer (`kv_entries_prompt`); after a
    # drop point a layer writes its kept rows only (`kv_entries_written`). The difference is the
    # KV memory a cache sized by the kept tokens would save; vLLM 0.26 does not reclaim it (one
    # block table per KV-cache group across the depth: docs/vllm.md "KV-cache memory inside vLLM").
    # A sliding-window layer's cache is bounded by its window in either engine.
    kv_entries_prompt: int = 0
    kv_entries_written: int = 0
    decode_graph_captures: int = 0  # forwards vLLM captured as decode CUDA graphs (`graph_decode_point`)
    kernel_warm_ups: int = 0  # score-and-select warm-ups run at a dummy forward (`kernels/warm_up.py`); a count,
    # not seconds, so that every rank's totals stay equal (`ranks_agree`); the seconds are logged

    def add_forward(self, step: "StepDrops", eligible: torch.Tensor, num_layers: int,
                    segment_layers: list[int]) -> bool:
        """Count a forward that reached the last drop point (`eligible`: host bool [R], the
        requests that dropped). True when it is the first forward that dropped anything, which
        the runtime logs (a run can then tell that dropping happened inside the engine)."""
        self.forwards += 1
        if not bool(eligible.any()):
            return False
        rows_in = int(step.base.query_lens_cpu[eligible].sum())
        segment_rows = [rows_in] + [int(lay.query_lens_cpu[eligible].sum()) for lay in step.layouts]
        self.dropping_forwards += 1
        self.requests_dropped += int(eligible.sum())
        last = step.layouts[-1].query_lens_cpu if step.layouts else step.base.query_lens_cpu
        self.requests_removing_rows += int((last[eligible] < step.base.query_lens_cpu[eligible]).sum())
        self.rows_in += rows_in
        self.rows_kept += segment_rows[-1]
        self.kv_entries_prompt += rows_in * num_layers
        self.kv_entries_written += sum(rows * layers for rows, layers in zip(segment_rows, segment_layers))
        return self.dropping_forwards == 1

    @property
    def kv_written_share(self) -> float | None:
        """kv_entries_written / kv_entries_prompt: the share of the prompts' KV still written."""
        return self.kv_entries_written / self.kv_entries_prompt if self.kv_entries_prompt else None


@dataclass
class StepDrops:
    """What one forward's drop points did (for reports and the drop history)."""

    reasons: torch.Tensor | None = None  # host [R] SkipReason per request
    groups: dict[str, int] = field(default_factory=dict)  # layer name -> KV-cache group, as vLLM built them
    base: TokenLayout | None = None  # the batch as vLLM built it
    request_ids: list[str] | None = None
    history_rows: torch.Tensor | None = None  # host [R]: row in the drop-history store (0: none)
    points: list[DropPointRecord] = field(default_factory=list)
    layouts: list[TokenLayout] = field(default_factory=list)  # after each drop point
    right_layout: TokenLayout | None = None  # after the last drop point, right-aligned (sliding layers)
    window_rows: dict[str, WindowRows] = field(default_factory=dict)  # sliding layer name -> its rows
    vllm_windows: set[str] = field(default_factory=set)  # sliding layers after a drop point that removed nothing
    # (nor did any before it, nor does any request hold fewer KV entries): vLLM's own attention, on its metadata
    pending_copies: dict = field(default_factory=dict)  # sliding layer -> (right layout, group, requests, the drop
    # point's plans): context tails `window_attention` copies after the layer's KV update (`window.copy_context_tail`)
    profiling: bool = False  # a forward without attention metadata (vLLM's dummy runs)
    changed: bool = False  # a drop point so far removed a row, or a request holds fewer KV entries after one
    graph_base: dict = field(default_factory=dict)  # layer name -> (vLLM's metadata, slot mapping), in a capture

    @property
    def layout(self) -> TokenLayout | None:
        """The layout the layers after the last drop point run on (None before the first)."""
        return self.layouts[-1] if self.layouts else None
