"""The `torch.library` custom ops that the token-drop rewrite inserts into a graph.

Vocabulary (shared with `uniprefill.passes.token_drop`):

* A *dense* tensor is laid out as the model traced it: a batch axis of size B (or 1 when
  broadcast) and a token axis of size N.
* A *packed* tensor holds only the kept tokens of every row, back to back: batch axis of
  size 1 and token axis of size T (the total kept), rows in order, tokens in their original
  order inside a row. `cu_seqlens`-style row boundaries travel as a host tensor of per-row
  counts, copied once per drop point.
* `flat` indices address the dense (batch, token) grid as `b * N + t`; `rel` indices
  address the token axis of the previous packed layout.

Every op has a fake (meta) implementation so graphs that contain them stay traceable;
`score_select` allocates a data-dependent output size through `new_dynamic_size`.
"""

from __future__ import annotations

import torch

from .kernels import api as kernels_api
from .kernels._common import to_device  # noqa: F401  (re-exported: `uniprefill.ops.to_device`)
from .kernels.rule import SelectionRule

LIB = "uniprefill"


# --------------------------------------------------------------------------------------
# score_select: score the tokens of the current layout and choose which to keep
# --------------------------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::score_select", mutates_args=())
def score_select(
    q: torch.Tensor,
    k: torch.Tensor,
    src_flat: torch.Tensor,
    counts_in: torch.Tensor,
    scale: float,
    block_size: int,
    p: float,
    keep_ratio: float,
    sink: int,
    last_q: int,
    min_tokens: int,
    impl: str,
    selection: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the tokens to keep at one drop point.

    q, k: the attention inputs of the drop layer, `[Bq, H, L, d]` (SDPA layout).
    src_flat: int64 `[T_in]`, the flat `b * L + t` index of every live token of the
        current layout, rows back to back (`counts_in` host int64 `[R]` tokens per row).
    keep_ratio < 0 means top-p with `p` under the rule `selection` ("paper" or "content").
    The selection settings are separate primitives because an op schema cannot take a
    dataclass; the op builds one `kernels.rule.SelectionRule` of them (`min_tokens` is the
    config's `effective_min_tokens`).
    Returns (rel_kept int64 `[T_out]` indices into `src_flat`, counts_out host int64 `[R]`).
    One device-to-host copy: the kept counts.
    """
    rule = SelectionRule(block_size=block_size, sink=sink, last_q=last_q, min_tokens=min_tokens, p=p,
                         keep_ratio=None if keep_ratio < 0 else keep_ratio, selection=selection)
    bq, hk, length, d = k.shape
    counts = counts_in.tolist()
    k_flat = k.transpose(1, 2).reshape(bq * length, hk, d)
    k_packed = k_flat.index_select(0, src_flat)
    cu_k = to_device(_cumsum0(counts_in).to(torch.int32), q.device)
    q_counts = [min(last_q, c) for c in counts]
    q_flat_idx = _last_tokens(src_flat, counts, q_counts)
    q_packed = q.transpose(1, 2).reshape(q.shape[0] * length, q.shape[1], d).index_select(0, q_flat_idx)
    cu_q = to_device(_cumsum0(torch.tensor(q_counts, dtype=torch.int64)).to(torch.int32), q.device)
    chosen = kernels_api.score_and_select(
        q_packed,
        k_packed,
        cu_q,
        cu_k,
        max(counts) if counts else 0,
        rule,
        scale=scale,
        impl=impl,
        host_cu_seqlens=(_host_cumsum(q_counts), _host_cumsum(counts)),
    )
    return chosen.kept_idx, torch.tensor(chosen.kept_counts, dtype=torch.int64)


@score_select.register_fake
def _(q, k, src_flat, counts_in, scale, block_size, p, keep_ratio, sink, last_q, min_tokens, impl, selection):
    kept = torch.library.get_ctx().new_dynamic_size()
    return src_flat.new_empty(kept), counts_in.new_empty(counts_in.shape)


def _host_cumsum(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _cumsum0(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def _last_tokens(src_flat: torch.Tensor, counts: list[int], take: list[int]) -> torch.Tensor:
    """Flat indices of the last `take[r]` live tokens of every row, rows back to back."""
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    pieces = [torch.arange(int(e) - t, int(e)) for e, t in zip(ends, take)]
    rows = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    return src_flat.index_select(0, to_device(rows, src_flat.device))


# --------------------------------------------------------------------------------------
# gather / scatter along the (batch, token) axes
# --------------------------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::gather_tokens", mutates_args=())
def gather_tokens(x: torch.Tensor, idx: torch.Tensor, batch_dim: int, token_dim: int, tokens: int) -> torch.Tensor:
    """Pack `x` to the tokens `idx` (flat over x's (batch, token) grid).

    `batch_dim < 0` means x has no batch axis. When x's batch axis has size 1 (broadcast
    over rows), `idx` is taken modulo the token count. The result has a batch axis of
    size 1 and a token axis of size `len(idx)`, other axes unchanged. `tokens` is the token
    count of the layout `idx` indexes into: a token axis of another size means the graph
    rewrite took an already packed value for a dense one, and raises instead of wrapping
    the indices around it.
    """
    seq = x.shape[token_dim]
    if seq != tokens:
        raise RuntimeError(
            f"uniprefill::gather_tokens: token axis {token_dim} of a {tuple(x.shape)} value has {seq} tokens, "
            f"its layout has {tokens}: the rewrite mislabelled this value (please report the model)")
    if batch_dim < 0:
        return x.index_select(token_dim, idx % seq)
    moved = x.movedim((batch_dim, token_dim), (0, 1))
    rows = moved.shape[0]
    flat = moved.reshape((rows * seq,) + tuple(moved.shape[2:]))
    picked = flat.index_select(0, idx if rows > 1 else idx % seq)
    return picked.unsqueeze(0).movedim((0, 1), (batch_dim, token_dim)).contiguous()


@gather_tokens.register_fake
def _(x, idx, batch_dim, token_dim, tokens):
    shape = list(x.shape)
    if batch_dim >= 0:
        shape[batch_dim] = 1
    shape[token_dim] = idx.shape[0]
    return x.new_empty(shape)


@torch.library.custom_op(f"{LIB}::scatter_tokens", mutates_args=())
def scatter_tokens(base: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, batch_dim: int, token_dim: int) -> torch.Tensor:
    """Inverse of `gather_tokens`: a copy of dense `base` with the tokens `idx` taken from packed `x`."""
    moved = base.movedim((batch_dim, token_dim), (0, 1))
    rows, seq = moved.shape[0], moved.shape[1]
    flat = moved.reshape((rows * seq,) + tuple(moved.shape[2:])).clone()
    src = x.movedim((batch_dim, token_dim), (0, 1)).reshape((idx.shape[0],) + tuple(moved.shape[2:]))
    flat.index_copy_(0, idx, src.to(flat.dtype))
    return flat.reshape(moved.shape).movedim((0, 1), (batch_dim, token_dim)).contiguous()


@scatter_tokens.register_fake
def _(base, x, idx, batch_dim, token_dim):
    return base.new_empty(base.shape)


# The attention ops live beside these (one file each, one import registers all of them).
from .attention_ops import (  # noqa: E402,F401  (re-exported: `uniprefill.ops.dense_mask` and friends)
    _position_mask,
    additive_position_mask,
    decode_attention,
    dense_attention,
    dense_mask,
    packed_attention,
    packed_masks,
    sparse_attention,
)
