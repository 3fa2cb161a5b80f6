"""The attention ops of the token-drop rewrite: attention whose masks are rebuilt from ORIGINAL
token positions, so a causal or sliding-window layer after a drop sees exactly the keys it saw in
the unpruned model (`uniprefill.ops` holds the selection and token-layout ops).

* `dense_mask` / `dense_attention`: layers before the first drop point, `[B, H, N, d]` with
  padding (`key_valid`), one mask shared by the layers of a (window, padding).
* `packed_masks` / `packed_attention`: layers after a drop, on the packed kept tokens
  (`[1, H, T, d]`, per-row counts on the host), one block-diagonal mask per forward.
* `packed_visibility`: the causal mask of the packed kept tokens as a tensor, for DeepSeek sparse
  attention layers after a drop, which read their causal mask themselves.
* `decode_attention`: a decode step against a cache whose rows kept different tokens.
* `sparse_attention`: the block-sparse early layers of `early_sparse_p` (docs/sparse-prefill.md).

Each op has a fake, so graphs containing them stay traceable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


LIB = "uniprefill"


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


@torch.library.custom_op(f"{LIB}::packed_visibility", mutates_args=())
def packed_visibility(like: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The causal mask of the packed kept tokens as one `[1, 1, T, T]` tensor in `like`'s form
    (bool: True = visible; floating: 0 / dtype min): key j is visible to query i when both are of
    the same row and `positions[j] <= positions[i]` (ORIGINAL positions). It stands for a causal
    (+ padding) mask the graph built over all tokens where a DeepSeek sparse attention layer reads
    that mask itself after a drop (`passes/indexer_mask.py`): its indexer's causal fill and its
    attention's causal part. Padding tokens are never kept, so no padding part is needed."""
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=positions.device), counts.to(positions.device))
    visible = (rows[:, None] == rows[None, :]) & _position_mask(positions, positions, 0)
    if like.dtype != torch.bool:
        visible = torch.zeros((), dtype=like.dtype, device=like.device).masked_fill(
            ~visible, torch.finfo(like.dtype).min)
    return visible.to(like.device)[None, None]


@packed_visibility.register_fake
def _(like, positions, counts):
    return like.new_empty((1, 1, positions.shape[0], positions.shape[0]))


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
