"""A step's row layout on the device: which request each row belongs to, its logical KV index, its slot in
every KV-cache group, its position and source row; and, for sliding-window layers after a drop, how many cache
entries each row's query sees. The device side of `uniprefill.vllm.layout.compact` and `vllm.window`.

On a small model a vLLM step is bound by the host, and each torch op costs a launch (17-20 us on the H200,
docs/results/vllm-gemma-profile-own-h200-2026-12-05): these are one kernel each where the torch composition is
about 25 and 20 ops.

- `reference.py`: the PyTorch definitions (`layout_rows_torch`, `window_counts_torch`).
- `kernel.py`: the Triton kernels, imported when they run.
- `layout_rows(..., impl="auto")` / `window_counts(...)`: Triton on CUDA, the reference elsewhere (or Triton's
  CPU interpreter with TRITON_INTERPRET=1), as `kernels.api` chooses. Importing this package imports no Triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..validation import resolve_impl
from .reference import decode_segment_torch, decode_window_torch, layout_rows_torch, window_counts_torch

__all__ = ["layout_rows", "window_counts", "decode_segment", "decode_window", "warm_up", "layout_rows_torch",
           "window_counts_torch", "decode_segment_torch", "decode_window_torch"]


def layout_rows(query_start_loc: torch.Tensor, kv_base: torch.Tensor, tables: Sequence[torch.Tensor], block_size: int,
                tokens: int, *, kept: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                source: torch.Tensor | None = None, impl: str = "auto"):
    """(positions, source, request, logical, slots) of a layout's `tokens` rows, all int64 [tokens] on the device.

    query_start_loc [R + 1] (device, int32/int64; qsl[R] = tokens): request r owns rows qsl[r]:qsl[r + 1].
    kv_base [R] (device): KV entries request r holds before its first row here; row t of request r is at logical
        KV index `kv_base[r] + t - qsl[r]`, and `slots[g][t] = tables[g][r, logical // B] * B + logical % B` for
        each block table [R', max_blocks] (R' >= R, int32/int64, one block size B).
    kept: [tokens] rows of an earlier layout (sorted); positions / source are that layout's, gathered through it.
        Without `kept`: `positions` None is vLLM's own batch (each row's position is its logical index, its source
        the row itself); `positions` given returns None for both (the caller keeps its own).
    Indices are not checked here (a launch per check on the host's path): `vllm.layout`'s `validate="full"`
    checks them. Preconditions: qsl non-decreasing, kv_base >= 0 and every logical index inside its table row (a
    negative index would floor in the reference and truncate in Triton); 1-D inputs contiguous (checked)."""
    _check(query_start_loc, kv_base, tables, block_size, tokens, kept, positions, source)
    if resolve_impl(impl, query_start_loc.device) == "triton":
        from .kernel import layout_rows_triton

        return layout_rows_triton(query_start_loc, kv_base, tables, block_size, tokens, kept=kept,
                                  positions=positions, source=source)
    return layout_rows_torch(query_start_loc, kv_base, tables, block_size, tokens, kept=kept, positions=positions,
                             source=source)


def window_counts(positions: torch.Tensor, request: torch.Tensor, query_start_loc: torch.Tensor,
                  context: torch.Tensor, dropping: torch.Tensor, window: int, *, max_query_len: int,
                  impl: str = "auto") -> torch.Tensor:
    """int64 [T]: how many cache entries each row's query sees under a window of `window` ORIGINAL positions.

    positions, request [T] (a layout's rows: each request's rows contiguous, positions increasing within it);
    query_start_loc [R + 1]; context, dropping [R]: each request's context count (KV entries cached before the
    step) and whether it drops in this step. A dropping request's row sees the rows of its request within the
    window up to itself, plus the context entries within it; any other row one entry per position, min(W, pos + 1).
    max_query_len: the most rows of one request (host int; bounds the search)."""
    if window < 1:
        raise ValueError(f"window={window}: expected >= 1")
    rows = positions.shape[0] if positions.dim() == 1 else -1
    if rows < 0 or request.shape != (rows,):
        raise ValueError(f"positions and request must be 1-D of one length; got {tuple(positions.shape)}, "
                         f"{tuple(request.shape)}")
    num_reqs = query_start_loc.numel() - 1
    for name, t in (("context", context), ("dropping", dropping)):
        if t.shape != (num_reqs,):
            raise ValueError(f"{name}: expected shape ({num_reqs},) (one per request), got {tuple(t.shape)}")
    _contiguous(positions=positions, request=request, query_start_loc=query_start_loc, context=context,
                dropping=dropping)
    if resolve_impl(impl, positions.device) == "triton":
        from .kernel import window_counts_triton

        return window_counts_triton(positions, request, query_start_loc, context, dropping, window, max_query_len)
    return window_counts_torch(positions, request, query_start_loc, context, dropping, window)


def decode_segment(seq_lens: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                   removed: torch.Tensor, block_size: int, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_lens, slot_mapping) of a full-attention layer after a drop point, for a decode step of R requests (one row
    each), inside a CUDA graph (device ops only; no sync, no host read).

    seq_lens [R] (vLLM's, every token ever written), block_table [>= R, max_blocks], slot_mapping [>= R] (vLLM's, -1
    on padding rows), removed [>= R] (KV entries this layer holds fewer, per request). The new token of request r
    sits at logical index `seq_lens[r] - removed[r] - 1`; padding rows keep vLLM's -1. One launch where the torch
    composition is about ten, each a kernel of the graph replayed every decode step."""
    if seq_lens.dim() != 1 or block_table.dim() != 2 or block_table.shape[0] < seq_lens.shape[0] \
            or slot_mapping.shape[0] < seq_lens.shape[0] or removed.shape[0] < seq_lens.shape[0]:
        raise ValueError(f"decode_segment: seq_lens [R], block_table [>= R, B], slot_mapping and removed [>= R]; got "
                         f"{tuple(seq_lens.shape)}, {tuple(block_table.shape)}, {tuple(slot_mapping.shape)}, "
                         f"{tuple(removed.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table: expected unit column stride, got strides {block_table.stride()}")
    _contiguous(seq_lens=seq_lens, slot_mapping=slot_mapping, removed=removed)
    if resolve_impl(impl, seq_lens.device) == "triton":
        from .kernel import decode_segment_triton

        return decode_segment_triton(seq_lens, block_table, slot_mapping, removed, block_size)
    return decode_segment_torch(seq_lens, block_table, slot_mapping, removed, block_size)


def decode_window(seq_lens: torch.Tensor, tail: torch.Tensor, prompt_end: torch.Tensor, has: torch.Tensor,
                  window: int, removed: torch.Tensor | None = None, *, impl: str = "auto"):
    """(request, logical, count, vllm_rows) of a sliding layer's rows after a drop, for a decode step of R requests,
    inside a CUDA graph (device ops only).

    seq_lens [R] (vLLM's, the new token included: it sits at logical index seq_lens - 1, its position); tail [>= R,
    max_window] (kept prompt positions near each prompt's end, `_ABSENT` elsewhere), prompt_end / has [>= R]. Each
    row sees the cached keys at positions > pos - window: its kept prompt keys there plus its decoded tokens, or
    min(pos + 1, window) without a history; counts clamped to [1, min(window, logical + 1)] (padding rows read entry
    0). `removed` [>= R]: `vllm_rows` marks the rows of requests that removed none (None without it)."""
    if window < 1 or tail.dim() != 2 or tail.shape[0] < seq_lens.shape[0]:
        raise ValueError(f"decode_window: window >= 1 and tail [>= R, max_window]; got window={window}, "
                         f"tail {tuple(tail.shape)} for R = {seq_lens.shape[0]}")
    if tail.stride(1) != 1:
        raise ValueError(f"tail: expected unit column stride, got strides {tail.stride()}")
    for name, t in (("prompt_end", prompt_end), ("has", has), ("removed", removed)):
        if t is not None and (t.dim() != 1 or t.shape[0] < seq_lens.shape[0]):
            raise ValueError(f"{name}: expected [>= {seq_lens.shape[0]}] (one per request), got {tuple(t.shape)}")
    _contiguous(seq_lens=seq_lens, prompt_end=prompt_end, has=has, removed=removed)
    if resolve_impl(impl, seq_lens.device) == "triton":
        from .kernel import decode_window_triton

        return decode_window_triton(seq_lens, tail, prompt_end, has, window, removed)
    return decode_window_torch(seq_lens, tail, prompt_end, has, window, removed)


def warm_up(device: torch.device, impl: str = "auto") -> int:
    """Compile the Triton kernels (one variant each, `kernel.py`) where they run, before a server's first request, and
    check each against its PyTorch reference there (a disagreement raises: the engine does not start on kernels that
    compute wrong layouts); the launches run, 0 where the reference runs."""
    if resolve_impl(impl, device) != "triton":
        return 0
    from .kernel import warm_up_layout_rows

    return warm_up_layout_rows(device)


def _contiguous(**tensors) -> None:
    """The kernels index 1-D inputs as `pointer + i`: a strided view would be read wrong, so it is refused."""
    for name, t in tensors.items():
        if t is not None and t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous 1-D tensor, got stride {t.stride(0)}")


def _check(query_start_loc, kv_base, tables, block_size, tokens, kept, positions, source) -> None:
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise ValueError(f"query_start_loc: expected [R + 1], got {tuple(query_start_loc.shape)}")
    num_reqs = query_start_loc.numel() - 1
    if kv_base.shape != (num_reqs,):
        raise ValueError(f"kv_base: expected shape ({num_reqs},) (one per request), got {tuple(kv_base.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: expected >= 1")
    for g, table in enumerate(tables):
        if table.dim() != 2 or table.shape[0] < num_reqs or table.stride(1) != 1:
            raise ValueError(f"tables[{g}]: expected [>= {num_reqs}, max_blocks] with unit column stride, got shape "
                             f"{tuple(table.shape)} strides {table.stride()}")
    if kept is not None:
        if kept.shape != (tokens,):
            raise ValueError(f"kept: expected shape ({tokens},), got {tuple(kept.shape)}")
        if positions is None or source is None or positions.dim() != 1 or source.shape != positions.shape:
            raise ValueError("kept: needs the earlier layout's positions and source rows (1-D, one length)")
    elif source is not None:
        raise ValueError("source: only with kept (gathered through it)")
    _contiguous(query_start_loc=query_start_loc, kv_base=kv_base, kept=kept, positions=positions, source=source)
