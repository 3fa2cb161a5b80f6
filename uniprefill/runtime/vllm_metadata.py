"""Attention metadata for the layers after a drop point in vLLM, and the per-request drop history.

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

Decode. `DropHistoryStore` keeps one `RequestDropHistory` per request that dropped, plus dense
host tables indexed by a store row (row 0 = "no history"), so that a decode step is a few
vectorised tensor ops per distinct layer group ("column"), never a Python loop over requests:
`layer_kv_lens`, `relayout_kv` per column, `window_first_visible`. Python loops over requests
happen only when a prefill step's histories are recorded (`record_step`) and in `rows_for`
(one dict lookup per request, done when the batch's membership changes).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

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
    slot_mappings: tuple[torch.Tensor, ...]  # per KV-cache group, [T] int64
    positions: torch.Tensor  # [T] int64, device: ORIGINAL position of each row
    source_index: torch.Tensor  # [T] int64, device: row in the step's original batch
    source_size: int  # rows of the step's original batch
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.numel()

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def logits_indices(self) -> torch.Tensor:
        """Row of each request's last token in this layout (vLLM's `query_start_loc[1:] - 1`)."""
        return self.query_start_loc[1:].long() - 1

    def rows_of_source(self, source_rows: torch.Tensor) -> torch.Tensor:
        """Rows here of the given rows of the original batch; -1 where one was dropped."""
        inverse = torch.full((self.source_size,), -1, dtype=torch.long, device=self.source_index.device)
        inverse[self.source_index] = torch.arange(self.num_actual_tokens, device=inverse.device)
        return inverse[source_rows.long()]

    @property
    def kv_base_cpu(self) -> torch.Tensor:
        """Host [R]: KV entries these layers hold for each request before this step's tokens."""
        return self.num_computed_tokens_cpu - self.kv_removed_cpu

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
            "slot_mapping": self.slot_mappings[group],
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
            "slot_mapping": self.slot_mappings[group],
        }


def install_layer_metadata(attn_metadata: dict, slot_mapping: dict, layers: dict[str, int],
                           layout: TokenLayout) -> None:
    """Point the given layers of one vLLM forward context at `layout` (the layers after a drop).

    attn_metadata, slot_mapping: the forward context's dicts keyed by layer name (vLLM shares
        one metadata object among the layers of a KV-cache group; a group spans layers before
        and after a drop, so each layer named here gets its own copy).
    layers: layer name -> index of its KV-cache group in `layout`.
    FA3's ahead-of-time scheduler metadata (planned for the uncompacted batch; vLLM 0.26 plans
    it whenever FA3 runs and the model has at most one sliding-window size, e.g. Llama) is
    cleared: `flash_attn_varlen_func` then schedules the compacted batch itself.
    Cascade attention (shared-prefix metadata, also computed for the uncompacted batch) raises.
    """
    import dataclasses

    for name, group in layers.items():
        if name not in attn_metadata:
            raise KeyError(f"no attention metadata for layer {name!r} in this forward context")
        meta = attn_metadata[name]
        if getattr(meta, "use_cascade", False):
            raise NotImplementedError(f"{name}: cascade attention (shared-prefix metadata) after a drop")
        fields = layout.flash_attention_fields(group)
        if getattr(meta, "scheduler_metadata", None) is not None:
            fields["scheduler_metadata"] = None
        missing = sorted(set(fields) - {f.name for f in dataclasses.fields(meta)})
        if missing:
            raise TypeError(f"{name}: {type(meta).__name__} has no field(s) {missing}")
        attn_metadata[name] = dataclasses.replace(meta, **fields)
        slot_mapping[name] = fields["slot_mapping"]


def batch_layout(
    query_start_loc: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    seq_lens: torch.Tensor,
    num_computed_tokens_cpu: torch.Tensor,
    groups: Sequence[KVCacheGroup],
    positions: torch.Tensor | None = None,
    validate: Validate = "shapes",
) -> TokenLayout:
    """The layout vLLM built for this step (before any drop point)."""
    qsl_cpu = _host_int("query_start_loc_cpu", query_start_loc_cpu, 1)
    num_reqs = qsl_cpu.numel() - 1
    if num_reqs < 0 or int(qsl_cpu[0]) != 0:
        raise ValueError(f"query_start_loc_cpu must start at 0 and have R + 1 entries; got {qsl_cpu.tolist()[:8]}")
    query_lens = qsl_cpu[1:] - qsl_cpu[:-1]
    if (query_lens < 0).any():
        raise ValueError(f"query_start_loc_cpu must not decrease; query lengths are {query_lens.tolist()}")
    _check_shape("query_start_loc", query_start_loc, (num_reqs + 1,))
    _check_shape("seq_lens", seq_lens, (num_reqs,))
    ctx = _host_int("num_computed_tokens_cpu", num_computed_tokens_cpu, 1)
    _check_shape("num_computed_tokens_cpu", ctx, (num_reqs,))
    if (ctx < 0).any():
        raise ValueError(f"num_computed_tokens_cpu must be >= 0; got {ctx.tolist()}")
    if not groups:
        raise ValueError("groups: expected at least one KV-cache group, got none")
    tokens = int(qsl_cpu[-1])
    device = query_start_loc.device
    for g, group in enumerate(groups):
        _check_group(g, group, num_reqs, tokens)
    if positions is None:
        request = _request_of_rows(query_lens, tokens, device)
        positions = ctx.to(device, non_blocking=True)[request] + (
            torch.arange(tokens, device=device) - query_start_loc.long()[request])
    else:
        if positions.dim() != 1 or positions.shape[0] < tokens:
            raise ValueError(f"positions: expected shape ({tokens},) (one per token, 1-D), got {tuple(positions.shape)}")
        positions = positions[:tokens].long()
    layout = TokenLayout(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens,
        seq_lens_cpu=ctx + query_lens,
        num_computed_tokens_cpu=ctx,
        kv_removed_cpu=torch.zeros(num_reqs, dtype=torch.long),
        block_tables=tuple(g.block_table for g in groups),
        block_sizes=tuple(int(g.block_size) for g in groups),
        slot_mappings=tuple(g.slot_mapping[:tokens].long() for g in groups),
        positions=positions,
        source_index=torch.arange(tokens, device=device),
        source_size=tokens,
        num_actual_tokens=tokens,
        max_query_len=int(query_lens.max()) if num_reqs else 0,
        max_seq_len=int((ctx + query_lens).max()) if num_reqs else 0,
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
) -> TokenLayout:
    """The layout of the layers after a drop point that keeps rows `kept` of `layout`.

    kept: sorted int indices into `layout`'s rows (device), or None to keep every row (then
        only `kv_removed_cpu` changes: see `relayout_kv`).
    kept_counts_cpu: host int [R], kept rows per request (ignored when `kept` is None).
    kv_removed_cpu: host int [R], KV entries these layers hold fewer than vLLM counts for each
        request because of EARLIER steps' drops (from `DropHistoryStore.kv_removed`); default:
        the input layout's.
    align: "left" (full-attention layers) puts request r's kept rows at logical indices
        `ctx_r - kv_removed_r + i`; "right" (sliding-window layers, `runtime.vllm_window`) puts
        them at the END of the span the entering rows had, `kv_base_r + (entering_r - kept_r) + i`,
        and records the gap as a negative `kv_removed` (kv_base grows by it): the last kept row
        keeps its logical index, and later decode tokens need no shift. `kv_removed_cpu` must
        be None with "right".
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
        if kept.dim() != 1 or kept.numel() != int(counts.sum()):
            raise ValueError(f"kept: expected a 1-D tensor of sum(kept_counts_cpu) = {int(counts.sum())} "
                             f"indices, got shape {tuple(kept.shape)}")
        _check_counts(counts, query_lens)
    ctx = layout.num_computed_tokens_cpu
    if align == "right":
        if kv_removed_cpu is not None:
            raise ValueError("kv_removed_cpu: right-aligned layouts shift nothing for earlier steps; pass None")
        removed = layout.kv_removed_cpu - (query_lens - counts)  # a gap before the kept rows
    elif align == "left":
        removed = layout.kv_removed_cpu if kv_removed_cpu is None else _host_int("kv_removed_cpu", kv_removed_cpu, 1)
    else:
        raise ValueError(f"align={align!r} is not one of ('left', 'right')")
    _check_shape("kv_removed_cpu", removed, (num_reqs,))
    if align == "left" and ((removed < 0) | (removed > ctx)).any():
        raise ValueError(f"kv_removed_cpu must lie in [0, num_computed_tokens]; got {removed.tolist()} "
                         f"for num_computed_tokens {ctx.tolist()}")
    if kept is not None and validate == "full":
        _check_kept_contents(layout, kept, counts)

    device = layout.query_start_loc.device
    qsl_cpu = torch.zeros(num_reqs + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=qsl_cpu[1:])
    tokens = int(qsl_cpu[-1])
    kv_base = ctx - removed  # KV entries before this step's first kept token
    seq_lens_cpu = kv_base + counts
    for g, (table, block) in enumerate(zip(layout.block_tables, layout.block_sizes)):
        _check_blocks(g, table, block, kv_base, counts)

    qsl = qsl_cpu.to(device, layout.query_start_loc.dtype, non_blocking=True)
    request = _request_of_rows(counts, tokens, device)
    logical = kv_base.to(device, non_blocking=True)[request] + (torch.arange(tokens, device=device) - qsl.long()[request])
    slots = tuple(_slots(table, block, request, logical) for table, block in zip(layout.block_tables, layout.block_sizes))
    if kept is None:
        positions, source = layout.positions, layout.source_index
    else:
        kept = kept.long()
        positions, source = layout.positions[kept], layout.source_index[kept]
    return TokenLayout(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens_cpu.to(device, layout.seq_lens.dtype, non_blocking=True),
        seq_lens_cpu=seq_lens_cpu,
        num_computed_tokens_cpu=ctx,
        kv_removed_cpu=removed,
        block_tables=layout.block_tables,
        block_sizes=layout.block_sizes,
        slot_mappings=slots,
        positions=positions,
        source_index=source,
        source_size=layout.source_size,
        num_actual_tokens=tokens,
        max_query_len=int(counts.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens_cpu.max()) if num_reqs else 0,
    )


def relayout_kv(layout: TokenLayout, kv_removed_cpu: torch.Tensor) -> TokenLayout:
    """Same rows, KV shifted for requests whose earlier prefill dropped (decode steps)."""
    return compact(layout, None, None, kv_removed_cpu=kv_removed_cpu)


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.long)
    torch.cumsum(lens, 0, out=out[1:])
    return out


def _ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Concatenated [start, start + len) ranges, host int64, without a Python loop."""
    total = int(lens.sum())
    shift = torch.repeat_interleave(starts - _offsets(lens)[:-1], lens, output_size=total)
    return shift + torch.arange(total)


def _request_of_rows(counts_cpu: torch.Tensor, tokens: int, device) -> torch.Tensor:
    requests = torch.arange(counts_cpu.numel(), device=device)
    return torch.repeat_interleave(requests, counts_cpu.to(device, non_blocking=True), output_size=tokens)


def _slots(table: torch.Tensor, block: int, request: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
    return table[request, logical // block].long() * block + logical % block


# ----------------------------------------------------------------------------- eligibility
class SkipReason(enum.IntEnum):
    """Why a request of a step does not drop (0: it may)."""

    ELIGIBLE = 0
    DECODE = 1  # its prompt is already in the cache: a decode (or spec-decode) step
    PARTIAL_CHUNK = 2  # chunked prefill, not at its last chunk
    HAS_CONTEXT = 3  # prefix-cached, or the last chunk of a chunked prefill
    SHORT = 4  # fewer tokens than min_tokens
    OPTED_OUT = 5  # asked for prompt logprobs (every prompt row reaches the logits), or opted out


def drop_eligibility(
    query_lens_cpu: torch.Tensor,
    num_computed_tokens_cpu: torch.Tensor,
    num_prompt_tokens_cpu: torch.Tensor,
    min_tokens: int,
    allow_context: bool = False,
    opted_out_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """Host int tensor [R] of `SkipReason` values; vectorised, no loop over requests.

    Stage-2 rule: a request drops only when its whole prompt is in this step with nothing
    cached before it. `allow_context=True` also lets the last chunk of a chunked prefill (or
    a prefix-cached prompt) drop; its context stays whole, only this step's tokens can go.
    `opted_out_cpu` (host bool [R]): requests that must keep every row (prompt logprobs are
    read at every prompt position; a per-request opt-out).
    """
    qlen = _host_int("query_lens_cpu", query_lens_cpu, 1)
    ctx = _host_int("num_computed_tokens_cpu", num_computed_tokens_cpu, 1)
    prompt = _host_int("num_prompt_tokens_cpu", num_prompt_tokens_cpu, 1)
    _check_shape("num_computed_tokens_cpu", ctx, tuple(qlen.shape))
    _check_shape("num_prompt_tokens_cpu", prompt, tuple(qlen.shape))
    reason = torch.full_like(qlen, SkipReason.ELIGIBLE)
    reason = torch.where(qlen < min_tokens, SkipReason.SHORT, reason)
    if not allow_context:
        reason = torch.where(ctx > 0, SkipReason.HAS_CONTEXT, reason)
    if opted_out_cpu is not None:
        _check_shape("opted_out_cpu", opted_out_cpu, tuple(qlen.shape))
        reason = torch.where(opted_out_cpu.to(torch.bool), SkipReason.OPTED_OUT, reason)
    reason = torch.where(ctx + qlen < prompt, SkipReason.PARTIAL_CHUNK, reason)
    return torch.where(ctx >= prompt, SkipReason.DECODE, reason)


# ----------------------------------------------------------------------------- windows
def window_visibility(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Bool [..., Q, K]: key visible to query when 0 <= pos_q - pos_k < window (ORIGINAL positions).

    window 0 means full causal attention. After a drop the keys of a sliding-window layer are
    no longer one per position, so a window over cache indices would reach further back than
    `window` positions; this is the rule the layers must follow instead.
    """
    distance = query_positions.unsqueeze(-1) - key_positions.unsqueeze(-2)
    visible = distance >= 0
    return visible & (distance < window) if window > 0 else visible


def layer_sources(drop_layers: Sequence[int], num_layers: int, policy: str = "cumulative") -> list[int]:
    """For each layer, the drop point whose kept tokens its attention (and KV) holds; -1 for all.

    A drop layer's own attention runs on everything entering it; the drop takes effect from
    the next layer. Under "suspend" a later drop layer runs on all tokens again.
    """
    if policy not in ("cumulative", "suspend"):
        raise ValueError(f"policy={policy!r} is not one of ('cumulative', 'suspend')")
    layers = list(drop_layers)
    if layers != sorted(set(layers)) or (layers and (layers[0] < 0 or layers[-1] >= num_layers)):
        raise ValueError(f"drop_layers={layers} must be increasing layer indices in [0, {num_layers})")
    sources = []
    for layer in range(num_layers):
        before = sum(1 for d in layers if d < layer)
        sources.append(-1 if policy == "suspend" and layer in layers else before - 1)
    return sources


# ----------------------------------------------------------------------------- history
@dataclass(frozen=True, eq=False)
class DropRecord:
    layer: int  # the drop layer (its own attention ran on everything entering it)
    kept_len: int  # tokens of the dropping step kept
    kept_positions: torch.Tensor  # [kept_len] ORIGINAL positions, increasing


@dataclass(frozen=True, eq=False)
class RequestDropHistory:
    """What one request's prefill dropped; the layers' KV follows from it at every decode step."""

    request_id: str
    context_len: int  # KV entries cached before the dropping step; never dropped
    prompt_len: int  # tokens of the dropping step (orig_len)
    drops: tuple[DropRecord, ...]
    policy: str = "cumulative"

    @property
    def lengths(self) -> list[tuple[int, int]]:
        """[(0, orig_len), (drop layer, kept_len), ...]; layer l uses the last entry whose layer < l."""
        return [(0, self.prompt_len)] + [(d.layer, d.kept_len) for d in self.drops]

    @property
    def prompt_end(self) -> int:
        return self.context_len + self.prompt_len

    def source(self, layer: int) -> int:
        """Index of the drop whose kept tokens `layer` holds; -1 for all (same rule as `layer_sources`)."""
        before = [k for k, d in enumerate(self.drops) if d.layer < layer]
        if not before or (self.policy == "suspend" and any(d.layer == layer for d in self.drops)):
            return -1
        return before[-1]

    def kv_len(self, layer: int, decoded: int) -> int:
        """KV entries `layer` holds after `decoded` decode tokens were written."""
        src = self.source(layer)
        kept = self.prompt_len if src < 0 else self.drops[src].kept_len
        return self.context_len + kept + decoded

    def key_positions(self, layer: int, decoded: int) -> torch.Tensor:
        """ORIGINAL positions of `layer`'s cached keys, in cache order (a reference, not a hot path)."""
        src = self.source(layer)
        prompt = (torch.arange(self.context_len, self.prompt_end) if src < 0
                  else self.drops[src].kept_positions.cpu().long())
        return torch.cat([torch.arange(self.context_len), prompt, torch.arange(self.prompt_end, self.prompt_end + decoded)])


@dataclass(eq=False)
class DropHistoryStore:
    """Drop histories of live requests, keyed by request id; `free` when a request finishes.

    Dense host tables indexed by store row (row 0: no history) serve the decode helpers:
    `_removed[row, c]`: KV entries the layers of column c hold fewer than vLLM counts (column 0
    = layers on all tokens, column k + 1 = layers on drop point k's kept tokens);
    `_tail[row, c]`: the ORIGINAL positions of column c's cached prompt keys within the last
    `max_window` positions of the prompt (for sliding-window layers).
    """

    drop_layers: tuple[int, ...]
    num_layers: int
    policy: str = "cumulative"
    max_window: int = 0
    capacity: int = 64
    _histories: dict = field(default_factory=dict, init=False, repr=False)
    _rows: dict = field(default_factory=dict, init=False, repr=False)
    _free_rows: list = field(default_factory=list, init=False, repr=False)
    _version: int = field(default=0, init=False, repr=False)  # bumped by add / free
    _rows_cache: tuple | None = field(default=None, init=False, repr=False)  # (version, ids, rows)

    def __post_init__(self) -> None:
        self.drop_layers = tuple(int(d) for d in self.drop_layers)
        if not self.drop_layers:
            raise ValueError("drop_layers: expected at least one drop layer, got none")
        sources = layer_sources(self.drop_layers, self.num_layers, self.policy)
        self.layer_column = torch.tensor(sources, dtype=torch.long) + 1
        if self.max_window < 0 or self.capacity < 1:
            raise ValueError(f"max_window must be >= 0 and capacity >= 1; got {self.max_window}, {self.capacity}")
        columns = len(self.drop_layers) + 1
        self._removed = torch.zeros(self.capacity + 1, columns, dtype=torch.long)
        self._prompt_end = torch.zeros(self.capacity + 1, dtype=torch.long)
        self._has = torch.zeros(self.capacity + 1, dtype=torch.bool)
        self._tail = torch.full((self.capacity + 1, columns, self.max_window), _ABSENT, dtype=torch.long)
        self._free_rows = list(range(self.capacity, 0, -1))

    def __len__(self) -> int:
        return len(self._histories)

    @property
    def version(self) -> int:
        """Bumped by every `add` and `free`: equal versions mean equal histories."""
        return self._version

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._histories

    def get(self, request_id: str) -> RequestDropHistory | None:
        return self._histories.get(request_id)

    def add(self, history: RequestDropHistory, tail_candidates: Sequence[torch.Tensor] | None = None) -> int:
        """Keep `history`; returns its store row.

        tail_candidates: per drop, a host tensor holding (at least) the kept positions in the
        last `max_window` positions of the prompt; `record_step` gathers them for all requests
        with one device-to-host copy per drop point. Without them (direct use) each drop's
        positions are copied to the host here, one sync per drop.
        """
        layers = tuple(d.layer for d in history.drops)
        if layers != self.drop_layers:
            raise ValueError(f"history of {history.request_id!r} has drop layers {list(layers)}, "
                             f"expected this store's {list(self.drop_layers)}")
        if history.policy != self.policy:
            raise ValueError(f"history policy {history.policy!r}, expected {self.policy!r}")
        if history.request_id in self._histories:
            raise ValueError(f"request {history.request_id!r} already has a drop history (a request drops once)")
        for d in history.drops:
            if d.kept_positions.shape != (d.kept_len,):
                raise ValueError(f"layer {d.layer}: kept_positions has shape {tuple(d.kept_positions.shape)}, "
                                 f"expected ({d.kept_len},)")
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._version += 1
        self._rows[history.request_id] = row
        self._histories[history.request_id] = history
        end = history.prompt_end
        self._prompt_end[row] = end
        self._has[row] = True
        self._removed[row, 0] = 0
        for k, d in enumerate(history.drops):
            self._removed[row, k + 1] = history.prompt_len - d.kept_len
        if self.max_window:
            low = end - self.max_window
            context = torch.arange(max(low, 0), max(low, history.context_len))
            if tail_candidates is None:
                tail_candidates = [d.kept_positions[-self.max_window:].cpu() for d in history.drops]
            if len(tail_candidates) != len(history.drops):
                raise ValueError(f"tail_candidates: expected {len(history.drops)} tensors (one per drop), "
                                 f"got {len(tail_candidates)}")
            prompt = [torch.arange(history.context_len, end)] + [t.long() for t in tail_candidates]
            for c, keys in enumerate(prompt):
                keys = torch.cat([context, keys[keys >= low]])
                self._tail[row, c] = _ABSENT
                self._tail[row, c, : keys.numel()] = keys
        return row

    def free(self, request_id: str) -> bool:
        """Forget a finished request's history; False if it had none."""
        row = self._rows.pop(request_id, None)
        if row is None:
            return False
        self._version += 1
        del self._histories[request_id]
        self._removed[row] = 0
        self._prompt_end[row] = 0
        self._has[row] = False
        self._tail[row] = _ABSENT
        self._free_rows.append(row)
        return True

    def has_history(self, rows: torch.Tensor) -> torch.Tensor:
        """Host bool [R]: whether each store row holds a history (row 0 never does)."""
        return self._has[rows.long()]

    def rows_for(self, request_ids: Sequence[str]) -> torch.Tensor:
        """Store row of each request (0 without history), read-only. One dict lookup per
        request, except when the requests and the store are those of the previous call (a run
        of decode steps of one batch): then the previous answer, after one tuple comparison."""
        ids = tuple(request_ids)
        cached = self._rows_cache
        if cached is not None and cached[0] == self._version and cached[1] == ids:
            return cached[2]
        rows = torch.tensor([self._rows.get(r, 0) for r in ids], dtype=torch.long)
        self._rows_cache = (self._version, ids, rows)
        return rows

    def record_step(self, request_ids: Sequence[str], base: TokenLayout, drop_layouts: Sequence[TokenLayout],
                    dropped: torch.Tensor) -> list[int]:
        """Record the histories of the requests that dropped in a prefill step.

        drop_layouts: the layout after each drop point, in drop-layer order. dropped: host bool
        [R]. Loops over the dropping requests: this is the prefill planning step, not decode.
        Kept positions stay on their device; with `max_window` set, the few positions the
        window tables need travel to the host in one copy per drop point.
        """
        if len(drop_layouts) != len(self.drop_layers):
            raise ValueError(f"drop_layouts: expected {len(self.drop_layers)} (one per drop layer), got {len(drop_layouts)}")
        if len(request_ids) != base.num_reqs or dropped.shape != (base.num_reqs,):
            raise ValueError(f"request_ids / dropped: expected {base.num_reqs} entries, got "
                             f"{len(request_ids)} / {tuple(dropped.shape)}")
        droppers = torch.nonzero(dropped.cpu()).flatten()
        tails = [self._last_kept_positions(lay, droppers) for lay in drop_layouts] if self.max_window else None
        rows = []
        for i, r in enumerate(droppers.tolist()):
            drops = []
            for layer, lay in zip(self.drop_layers, drop_layouts):
                start, end = int(lay.query_start_loc_cpu[r]), int(lay.query_start_loc_cpu[r + 1])
                drops.append(DropRecord(layer, end - start, lay.positions[start:end].clone()))
            history = RequestDropHistory(request_ids[r], int(base.num_computed_tokens_cpu[r]),
                                         int(base.query_lens_cpu[r]), tuple(drops), self.policy)
            rows.append(self.add(history, [values[offsets[i]:offsets[i + 1]] for values, offsets in tails]
                                 if tails else None))
        return rows

    def _last_kept_positions(self, layout: TokenLayout, requests: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Host copy of the last `max_window` kept positions of each request (one D2H copy)."""
        ends = layout.query_start_loc_cpu[1:][requests]
        take = torch.minimum(layout.query_lens_cpu[requests], torch.tensor(self.max_window))
        offsets = torch.zeros(take.numel() + 1, dtype=torch.long)
        torch.cumsum(take, 0, out=offsets[1:])
        rows = torch.repeat_interleave(ends - take - offsets[:-1], take) + torch.arange(int(offsets[-1]))
        values = layout.positions[rows.to(layout.positions.device)].cpu()
        return values, offsets.tolist()

    # ---------------------------------------------------------------- decode helpers (vectorised)
    def kv_removed(self, rows: torch.Tensor, column: int) -> torch.Tensor:
        """Host [R]: `kv_removed_cpu` for `compact`/`relayout_kv` at layers of `column`."""
        return self._removed[rows.long(), column]

    def layer_kv_lens(self, rows: torch.Tensor, seq_lens_cpu: torch.Tensor) -> torch.Tensor:
        """Host [R, num_layers]: KV entries each layer holds, given vLLM's seq_lens (which count
        every token ever written: context + orig_len + decoded); = kept_len(layer) + decoded for
        a request with history, vLLM's seq_lens for one without."""
        seq = _host_int("seq_lens_cpu", seq_lens_cpu, 1)
        _check_shape("seq_lens_cpu", seq, tuple(rows.shape))
        return seq[:, None] - self._removed[rows.long()][:, self.layer_column]

    def decode_layouts(self, base: TokenLayout, rows: torch.Tensor) -> list[TokenLayout]:
        """One layout per column (index with `layer_column[layer]`), for a step whose requests
        do not drop now (decode, or anything not eligible). Column 0 is `base` itself."""
        _check_shape("rows", rows, (base.num_reqs,))
        return [base] + [relayout_kv(base, self.kv_removed(rows, c)) for c in range(1, self._removed.shape[1])]

    def window_first_visible(self, token_rows: torch.Tensor, query_positions_cpu: torch.Tensor, layer: int,
                             window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host ([T], [T]): first visible KV index and visible key count of each decode query.

        The keys a query sees under `window_visibility` (ORIGINAL positions) are a suffix of the
        layer's cache, ending at the query itself: [kv_len - count, kv_len), kv_len = pos_q + 1 -
        kv_removed. Queries must be decode tokens (pos_q >= the request's prompt end).
        """
        if window < 1 or window > self.max_window:
            raise ValueError(f"window={window}: expected 1 <= window <= max_window={self.max_window}")
        rows = token_rows.long()
        pos = _host_int("query_positions_cpu", query_positions_cpu, 1)
        _check_shape("query_positions_cpu", pos, tuple(rows.shape))
        has = self._has[rows]
        end = self._prompt_end[rows]
        if (has & (pos < end)).any():
            raise ValueError(f"query_positions_cpu: decode queries must lie at or after the prompt end; got "
                             f"{pos[has & (pos < end)].tolist()[:4]} before {end[has & (pos < end)].tolist()[:4]}")
        column = int(self.layer_column[layer])
        low = pos - window  # visible: pos_k > low
        in_prompt = (self._tail[rows, column] > low[:, None]).sum(1)
        decoded = torch.clamp(torch.minimum(pos - end + 1, torch.full_like(pos, window)), min=0)
        count = torch.where(has, in_prompt + decoded, torch.clamp(pos + 1, max=window))
        kv_len = pos + 1 - self._removed[rows, column]
        return kv_len - count, count

    def _grow(self) -> None:
        extra = self.capacity
        self._removed = torch.cat([self._removed, torch.zeros(extra, self._removed.shape[1], dtype=torch.long)])
        self._prompt_end = torch.cat([self._prompt_end, torch.zeros(extra, dtype=torch.long)])
        self._has = torch.cat([self._has, torch.zeros(extra, dtype=torch.bool)])
        self._tail = torch.cat([self._tail, torch.full((extra, *self._tail.shape[1:]), _ABSENT, dtype=torch.long)])
        self._free_rows = list(range(2 * self.capacity, self.capacity, -1)) + self._free_rows
        self.capacity *= 2


# ----------------------------------------------------------------------------- validation
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
    bad = (counts < 0) | (counts > query_lens) | ((query_lens > 0) & (counts == 0))
    if bad.any():
        r = int(torch.nonzero(bad)[0])
        raise ValueError(f"kept_counts_cpu[{r}] = {int(counts[r])}: expected 1..{int(query_lens[r])} (a request keeps "
                         f"at least its last token and at most its {int(query_lens[r])} tokens)")


def _check_blocks(g: int, table: torch.Tensor, block: int, kv_base: torch.Tensor, counts: torch.Tensor) -> None:
    live = counts > 0
    if live.any():
        need = int(((kv_base + counts - 1)[live] // block).max()) + 1
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
        expected = _slots(table.cpu(), block, request, logical)
        actual = slots.cpu()
        if not torch.equal(expected, actual):
            i = int(torch.nonzero(expected != actual)[0])
            raise ValueError(f"group {g}: slot_mapping[{i}] = {int(actual[i])}, expected {int(expected[i])} from "
                             f"block_table at logical KV index {int(logical[i])}")
