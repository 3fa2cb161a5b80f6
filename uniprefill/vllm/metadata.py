"""Eligibility, window tables and the per-request drop history of the vLLM runtime.

The token layouts of one step (`TokenLayout`, `batch_layout`, `compact`, ...) live in
`uniprefill.vllm.layout` and are re-exported here.

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

import numpy as np
import torch

from uniprefill.kernels._common import to_device

from .layout import (  # noqa: F401  (re-exported: the plugin, the runner and tests use them from here)
    _ABSENT, KVCacheGroup, TokenLayout, _check_shape, _host_int, _ranges, _request_of_rows, batch_layout, compact,
    install_layer_metadata, relayout_kv,
)


# ----------------------------------------------------------------------------- eligibility
class SkipReason(enum.IntEnum):
    """Why a request of a step does not drop (0: it may)."""

    ELIGIBLE = 0
    DECODE = 1  # its prompt is already in the cache: a decode (or spec-decode) step
    PARTIAL_CHUNK = 2  # chunked prefill, not at its last chunk
    HAS_CONTEXT = 3  # prefix-cached, or the last chunk of a chunked prefill
    SHORT = 4  # fewer tokens than min_tokens
    OPTED_OUT = 5  # asked for prompt logprobs (every prompt row reaches the logits), or opted out
    CUDA_GRAPH = 6  # the step runs vLLM's piecewise CUDA graphs, captured for a fixed number of rows
    CONTEXT_TAIL = 7  # sliding layers after a drop: too few rows dropped to hold its context's window tail


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
    qlen, ctx, prompt = qlen.numpy(), ctx.numpy(), prompt.numpy()  # host arithmetic in numpy
    reason = np.full(qlen.shape, int(SkipReason.ELIGIBLE), dtype=np.int64)
    reason[qlen < min_tokens] = SkipReason.SHORT
    if not allow_context:
        reason[ctx > 0] = SkipReason.HAS_CONTEXT
    if opted_out_cpu is not None:
        _check_shape("opted_out_cpu", opted_out_cpu, tuple(qlen.shape))
        reason[opted_out_cpu.cpu().numpy().astype(bool)] = SkipReason.OPTED_OUT
    reason[ctx + qlen < prompt] = SkipReason.PARTIAL_CHUNK
    reason[ctx >= prompt] = SkipReason.DECODE
    return torch.from_numpy(reason)


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

    def add(self, history: RequestDropHistory,
            tail_candidates: Sequence[torch.Tensor | np.ndarray] | None = None) -> int:
        """Keep `history`; returns its store row.

        tail_candidates: per drop, a host tensor or numpy array holding (at least) the kept positions in the
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
        # the host tables are written through numpy views (the same memory): no torch op per entry
        self._prompt_end.numpy()[row] = end
        self._has.numpy()[row] = True
        self._removed.numpy()[row] = [0] + [history.prompt_len - d.kept_len for d in history.drops]
        if self.max_window:
            low = end - self.max_window
            context = np.arange(max(low, 0), max(low, history.context_len), dtype=np.int64)
            if tail_candidates is None:
                tail_candidates = [d.kept_positions[-self.max_window:].cpu() for d in history.drops]
            if len(tail_candidates) != len(history.drops):
                raise ValueError(f"tail_candidates: expected {len(history.drops)} tensors (one per drop), "
                                 f"got {len(tail_candidates)}")
            prompt = [np.arange(max(history.context_len, low), end, dtype=np.int64)] + [
                t if isinstance(t, np.ndarray) else t.cpu().numpy() for t in tail_candidates]
            prompt = [keys.astype(np.int64, copy=False) for keys in prompt]
            tail = self._tail.numpy()
            for c, keys in enumerate(prompt):
                keys = np.concatenate([context, keys[keys >= low]])
                tail[row, c] = _ABSENT
                tail[row, c, : keys.size] = keys
        return row

    def free(self, request_id: str) -> bool:
        """Forget a finished request's history; False if it had none."""
        row = self._rows.pop(request_id, None)
        if row is None:
            return False
        self._version += 1
        del self._histories[request_id]
        self._removed.numpy()[row] = 0
        self._prompt_end.numpy()[row] = 0
        self._has.numpy()[row] = False
        self._tail.numpy()[row] = _ABSENT
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
        droppers = np.flatnonzero(dropped.cpu().numpy())
        tails = [self._last_kept_positions(lay, droppers) for lay in drop_layouts] if self.max_window else None
        # one copy of each layout's positions (one launch per drop point, not one per request); the requests'
        # records are views of it. Host numbers are read through numpy (no torch op per request)
        positions = [lay.positions.clone() for lay in drop_layouts]
        starts = [lay.query_start_loc_cpu.tolist() for lay in drop_layouts]
        computed, query_lens = base.num_computed_tokens_cpu.tolist(), base.query_lens_cpu.tolist()
        rows = []
        for i, r in enumerate(droppers.tolist()):
            drops = []
            for layer, kept, qsl in zip(self.drop_layers, positions, starts):
                drops.append(DropRecord(layer, qsl[r + 1] - qsl[r], kept[qsl[r]:qsl[r + 1]]))
            history = RequestDropHistory(request_ids[r], int(computed[r]), int(query_lens[r]), tuple(drops),
                                         self.policy)
            rows.append(self.add(history, [values[offsets[i]:offsets[i + 1]] for values, offsets in tails]
                                 if tails else None))
        return rows

    def _last_kept_positions(self, layout: TokenLayout, picked: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Host copy of the last `max_window` kept positions of each request in `picked` (int array; one D2H
        copy), as a numpy array with each request's offsets."""
        ends = layout.query_start_loc_cpu.numpy()[1:][picked].astype(np.int64)
        take = np.minimum(layout.query_lens_cpu.numpy()[picked], self.max_window).astype(np.int64)
        offsets = np.zeros(take.size + 1, dtype=np.int64)
        np.cumsum(take, out=offsets[1:])
        rows = np.repeat(ends - take - offsets[:-1], take) + np.arange(int(offsets[-1]), dtype=np.int64)
        values = layout.positions[to_device(torch.from_numpy(rows), layout.positions.device)].cpu()
        return values.numpy().astype(np.int64, copy=False), offsets.tolist()

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

    def window_tables(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host ([R, columns - 1, max_window], [R], [R]): what `window_first_visible` reads, for the
        device copy decode graphs count from (`vllm.graph_decode.window_rows`): the cached prompt keys'
        ORIGINAL positions within the last `max_window` prompt positions per drop column (`_ABSENT`
        elsewhere), each request's prompt end and whether it has a history."""
        rows = rows.long()
        return self._tail[rows, 1:], self._prompt_end[rows], self._has[rows]

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
