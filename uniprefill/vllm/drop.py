"""The runtime side of a drop point inside a vLLM forward (stage 2: prefill-only dropping).

`VllmDropRuntime.drop(q, k, layer)` is what the rewritten vLLM graph calls right after the
attention of drop layer `layer` (`uniprefill.vllm.rewrite`). For the step's batch it

1. reads the batch from the forward context: `attn_metadata[name]` of the drop layer gives
   `query_start_loc` / `seq_lens` (one device-to-host copy at the first drop point of the
   step; later drop points reuse the host layout), the per-layer metadata objects give the
   KV-cache groups (vLLM shares one object among a group's layers);
2. picks the requests that may drop (`drop_eligibility`: the rest of the prompt in this step,
   at least `min_tokens` of it; a prompt whose start is already cached, as the last chunk of a
   chunked prefill or after a prefix-cache hit, drops among this step's tokens only, its context
   whole: `vllm_context_drops`); decode tokens and other requests keep every row;
3. scores the eligible requests' last-n queries against their keys and selects blocks
   (`vllm.selection.select_rows` over `kernels.api.score_and_select`, one host sync for the kept counts);
4. compacts the layout (`compact`) and points every LATER layer of the forward context at it
   (`install_layer_metadata`: compacted `query_start_loc`, `seq_lens`, maxima, token count and
   slot mappings, one metadata object per layer; Gated DeltaNet layers get vLLM's own builder's metadata
   for the kept rows, `vllm.gdn_metadata`);
5. returns the kept rows (indices into the rows entering the drop point), which the graph
   uses to gather the residual stream, the attention output and `positions`.

It never imports vLLM: the forward context comes from `context_fn` (in vLLM,
`vllm.forward_context.get_forward_context`), and each layer's KV block size from
`block_size_fn(layer_name)`. Per-step state (the current layout) lives in this object,
which belongs to one compiled graph; `begin_step()` resets it (the graph calls it first).
Sliding-window layers after a drop (`windows`): their KV is stored right-aligned and their
attention runs `window_attention` (a window over ORIGINAL positions, `vllm.window`)
instead of vLLM's FlashAttention, whose uniform window counts cache entries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from uniprefill.config import UniPrefillConfig

from . import gdn_metadata
from .layout import KVCacheGroup, TokenLayout, batch_layout, compact, install_layer_metadata
from .selection import select_rows
from .metadata import DropHistoryStore, SkipReason, drop_eligibility

from .graph_decode import DecodeTables, _capturing_full_graph, _piecewise_graph_step, graph_decode_point

from .window import keep_whole_where_the_tail_does_not_fit, kernel_plan, window_attention_step, window_counts
from .drop_records import (  # noqa: F401  (re-exported: the plugin and tests use them from here)
    DropPointRecord, DropTotals, StepDrops, WindowLayer, WindowRows,
)

logger = logging.getLogger(__name__)
# Forwards with metadata but no request ids that pass silently before a runtime that has seen
# no real step warns (vLLM's profiling, warm-up and capture runs are a handful).
_SILENT_DUMMY_RUNS = 64


class VllmDropRuntime:
    """Drop points of one vLLM backbone graph (see the module docstring)."""

    def __init__(self, config: UniPrefillConfig, layer_names: Sequence[str], drop_layers: Sequence[int],
                 context_fn: Callable[[], Any], block_size_fn: Callable[[str], int], *,
                 num_prompt_tokens_fn: Callable[[], torch.Tensor | None] | None = None,
                 request_ids_fn: Callable[[], Sequence[str]] | None = None,
                 opted_out_fn: Callable[[], torch.Tensor | None] | None = None,
                 request_p_fn: Callable[[], torch.Tensor | None] | None = None,
                 group=None, windows: dict[str, int] | None = None,
                 window_layer_fn: Callable[[str], WindowLayer] | None = None,
                 graph_decode_max_reqs: int = 0, warm_up_max_seqlen: int = 0,
                 warm_up_fn: Callable[..., Any] | None = None, linear_layers: dict[str, int] | None = None) -> None:
        """layer_names: attention layer names in graph order (index = position in the list).
        drop_layers: the drop layers (indices into layer_names), in order.
        num_prompt_tokens_fn: host [R] prompt lengths of the step's requests, or None when the
            engine never splits a prompt (chunked prefill off): then a request with no cached
            context is taken to hold its whole prompt.
        request_ids_fn: the step's request ids, in batch order. With it, the requests that drop
            get a drop history (`DropHistoryStore`, `free` it when a request finishes), and
            their later steps (decode) see, at every layer after a drop point, only the KV
            entries that layer holds. Without it nothing is remembered: only prefill-only
            use (e.g. scoring) is correct.
        opted_out_fn: host bool [R] of the step's requests that must keep every row (prompt
            logprobs, a per-request opt-out), or None when none does.
        request_p_fn: host float32 [R], each request's own top-p (NaN: `config.p`), or None
            when no request has one; not used where the config forces a keep ratio.
        group: the tensor-parallel process group (block scores are summed across it).
        windows: sliding-window layer name -> window (tokens), for the sliding layers that run
            after a drop point; `window_layer_fn(name)` gives each one's `WindowLayer`.
        graph_decode_max_reqs: > 0 when vLLM captures decode steps in CUDA graphs
            (`cudagraph_mode=FULL_DECODE_ONLY`): vLLM's `max_num_seqs`, the size of the table of
            removed KV entries the graphs read (`vllm.graph_decode`); 0 for eager decode.
        warm_up_max_seqlen: > 0 (vLLM's `max_model_len`; the backend passes it on CUDA): at the
            first forward without requests (vLLM's profiling run) compile the score-and-select
            kernels' variants for prompts up to this length (`warm_up_fn`, default
            `kernels.warm_up.warm_up_score_and_select`), so that the first real steps do not.
        linear_layers: Gated DeltaNet layer name -> attention layers before it (it runs after the drop points
            at positions below that): their metadata is rebuilt for the kept rows (`vllm.gdn_metadata`)."""
        if config.policy != "cumulative":
            raise NotImplementedError(f"policy {config.policy!r}: the vLLM runtime drops cumulatively only")
        self.config = config
        self.layer_names = list(layer_names)
        self.drop_layers = list(drop_layers)
        self.context_fn = context_fn
        self.block_size_fn = block_size_fn
        self.num_prompt_tokens_fn = num_prompt_tokens_fn or (lambda: None)
        self.request_ids_fn = request_ids_fn
        self.opted_out_fn = opted_out_fn or (lambda: None)
        self.request_p_fn = request_p_fn or (lambda: None)
        self.group = group
        self.windows = dict(windows or {})
        if self.windows and window_layer_fn is None:
            raise ValueError("windows: sliding layers after a drop need window_layer_fn (their caches and scale)")
        self.window_layer_fn = window_layer_fn
        if any(self.layer_names[d] in self.windows for d in self.drop_layers):
            raise ValueError(f"drop layers {list(self.drop_layers)}: a drop point must be a full-attention layer")
        self.max_window = max(self.windows.values(), default=0)
        self.graph_decode = None
        if graph_decode_max_reqs:
            self.graph_decode = DecodeTables(len(self.drop_layers), graph_decode_max_reqs, self.max_window)
        self.linear_layers = dict(linear_layers or {})
        self.warm_up_max_seqlen = warm_up_max_seqlen
        self.warm_up_fn = warm_up_fn
        self.vllm_attention: dict[int, Callable] = {}  # layer -> vLLM's attention op the rewrite replaced
        self.store = DropHistoryStore(tuple(self.drop_layers), len(self.layer_names), "cumulative",
                                      max_window=self.max_window)
        self.step = StepDrops()
        self.totals = DropTotals()
        self._static_rows: torch.Tensor | None = None  # `_all_rows`
        self.windows_warmed: set[str] = set()  # sliding layers whose window kernel ran (`window_attention`)
        self.row_kernels_warmed = False  # `_warm_up_row_kernels` ran
        self._retired_rows: list[torch.Tensor] = []
        # Attention layers per segment: segment i holds the rows kept after i drop points (the
        # store's `layer_column`; a drop layer's own attention, and so its KV, comes before its drop).
        self.segment_layers = torch.bincount(self.store.layer_column, minlength=len(self.drop_layers) + 1).tolist()

    def begin_step(self) -> None:
        self.step = StepDrops()

    def before_step(self, request_ids: Sequence[str], full_graph: bool = True) -> None:
        """Called by the model-runner hook before each step's forward (or graph replay): under
        CUDA-graph decoding, refill the removed-KV table the graphs read, in batch order, when the step
        replays a FULL graph (`full_graph`; eager and piecewise steps read the histories on the host, and
        `fill` skips nothing it needs: the next FULL step finds the tables stale and refills them)."""
        if self.graph_decode is not None and full_graph:
            self.graph_decode.fill(self.store, tuple(request_ids))

    # ------------------------------------------------------------------ the drop point
    def drop(self, q: torch.Tensor, k: torch.Tensor, layer: int) -> torch.Tensor:
        """Kept rows (int64, device) of the rows entering drop layer `layer` (see module docstring)."""
        context = self.context_fn()
        if self.graph_decode is not None:
            if _capturing_full_graph(context):
                return self._graph_decode_point(context, q, layer)
            self.graph_decode.on(q.device)  # allocated outside any capture: a zero-fill captured in a graph would replay
            if self._static_rows is None:  # the row numbers decode graphs return (`graph_decode_point`), made outside
                self._all_rows(q)  # any capture (vLLM's profiling forward: its largest step, at least 8192 rows)
        if _piecewise_graph_step(context):
            # vLLM's mode 3 replays (or captures) the pieces after this point for the step's padded row
            # count, reading this op's output at the address it had at capture: nothing drops, the later
            # layers still get their metadata (requests that dropped earlier hold fewer KV entries there)
            # and the rows come from one persistent tensor
            self._drop(context, q, k, layer, keep_all=True)
            return self._all_rows(q)
        return self._drop(context, q, k, layer)

    def _all_rows(self, q: torch.Tensor) -> torch.Tensor:
        """`arange(rows of q)` as a view of one tensor kept for the runtime's life (a larger one
        replaces it, and the old one stays alive: a captured graph may read it)."""
        rows = self._static_rows
        if rows is None or rows.numel() < q.shape[0] or rows.device != q.device:
            if rows is not None:
                self._retired_rows.append(rows)
            rows = self._static_rows = torch.arange(max(q.shape[0], 8192), device=q.device)
        return rows[:q.shape[0]]

    def _drop(self, context, q: torch.Tensor, k: torch.Tensor, layer: int, keep_all: bool = False) -> torch.Tensor:
        name = self.layer_names[layer]
        drop_index = self.drop_layers.index(layer)
        metadata = getattr(context, "attn_metadata", None)
        ids = self.request_ids_fn() if self.request_ids_fn is not None and self.step.layout is None else ()
        if self.step.profiling or not isinstance(metadata, dict) or name not in metadata or ids is None:
            # vLLM's profiling and warm-up runs (`_dummy_run`) carry no attention metadata, or
            # no requests: nothing to drop, every row goes on (as vLLM's attention then writes zeros)
            if not self.step.profiling and ids is None and isinstance(metadata, dict) and name in metadata:
                self._note_forward_without_requests()
            if not _capturing_full_graph(context):
                if self.warm_up_max_seqlen and not self.totals.kernel_warm_ups:
                    self._warm_up_kernels(q, k, drop_index)
                if not self.row_kernels_warmed:  # whatever `warm_up_max_seqlen`: the decode graphs launch them
                    self._warm_up_row_kernels(q.device)
            self.step.profiling = True
            return torch.arange(q.shape[0], device=q.device)
        if self.step.layout is None:
            self.step.groups = self._groups(context)  # before any drop point splits them per layer
            layout = self.step.base = self._base_layout(context, name, self.step.groups)
            self.step.reasons = self._reasons(layout)
            if keep_all:
                eligible = self.step.reasons == SkipReason.ELIGIBLE
                self.step.reasons[eligible] = SkipReason.CUDA_GRAPH
            if self.request_ids_fn is not None:
                self.step.request_ids = list(ids)
                self.step.history_rows = self._live_history_rows(self.step.request_ids, layout)
        else:
            layout = self.step.layout
        eligible = self.step.reasons == SkipReason.ELIGIBLE
        if not bool(eligible.any()):
            kept = torch.arange(layout.num_actual_tokens, device=q.device)
            counts = layout.query_lens_cpu.clone()
        else:
            kept, counts = select_rows(self.config, q, k, layout, eligible, drop_index, len(self.drop_layers),
                                       self._p_of, self.group)
            if self.windows and drop_index == 0:  # later points keep fewer rows: their gaps are larger
                kept, counts, refused = keep_whole_where_the_tail_does_not_fit(layout, kept, counts, eligible,
                                                                               self.max_window)
                self.step.reasons[refused] = SkipReason.CONTEXT_TAIL
                eligible = eligible & ~refused
        removed = None  # KV entries the layers after this drop point hold fewer than vLLM counts
        if self.step.history_rows is not None:
            removed = self.store.kv_removed(self.step.history_rows, drop_index + 1)
        groups = self.step.groups
        later = [n for n in self.layer_names[layer + 1:] if n in groups]
        out = compact(layout, kept, counts, kv_removed_cpu=removed,  # slots of the full layers' groups only
                      slot_groups={groups[n] for n in later if n not in self.windows})
        self.step.changed = (self.step.changed or bool((counts != layout.query_lens_cpu).any())
                             or (removed is not None and bool(removed.any())))
        if self.step.changed:  # else the later layers see vLLM's own batch: its metadata (FA3's plan included) stays
            install_layer_metadata(context.attn_metadata, context.slot_mapping,
                                   {n: groups[n] for n in later if n not in self.windows}, out)
        linear = [n for n, before in self.linear_layers.items() if before > layer]
        if linear and bool((out.query_lens_cpu != self.step.base.query_lens_cpu).any()):
            gdn_metadata.install_rows(context.attn_metadata, linear, out.query_start_loc, out.query_start_loc_cpu,
                                      out.max_query_len)
        sliding = [n for n in later if n in self.windows]
        if sliding and self.step.changed:
            self._install_windows(context, kept, counts, eligible, layer, sliding)
            self.step.vllm_windows.difference_update(sliding)
        elif sliding:  # nothing removed so far: vLLM's layout, metadata and attention are exact (p = 1: its bits)
            self.step.vllm_windows.update(sliding)
        self.step.points.append(DropPointRecord(layer, layout.query_lens_cpu.tolist(), counts.tolist(),
                                                out.source_index))
        self.step.layouts.append(out)
        if drop_index == len(self.drop_layers) - 1 and self.step.request_ids is not None and bool(eligible.any()):
            self.store.record_step(self.step.request_ids, self.step.base, self.step.layouts, eligible)
        if drop_index == len(self.drop_layers) - 1:
            if self.totals.add_forward(self.step, eligible, len(self.layer_names), self.segment_layers):
                logger.warning("uniprefill: first token drop in this engine: %d of %d requests dropped, their %d "
                               "prompt rows -> %d after %s", int(eligible.sum()), self.step.base.num_reqs,
                               self.totals.rows_in, self.totals.rows_kept,
                               [self.layer_names[p] for p in self.drop_layers])
        return kept

    def _graph_decode_point(self, context, q: torch.Tensor, layer: int) -> torch.Tensor:
        return graph_decode_point(self, context, q, layer)  # `vllm.graph_decode`; a method, for tests to watch

    def _live_history_rows(self, request_ids: list[str], layout: TokenLayout) -> torch.Tensor:
        """Store rows of the step's requests; a request that prefills from position 0 although
        it has a history (vLLM preempted it, freed its KV and now recomputes it, or reused its
        id) loses that history first: its KV is about to be written anew."""
        rows = self.store.rows_for(request_ids)
        stale = (rows > 0) & (layout.num_computed_tokens_cpu == 0)
        if bool(stale.any()):
            for r in torch.nonzero(stale).flatten().tolist():
                self.store.free(request_ids[r])
            rows = torch.where(stale, torch.zeros_like(rows), rows)
        return rows

    def _p_of(self, chosen: torch.Tensor) -> float | torch.Tensor:
        """The top-p of the chosen requests: `config.p`, or a host tensor when one of them has
        its own (`request_p_fn`)."""
        own = self.request_p_fn()
        if own is None:
            return self.config.p
        p = torch.where(torch.isnan(own[chosen]), torch.tensor(self.config.p, dtype=torch.float32), own[chosen])
        return self.config.p if bool((p == self.config.p).all()) else p

    def _warm_up_kernels(self, q: torch.Tensor, k: torch.Tensor, drop_index: int) -> None:
        """Compile the score-and-select kernels for this drop point's head shapes, once, at a
        dummy forward (measured on the H200: 14 compiles, 0.9-6.6 s each step that met one,
        moved to the engine's start; docs/benchmarks.md)."""
        if self.warm_up_fn is None:
            from uniprefill.kernels.warm_up import warm_up_score_and_select as warm_up_fn
        else:
            warm_up_fn = self.warm_up_fn
        cfg = self.config
        ran = warm_up_fn(num_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2], dtype=q.dtype,
                         device=q.device, block_size=cfg.block_size, sink=cfg.sink, last_q=cfg.last_q,
                         min_tokens=cfg.effective_min_tokens, max_seqlen=self.warm_up_max_seqlen, p=cfg.p,
                         keep_ratio=cfg.keep_ratio_at(drop_index, len(self.drop_layers)), impl=cfg.impl,
                         selection=cfg.selection, per_sequence_sink=True)  # as `selection.select_rows` passes sinks
        self.totals.kernel_warm_ups += 1
        logger.info("uniprefill: compiled the score-and-select kernels before serving (prompts up to %d tokens): "
                    "%s", self.warm_up_max_seqlen, ran)

    def _warm_up_row_kernels(self, device: torch.device) -> None:
        """Compile the layouts' and the decode graphs' row kernels (`kernels.layout_rows`) at the first dummy forward,
        never inside a capture (vLLM captures its decode graphs after dummy forwards, and the capture path launches
        two of them), and check each against its reference on this device (a disagreement raises)."""
        from uniprefill.kernels.layout_rows import warm_up as warm_up_layout_rows

        ran = warm_up_layout_rows(device, self.config.impl)
        self.row_kernels_warmed = True
        if ran:
            logger.info("uniprefill: compiled the row-layout kernels before serving: %d launches, each equal to its "
                        "reference", ran)

    def _note_forward_without_requests(self) -> None:
        """A forward with attention metadata but no request ids is a dummy run, or a model
        runner the hook does not wrap; many of them and no real step means the latter (the
        H200 run of 2026-12-01 met vLLM's runner V2 this way): say so once, nothing drops."""
        totals = self.totals
        totals.forwards_without_requests += 1
        if totals.forwards_without_requests == _SILENT_DUMMY_RUNS and totals.forwards == 0:
            logger.warning("uniprefill: %d forwards carried attention metadata but no request ids and none had "
                           "them: vLLM's model runner is not one uniprefill wraps (uniprefill.vllm.runner_hook), so nothing "
                           "drops", totals.forwards_without_requests)

    def _install_windows(self, context, kept: torch.Tensor, counts: torch.Tensor, eligible: torch.Tensor,
                         layer: int, names: list[str]) -> None:
        """Right-aligned layout, slot mappings and visible counts of the sliding layers after `layer`."""
        entering = self.step.right_layout or self.step.base
        groups = self.step.groups
        right = self.step.right_layout = compact(entering, kept, counts, align="right",
                                                 slot_groups={groups[n] for n in names})
        install_layer_metadata(context.attn_metadata, context.slot_mapping, {n: groups[n] for n in names}, right)
        with_context = torch.nonzero(eligible & (right.num_computed_tokens_cpu > 0)).flatten().tolist()
        if with_context:  # close the gap below their kept rows in the layers up to the next drop point, each in
            # its `window_attention`: after its KV update, since a context block may be written in this very forward
            # (a prefix-cache hit on blocks another request of the step publishes as it is scheduled)
            following = next((d for d in self.drop_layers if d > layer), len(self.layer_names))
            plans: dict = {}  # this drop point's copy positions per window and slots per (group, window)
            for name in names:
                if self.layer_names.index(name) < following:
                    self.step.pending_copies[name] = (right, groups[name], with_context, plans)
        request, logical = right.row_request, right.row_logical
        plan = kernel_plan(right)  # which window kernel runs which rows, for all the sliding layers
        by_window = {}
        for name in names:
            window = self.windows[name]
            if window not in by_window:
                by_window[window] = window_counts(right, window, eligible, self.store, self.step.history_rows,
                                                  layer + 1)
            self.step.window_rows[name] = WindowRows(right.block_tables[groups[name]], request, logical,
                                                     by_window[window], *plan)

    def window_attention(self, args: tuple, kwargs: dict, layer: int) -> None:
        """What the rewritten graph runs instead of vLLM's attention op for a sliding layer after a drop point
        (`window.window_attention_step`: the window over original positions, into the output argument)."""
        window_attention_step(self, args, kwargs, layer)

    def free(self, request_id: str) -> bool:
        """Forget a finished request's drop history (False if it had none)."""
        return self.store.free(request_id)

    def _groups(self, context) -> dict[str, int]:
        """Layer name -> KV-cache group index: layers that share one metadata object."""
        order: dict[int, int] = {}
        out = {}
        for name in self.layer_names:
            meta = context.attn_metadata.get(name)
            if meta is not None:
                out[name] = order.setdefault(id(meta), len(order))
        return out

    def _base_layout(self, context, name: str, groups: dict[str, int]) -> TokenLayout:
        meta = context.attn_metadata[name]
        host = torch.cat([meta.query_start_loc.long(), meta.seq_lens.long()]).cpu()  # the step's one D2H copy here
        num_reqs = meta.seq_lens.numel()
        qsl_cpu, seq_lens_cpu = host[:num_reqs + 1], host[num_reqs + 1:]
        qsl_np = qsl_cpu.numpy()
        ctx = torch.from_numpy(seq_lens_cpu.numpy() - (qsl_np[1:] - qsl_np[:-1]))
        first_layer = {}  # group -> its first layer, whose metadata stands for the group
        for layer_name, group in groups.items():
            first_layer.setdefault(group, layer_name)
        kv_groups = []
        for group in sorted(first_layer):
            layer_name = first_layer[group]
            group_meta = context.attn_metadata[layer_name]
            kv_groups.append(KVCacheGroup(group_meta.block_table, self.block_size_fn(layer_name),
                                          group_meta.slot_mapping))
        return batch_layout(meta.query_start_loc, qsl_cpu, meta.seq_lens, ctx, kv_groups, impl=self.config.impl)

    def _reasons(self, layout: TokenLayout) -> torch.Tensor:
        qlen, ctx = layout.query_lens_cpu, layout.num_computed_tokens_cpu
        prompt = self.num_prompt_tokens_fn()
        if prompt is None:  # no chunking: a request without context holds its whole prompt
            prompt = torch.where(ctx == 0, qlen, ctx)
        # a prompt whose start is cached drops among this step's tokens (`vllm_context_drops`); sliding
        # layers after a drop see its context through `window.copy_context_tail`
        return drop_eligibility(qlen, ctx, prompt, self.config.effective_min_tokens,
                                allow_context=self.config.vllm_context_drops,
                                opted_out_cpu=self.opted_out_fn())
