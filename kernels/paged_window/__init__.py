"""Paged sliding-window attention with a per-row window: the kernel behind vLLM sliding layers
after a drop point (`uniprefill.vllm.window`).

Each query row t of request r sees the `count[t]` cache entries that end at its own entry,
logical KV indices `[logical[t] - count[t] + 1, logical[t]]`, read from vLLM's paged cache
through the request's block table. FlashAttention's window is the same for every row; here
each row has its own (after a drop, how many kept entries lie within W positions varies).

- `paged_window_attention_torch` (`reference.py`): the PyTorch reference.
- `paged_window_attention_triton` (`kernel.py`): the Triton kernel, imported when it runs.
- `paged_window_attention(..., impl="auto")`: Triton on CUDA, the reference elsewhere (or
  Triton's CPU interpreter with TRITON_INTERPRET=1), as `kernels.api` chooses.
"""

from __future__ import annotations

import torch

from ..validation import resolve_impl
from .reference import paged_window_attention_torch

__all__ = ["paged_window_attention", "paged_window_attention_torch", "paged_window_attention_triton"]


def _check(query, key_cache, value_cache, block_table, row_request, row_logical, row_count, window) -> None:
    if query.dim() != 3 or key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"query must be [T, Hq, D] and the caches [blocks, B, Hk, D] alike; got "
                         f"{tuple(query.shape)}, {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    if query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"head size {query.shape[2]} of the query != {key_cache.shape[3]} of the cache")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"query heads {query.shape[1]} are not a multiple of the cache's KV heads {key_cache.shape[2]}")
    rows = query.shape[0]
    for name, t in (("row_request", row_request), ("row_logical", row_logical), ("row_count", row_count)):
        if t.shape != (rows,):
            raise ValueError(f"{name} must have shape ({rows},), got {tuple(t.shape)}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, max_blocks], got {tuple(block_table.shape)}")
    if window < 1:
        raise ValueError(f"window={window}: expected >= 1")


def paged_window_attention(query, key_cache, value_cache, block_table, row_request, row_logical, row_count,
                           *, window: int, scale: float, softcap: float | None = None,
                           impl: str = "auto", tiled: bool = False, splits: int = 1,
                           out: torch.Tensor | None = None, skip: torch.Tensor | None = None,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
    """[T, Hq, D]: each row's attention over its own run of paged cache entries (module docstring).

    query [T, Hq, D]; key_cache, value_cache [num_blocks, B, Hk, D] (any strides: vLLM's
    FlashAttention cache views); block_table [R, max_blocks]; row_request, row_logical,
    row_count [T] ints (1 <= count <= window, count <= logical + 1). `tiled`: Triton's tiled kernel
    (`kernel.py`) instead of the per-row one; `splits`: the per-row kernel's programs per row (split-KV).
    `out`: where to write (query's shape and dtype, any strides, not the query's memory; vLLM's output
    buffer: no copy after the kernel); returned. `skip` (bool [T], with `out`; not with `tiled`): rows whose output
    row is left as `out` holds it (in a decode graph, vLLM's result for the requests that removed no KV entry:
    the per-row kernel reads nothing for them). `rows` (int [N], distinct, each in [0, T), with `out`): only those
    rows are computed, each written to its own row of `out`, the others left as they are (a step whose rows run on
    two kernels: no gather of their queries, no copy of their outputs); the Triton kernels do not check the range
    (a check would read the device)."""
    _check(query, key_cache, value_cache, block_table, row_request, row_logical, row_count, window)
    if out is not None:
        _check_out(query, out)
    if rows is not None and (out is None or rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64)
                             or rows.device != query.device):
        raise ValueError(f"rows: expected a 1-D int32 or int64 tensor on {query.device}, with `out`; got "
                         f"{rows.dtype} {tuple(rows.shape)} on {rows.device}, out {'given' if out is not None else 'None'}")
    if rows is not None:
        rows = rows.contiguous()  # the kernels read ROWS[p] at stride 1
    if skip is not None and (out is None or tiled or skip.shape != (query.shape[0],) or skip.dtype != torch.bool):
        raise ValueError(f"skip: expected a bool tensor of shape ({query.shape[0]},), with `out` and the per-row "
                         f"kernel; got {skip.dtype} {tuple(skip.shape)}, out {'given' if out is not None else 'None'}, "
                         f"tiled={tiled}")
    if resolve_impl(impl, query.device) == "triton":
        from .kernel import paged_window_attention_triton

        return paged_window_attention_triton(query, key_cache, value_cache, block_table, row_request, row_logical,
                                             row_count, window=window, scale=scale, softcap=softcap, tiled=tiled,
                                             splits=splits, out=out, skip=skip, rows=rows)
    if rows is not None:  # the reference on the rows taken, written back to theirs
        rows = rows.long()
        query, row_request, row_logical, row_count = (t.index_select(0, rows) for t in (query, row_request,
                                                                                        row_logical, row_count))
        skip = None if skip is None else skip.index_select(0, rows)
    result = paged_window_attention_torch(query, key_cache, value_cache, block_table, row_request, row_logical,
                                          row_count, window=window, scale=scale, softcap=softcap)
    if skip is not None:  # device ops only (capturable)
        kept = out if rows is None else out.index_select(0, rows)
        result = torch.where(skip.view(-1, *[1] * (result.dim() - 1)), kept, result)
    if rows is not None:
        return out.index_copy_(0, rows, result)
    return result if out is None else out.copy_(result)


def _check_out(query: torch.Tensor, out: torch.Tensor) -> None:
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out: expected {tuple(query.shape)} {query.dtype} on {query.device} (the query's), got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.numel() and out.untyped_storage().data_ptr() == query.untyped_storage().data_ptr():
        raise ValueError("out: shares the query's memory (a kernel reads rows of the query another program writes)")


def paged_window_attention_triton(*args, **kwargs) -> torch.Tensor:
    """The Triton kernel (`kernel.py`, imported on the first call: importing it imports triton)."""
    from .kernel import paged_window_attention_triton as run

    return run(*args, **kwargs)
