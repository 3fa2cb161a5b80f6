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
import torch.nn.functional as F

from .kernels import api as kernels_api

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
    Returns (rel_kept int64 `[T_out]` indices into `src_flat`, counts_out host int64 `[R]`).
    One device-to-host copy: the kept counts.
    """
    bq, hk, length, d = k.shape
    counts = counts_in.tolist()
    k_flat = k.transpose(1, 2).reshape(bq * length, hk, d)
    k_packed = k_flat.index_select(0, src_flat)
    cu_k = to_device(_cumsum0(counts_in).to(torch.int32), q.device)
    q_counts = [min(last_q, c) for c in counts]
    q_flat_idx = _last_tokens(src_flat, counts, q_counts)
    q_packed = q.transpose(1, 2).reshape(q.shape[0] * length, q.shape[1], d).index_select(0, q_flat_idx)
    cu_q = to_device(_cumsum0(torch.tensor(q_counts, dtype=torch.int64)).to(torch.int32), q.device)
    selection = kernels_api.score_and_select(
        q_packed,
        k_packed,
        cu_q,
        cu_k,
        max(counts) if counts else 0,
        scale=scale,
        block_size=block_size,
        p=p,
        keep_ratio=None if keep_ratio < 0 else keep_ratio,
        sink=sink,
        last_q=last_q,
        min_tokens=min_tokens,
        impl=impl,
        host_cu_seqlens=(_host_cumsum(q_counts), _host_cumsum(counts)),
        selection=selection,
    )
    return selection.kept_idx, torch.tensor(selection.kept_counts, dtype=torch.int64)


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


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to `device` without making the host wait for the GPU.

    A copy from pageable host memory to a CUDA device synchronises the stream first (CUDA's
    documented behaviour), which drains the queue of launched kernels and leaves the GPU
    idle while Python issues the next ones; on the H200 such copies were most of the extra
    syncs of a Gemma-3 prefill. A pinned staging copy is asynchronous; PyTorch's caching
    host allocator keeps it alive until the copy has run.
    """
    if host.device == device or device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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


# --------------------------------------------------------------------------------------
# attention with masks rebuilt from ORIGINAL positions
# --------------------------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::dense_mask", mutates_args=())
def dense_mask(q: torch.Tensor, key_valid: torch.Tensor | None, window: int,
               live_counts: torch.Tensor | None = None) -> torch.Tensor:
    """The attention mask of `dense_attention` for `q`'s N tokens, `[B or 1, 1, N, N]`, additive
    (0 / -inf) in q's dtype.

    Built once per (window, padding) and shared by every layer that needs it, as
    transformers shares its masks: at 32K an N x N mask is 1 GiB, and rebuilding it in each
    sliding layer cost more than the attention it masked.

    `live_counts` (host int64 `[B]`, the real tokens per row, known on the host once per
    forward) tells whether `key_valid` pads anything. When it pads nothing, the padding
    term is left out, and a causal mask without a window is not built at all: the result
    is then empty (`[B, 1, 0, 0]`) and `dense_attention` runs SDPA with `is_causal=True`,
    as the plain model does for a prompt without padding.
    """
    n = q.shape[-2]
    if key_valid is not None and live_counts is not None and bool((live_counts == n).all()):
        key_valid = None
    if key_valid is None and (window <= 0 or window >= n):
        return q.new_empty((live_counts.shape[0] if live_counts is not None else 1, 1, 0, 0))
    pos = torch.arange(n, device=q.device)
    if key_valid is None:
        return additive_position_mask(pos, pos, window, q.dtype)[None, None]
    valid = key_valid.bool()
    out = q.new_empty((valid.shape[0], 1, n, n))
    for b in range(valid.shape[0]):
        # A pad query sees no key; it attends to itself (`dense_attention`'s rule) so its row stays finite.
        additive_position_mask(pos, pos, window, q.dtype, key_valid=valid[b], see_self=True, out=out[b, 0])
    return out


def additive_position_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, window: int, dtype: torch.dtype,
                           key_valid: torch.Tensor | None = None, see_self: bool = False,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """`_position_mask(pos_q, pos_k, window)` (and `key_valid[j]`; and `i == j` when `see_self`)
    as an additive `[Q, K]` mask in `dtype`: 0 where visible, -inf elsewhere, written into `out`.

    SDPA takes this form: it converts a boolean mask to it at every call. Built a block of
    query rows at a time, so the boolean temporaries are one block's size: building the whole
    boolean mask first, then its negation and the float mask, held four N x N buffers at once
    (64 GiB at 128K in bf16, more than the model), where the result alone is 32 GiB.
    """
    rows, cols = pos_q.shape[0], pos_k.shape[0]
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=pos_q.device)
    step = max(1, _MASK_BLOCK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        visible = _position_mask(pos_q[start:stop], pos_k, window)
        if key_valid is not None:
            visible &= key_valid[None, :]
        if see_self:
            visible |= torch.arange(cols, device=pos_q.device)[None, :] == torch.arange(
                start, stop, device=pos_q.device)[:, None]
        out[start:stop].zero_().masked_fill_(visible.logical_not_(), float("-inf"))
    return out


_MASK_BLOCK_ELEMENTS = 1 << 26  # boolean entries per block of `additive_position_mask` (64 MiB)


@dense_mask.register_fake
def _(q, key_valid, window, live_counts=None):
    rows = key_valid.shape[0] if key_valid is not None else 1
    size = torch.library.get_ctx().new_dynamic_size()  # N, or 0 when no mask is needed
    return q.new_empty((rows, 1, size, size))


@torch.library.custom_op(f"{LIB}::dense_attention", mutates_args=())
def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    window: int,
    scale: float,
    enable_gqa: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention on dense `[B, H, N, d]` tensors.

    Key j is visible to query i when `0 <= i - j < window` (window 0: unbounded) and
    `key_valid[b, j]` (left padding). A query that sees no key (a pad token) attends to
    itself so the row stays finite; such rows are never read. `mask`, when given, is
    `dense_mask(q, key_valid, window, live_counts)` computed once for several layers; an
    empty one means that no mask is needed (causal, nothing padded).
    """
    n = q.shape[-2]
    if (key_valid is None and (window <= 0 or window >= n)) or (mask is not None and mask.numel() == 0):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if mask is None:
        mask = dense_mask(q, key_valid, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


@dense_attention.register_fake
def _(q, k, v, key_valid, window, scale, enable_gqa, mask=None):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


@torch.library.custom_op(f"{LIB}::packed_masks", mutates_args=())
def packed_masks(q: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor, window: int,
                 compacted: bool = False) -> torch.Tensor:
    """Every row's `packed_attention` mask, flattened and concatenated: `[sum(c_r ** 2)]`,
    additive (0 / -inf) in q's dtype.

    `compacted`: measure the window over the row's kept-token indices instead of the
    ORIGINAL `positions` (`UniPrefillConfig.window_positions="compacted"`, an ablation).

    Built once per (layout, window) and shared by every sliding layer of that layout, as
    `dense_mask` is before the first drop point.
    """
    sizes = counts.tolist()
    out = q.new_empty(sum(c * c for c in sizes))
    start = offset = 0
    for count in sizes:
        pos = torch.arange(count, device=positions.device) if compacted else positions[start:start + count]
        additive_position_mask(pos, pos, window, q.dtype, out=out[offset:offset + count * count].view(count, count))
        start, offset = start + count, offset + count * count
    return out


@packed_masks.register_fake
def _(q, positions, counts, window, compacted=False):
    ctx = torch.library.get_ctx()
    return q.new_empty(ctx.new_dynamic_size())


@torch.library.custom_op(f"{LIB}::packed_attention", mutates_args=())
def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    counts: torch.Tensor,
    window: int,
    scale: float,
    enable_gqa: bool,
    masks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-diagonal causal attention on packed `[1, H, T, d]` tensors.

    Row r owns tokens `[cu[r], cu[r+1])` (`counts` host int64 `[R]`); `positions` int64
    `[T]` are the ORIGINAL token positions. Key j is visible to query i of the same row when
    `0 <= pos_i - pos_j < window` (window 0: unbounded), so sliding windows stay windows
    over original positions after tokens were dropped. `masks`, when given, is
    `packed_masks(q, positions, counts, window, compacted)` computed once for several layers.
    """
    if window > 0 and masks is None:
        masks = packed_masks(q, positions, counts, window)
    outs = []
    start = offset = 0
    for count in counts.tolist():
        end = start + count
        qr, kr, vr = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        if window <= 0:
            # Positions increase along a row, so causal in positions == causal in index.
            outs.append(F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale, enable_gqa=enable_gqa))
        else:
            mask = masks[offset:offset + count * count].view(1, 1, count, count)
            outs.append(F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale, enable_gqa=enable_gqa))
        start, offset = end, offset + count * count
    return torch.cat(outs, dim=2) if len(outs) != 1 else outs[0]


@packed_attention.register_fake
def _(q, k, v, positions, counts, window, scale, enable_gqa, masks=None):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _position_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, window: int) -> torch.Tensor:
    """`0 <= pos_q[i] - pos_k[j] < window` (window 0: unbounded), as broadcast comparisons of
    the position vectors, so no `[Q, K]` int64 difference is materialised (8 GiB at 32K)."""
    mask = pos_k[None, :] <= pos_q[:, None]
    if window > 0:
        mask = mask & (pos_k[None, :] > (pos_q - window)[:, None])
    return mask


@torch.library.custom_op(f"{LIB}::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_positions: torch.Tensor,
    query_position: int,
    window: int,
    scale: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """One decode query `[1, H, 1, d]` against a (possibly compacted) cache `[1, Hk, K, d]`.

    `key_positions` int64 `[K]` are the ORIGINAL positions of the cached keys; key j is
    visible when `0 <= query_position - key_positions[j] < window` (window 0: unbounded).
    """
    # compared with the Python int directly: a one-element tensor would be a host-to-device
    # copy (and a stream sync) per layer per decode step
    mask = key_positions <= query_position
    if window > 0:
        mask = mask & (key_positions > query_position - window)
    mask = mask.to(q.device)[None, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


@decode_attention.register_fake
def _(q, k, v, key_positions, query_position, window, scale, enable_gqa):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


# --------------------------------------------------------------------------------------
# sparse_attention: block-sparse attention before the first drop point (config.early_sparse_*)
# --------------------------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::sparse_attention", mutates_args=())
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
    p: float,
    keep: float,
    window: int,
    last_q: int,
    sink: int,
    min_tokens: int,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention on dense `[B, H, N, d]` tensors, block-sparse where it may be.

    The pattern is `kernels.sparse_attention.select_key_blocks` (top-p `p` of the last
    `last_q` queries' content attention per head, or the forced share `keep` when > 0; the
    `sink` tokens and a local band of `window` tokens always). Returns (output, density), the
    density a 0-d fp32 tensor (selected causal blocks / all; 1 when dense). Runs dense, exactly
    as `dense_attention`, when the prompt is shorter than `min_tokens` or rows are padded
    (`mask` is `dense_mask`'s output: empty when nothing is padded). `impl`: the config's;
    "torch" runs the reference, otherwise flex_attention on CUDA and the reference elsewhere,
    or flex_attention unfused on the CPU for "triton".
    """
    from .kernels import sparse_attention as sparse

    n = q.shape[-2]
    padded = key_valid is not None and (mask is None or mask.numel() > 0)
    if padded or n < max(min_tokens, 2 * sparse.SPARSE_BLOCK):
        out = dense_attention(q, k, v, key_valid, 0, scale, q.shape[1] != k.shape[1], mask)
        return out, torch.ones((), dtype=torch.float32, device=q.device)
    blocks, density = sparse.select_key_blocks(q, k, scale, last_q=last_q, sink=sink, window=window,
                                               p=None if keep > 0 else p, keep=keep if keep > 0 else None)
    run = "torch" if impl == "torch" or (impl == "auto" and not q.is_cuda) else "flex"
    return sparse.block_sparse_attention(q, k, v, blocks, scale=scale, impl=run), density


@sparse_attention.register_fake
def _(q, k, v, key_valid, mask, scale, p, keep, window, last_q, sink, min_tokens, impl):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],)), q.new_empty((), dtype=torch.float32)
