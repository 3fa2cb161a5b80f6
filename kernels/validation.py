"""Input checks for the score-and-select API, and the choice of implementation.

Every check raises `ValueError` naming what was expected and what came. Checks that need
the VALUES of `cu_seqlens` (monotonic, consistent with the packed tensors) read them to the
host once, in `read_layout`; callers that already hold them on the host pass them in and
skip that device-to-host copy. `select_blocks` and `compact_tokens` check shapes, dtypes and
devices only: their `cu_*` tensors come from `score_blocks`, whose checks already ran. The
selection settings are checked when their `SelectionRule` is built (`rule.py`, with `check_int`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ._common import cdiv, interpret_enabled

SCORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
from .names import IMPLS


@dataclasses.dataclass(frozen=True)
class VarlenLayout:
    """Host copy of a packed batch's sequence lengths (queries and keys)."""

    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.seqlens_k)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q, default=0)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seqlens_k, default=0)

    def num_blocks(self, block_size: int) -> int:
        return sum(cdiv(n, block_size) for n in self.seqlens_k)


def resolve_impl(impl: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA, 'torch' elsewhere; 'triton' off CUDA needs TRITON_INTERPRET=1."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if impl == "triton" and device.type != "cuda" and not interpret_enabled():
        raise ValueError(
            f"impl='triton' needs CUDA tensors, got tensors on {device}; use impl='torch' "
            "(the PyTorch reference) or set TRITON_INTERPRET=1 to run the Triton kernels on the CPU"
        )
    return impl


def check_score_inputs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, block_size, scale) -> None:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [tokens, heads, head_dim], got {_shape(t)}")
        if t.dtype not in SCORE_DTYPES:
            raise ValueError(f"{name}.dtype must be one of {SCORE_DTYPES}, got {t.dtype}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got q {q.dtype} and k {k.dtype}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must share head_dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    hq, hk = q.shape[1], k.shape[1]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q heads must be a multiple of k heads (GQA), got Hq={hq} and Hk={hk}")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got q on {q.device} and k on {k.device}")
    _check_cu("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu("cu_seqlens_k", cu_seqlens_k, q.device, batch=cu_seqlens_q.shape[0] - 1)
    check_int("max_seqlen_k", max_seqlen_k, low=0)
    check_int("block_size", block_size, low=1)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")


def read_layout(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    total_q: int,
    total_k: int,
    max_seqlen_k: int,
    host_cu_seqlens: tuple[Sequence[int], Sequence[int]] | None,
) -> VarlenLayout:
    """Host lengths, from `host_cu_seqlens` or from ONE device-to-host copy, checked."""
    if host_cu_seqlens is None:
        both = torch.cat([cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)]).tolist()
        cu_q, cu_k = both[: cu_seqlens_q.shape[0]], both[cu_seqlens_q.shape[0] :]
    else:
        if len(host_cu_seqlens) != 2:
            raise ValueError("host_cu_seqlens must be a pair (cu_seqlens_q, cu_seqlens_k) of int lists")
        cu_q, cu_k = (list(map(int, c)) for c in host_cu_seqlens)
        for name, c, t in (("q", cu_q, cu_seqlens_q), ("k", cu_k, cu_seqlens_k)):
            if len(c) != t.shape[0]:
                raise ValueError(
                    f"host_cu_seqlens[{name}] has {len(c)} entries, cu_seqlens_{name} has {t.shape[0]}"
                )
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        if cu[0] != 0 or cu[-1] != total:
            raise ValueError(f"{name} must start at 0 and end at {total} (the packed length), got {cu}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name} must be non-decreasing, got {cu}")
    seqlens_q = tuple(b - a for a, b in zip(cu_q, cu_q[1:]))
    seqlens_k = tuple(b - a for a, b in zip(cu_k, cu_k[1:]))
    for i, (nq, nk) in enumerate(zip(seqlens_q, seqlens_k)):
        if nq > nk or (nk > 0 and nq == 0):
            raise ValueError(
                f"sequence {i} has {nq} queries and {nk} keys; expected 1 <= queries <= keys "
                "(the last queries of each non-empty sequence)"
            )
    layout = VarlenLayout(seqlens_q, seqlens_k)
    if layout.max_seqlen_k > max_seqlen_k:
        raise ValueError(
            f"max_seqlen_k={max_seqlen_k} is below the longest sequence ({layout.max_seqlen_k} keys)"
        )
    return layout


def check_select_inputs(block_scores, cu_blocks, cu_seqlens_k, rule) -> None:
    """The tensors of a selection, and `rule`'s p and sink tensors (if any) against their batch; the
    rule's own values were checked when it was built (`rule.SelectionRule`)."""
    check_rule(rule)
    if not isinstance(block_scores, torch.Tensor) or block_scores.dim() != 1:
        raise ValueError(f"block_scores must be a 1-D tensor [total_blocks], got {_shape(block_scores)}")
    if block_scores.dtype != torch.float32:
        raise ValueError(f"block_scores.dtype must be torch.float32, got {block_scores.dtype}")
    _check_cu("cu_blocks", cu_blocks, block_scores.device)
    batch = cu_blocks.shape[0] - 1
    _check_cu("cu_seqlens_k", cu_seqlens_k, block_scores.device, batch=batch)
    p = rule.p
    if rule.per_sequence_p and p.shape[0] != batch:  # a host tensor, moved by the caller
        raise ValueError(f"p as a tensor must be a host float32 tensor [B] = [{batch}] (one p per sequence), "
                         f"got {p.dtype} {tuple(p.shape)} on {p.device}")
    sink = rule.sink
    if rule.per_sequence_sink and sink.shape[0] != batch:
        raise ValueError(f"sink as a tensor must be a host int tensor [B] = [{batch}] (one sink count per "
                         f"sequence), got {sink.dtype} {tuple(sink.shape)} on {sink.device}")


def check_rule(rule) -> None:
    from .rule import SelectionRule  # here, not at the top: rule.py imports `check_int` from this module

    if not isinstance(rule, SelectionRule):
        raise ValueError(f"rule must be a SelectionRule, got {type(rule).__name__}")


def check_compact_inputs(block_keep, cu_blocks, cu_seqlens_k, block_size) -> None:
    if not isinstance(block_keep, torch.Tensor) or block_keep.dim() != 1:
        raise ValueError(f"block_keep must be a 1-D tensor [total_blocks], got {_shape(block_keep)}")
    if block_keep.dtype != torch.bool:
        raise ValueError(f"block_keep.dtype must be torch.bool, got {block_keep.dtype}")
    _check_cu("cu_blocks", cu_blocks, block_keep.device)
    _check_cu("cu_seqlens_k", cu_seqlens_k, block_keep.device, batch=cu_blocks.shape[0] - 1)
    check_int("block_size", block_size, low=1)


def check_int(name: str, value, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if value < low:
        raise ValueError(f"{name}={value!r} must be >= {low}")


def _check_cu(name: str, t, device: torch.device, batch: int | None = None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] < 2:
        raise ValueError(f"{name} must be a 1-D tensor [batch + 1] with batch >= 1, got {_shape(t)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}.dtype must be one of {INDEX_DTYPES}, got {t.dtype}")
    if batch is not None and t.shape[0] != batch + 1:
        raise ValueError(f"{name} must have {batch + 1} entries (batch + 1), got {t.shape[0]}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _shape(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"{type(t).__name__}"
