"""Attention with learned per-head sinks (GPT-OSS and its kin), as `torch.library` ops.

A sink is one extra logit per query head, `s_h`, that joins every query's softmax and is
dropped after it (transformers' `eager_attention_forward` of GPT-OSS: `cat([logits, sinks])`,
softmax, `[..., :-1]`). For query i with visible keys j:

    p_ij = exp(l_ij - m_i) / (sum_j' exp(l_ij' - m_i) + exp(s_h - m_i)),  m_i = max(max_j l_ij, s_h)

i.e. attention whose normaliser has one extra term; the weights of a row sum to less than one.
A query that sees no key at all gets the zero vector (only the sink), not NaN.

The same ops compute the other eager forms SDPA cannot: logits soft-capped as
`softcap * tanh(logits / softcap)` (Gemma-2, `softcap` != 0), with or without sinks (`sinks` None),
and a softmax taken in float32 on half-precision logits (`upcast`), and a per-key bias added to
the scaled logits (`key_bias`, times `bias_scale`: ALiBi, Bloom's `baddbmm(alibi, q, k^T, beta, alpha)`).
A per-key bias is the same for every query, so after a drop each kept key keeps its own value:
the packed op reads it at the kept keys' ORIGINAL positions (the model's own values, exact), or,
with `bias_follows` (a bias computed from each key's own token, Doge's: `passes.kept_key_bias`),
takes it as the layer computed it on the kept keys, sliced by row like the keys themselves.

Ops (each with a fake; `sink_attention_reference` is the one PyTorch implementation they share):

* `sink_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)`: the
  model's own pattern as one node, with SDPA's argument names (`passes.sink_attention` puts it
  into the graph, so the passes read it as they read an SDPA call); `attn_mask` is any mask the
  model built (boolean: True = visible, or additive).
* `dense_sink_attention` / `packed_sink_attention`: `attention_ops.dense_attention` / `packed_attention`
  with sinks: causal, sliding-window and padding masks rebuilt from ORIGINAL positions, and the
  shared masks of `attention_ops.dense_mask` / `attention_ops.packed_masks`.
* `decode_sink_attention`: `attention_ops.decode_attention` with sinks (decode steps after a drop).
* `table_mask`: the additive mask of a site whose causal mask is sliced from a table the model holds
  (GPT-Neo, OpenAI-GPT: `passes.causal_table`), joined to the model's own additive mask.

The logits are built a block of query rows at a time, as the model builds all of them at once:
the same arithmetic (matmul, scale, mask, concatenated sink, max subtracted, softmax, sink
column dropped, matmul with v) in the same order, so p = 1 reproduces the plain model.
"""

from __future__ import annotations

import torch

from . import ops as _ops  # noqa: F401  (registers dense_mask / packed_masks, read below)
from .ops import _position_mask

LIB = "uniprefill"
_BLOCK_ELEMENTS = 1 << 24  # logits of one block of query rows (B * H * rows * K)


def sink_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                             scale: float, sinks: torch.Tensor | None, causal: bool = False,
                             softcap: float = 0.0, upcast: bool = False, key_bias: torch.Tensor | None = None,
                             bias_scale: float = 1.0) -> torch.Tensor:
    """`[B, H, Q, d]` queries against `[B, Hk, K, d]` keys/values (Hk divides H) with sinks `[H]`.

    `mask` broadcasts to `[B, H, Q, K]`: boolean (True = visible) or additive; None: all visible.
    `causal`: besides, query i sees keys j <= i only (built per block: no `[Q, K]` mask in memory).
    `softcap` != 0: the scaled logits become `softcap * tanh(logits / softcap)` before the mask
    (Gemma-2's eager attention). `sinks` None: no sink column; hidden keys then get the most
    negative finite logit, as transformers' additive masks give them, so a query that sees no key
    gets finite weights (a padding row) instead of NaN. `upcast`: the softmax runs in float32 and its
    weights are cast back (transformers' `softmax(..., dtype=torch.float32).to(query.dtype)`).
    `key_bias` (`key_bias_4d`: one value per key, per head and row) times `bias_scale` is added to the
    scaled logits before the mask (ALiBi).
    """
    b, h, rows, _ = q.shape
    groups = h // k.shape[1]
    if groups != 1:  # transformers' repeat_kv: each key/value head serves `groups` query heads in a row
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    keys = k.shape[-2]
    step = max(1, _BLOCK_ELEMENTS // max(1, b * h * keys))
    outs = []
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        logits = torch.matmul(q[:, :, start:stop], k.transpose(2, 3)) * scale
        if softcap != 0:  # c * tanh(x / c) is the same function for c and -c
            logits = torch.tanh(logits / softcap) * softcap
        if key_bias is not None:
            logits = logits + key_bias_4d(key_bias, h) * bias_scale
        hidden_logit = float("-inf") if sinks is not None else torch.finfo(logits.dtype).min
        if causal:
            hidden = _position_mask(torch.arange(start, stop, device=q.device), torch.arange(keys, device=q.device), 0)
            logits = logits.masked_fill(hidden.logical_not_(), hidden_logit)
        if mask is not None:
            part = mask[..., start:stop, :] if mask.shape[-2] != 1 else mask
            if part.dtype == torch.bool:
                logits = logits.masked_fill(part.logical_not(), hidden_logit)
            else:
                logits = logits + part
        if sinks is None:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32 if upcast else logits.dtype)
            outs.append(torch.matmul(probs.to(v.dtype), v))
            continue
        sink = sinks.reshape(1, -1, 1, 1).expand(logits.shape[0], -1, logits.shape[2], -1)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=torch.float32 if upcast else combined.dtype)
        outs.append(torch.matmul(probs[..., :-1].to(v.dtype), v))
    return torch.cat(outs, dim=2) if len(outs) != 1 else outs[0]


def key_bias_4d(bias: torch.Tensor, heads: int) -> torch.Tensor:
    """A per-key bias as `[B | 1, H | 1, 1, K]`: 4-D as it is, or with `Hk` key heads repeated to `H`
    as transformers' `repeat_kv` repeats them (Doge's `[B, Hk, 1, K]`); 3-D `[B * H, 1, K]` (heads
    merged into the batch axis, Bloom's) split; any other 3-D one broadcast as a 4-D add broadcasts it."""
    if bias.dim() == 4:
        if bias.shape[1] not in (1, heads) and heads % bias.shape[1] == 0:
            return bias.repeat_interleave(heads // bias.shape[1], dim=1)
        return bias
    if bias.dim() == 3 and bias.shape[0] % heads == 0 and bias.shape[1] == 1:
        return bias.view(bias.shape[0] // heads, heads, 1, bias.shape[-1])
    return bias[None]


def _check(q: torch.Tensor, k: torch.Tensor, sinks: torch.Tensor | None) -> None:
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[1]):
        raise ValueError(f"sinks must be [H] = [{q.shape[1]}] (one per query head), got {tuple(sinks.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")


def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[:-1] + (v.shape[-1],), dtype=v.dtype)


# --------------------------------------------------------------------------------------
# the model's pattern as one node
# --------------------------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::sink_attention", mutates_args=())
def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float = 1.0, enable_gqa: bool = False,
                   sinks: torch.Tensor | None = None, softcap: float = 0.0, upcast: bool = False,
                   key_bias: torch.Tensor | None = None, bias_scale: float = 1.0,
                   bias_follows: bool = False) -> torch.Tensor:
    """Eager attention with sinks `[H]`, logit soft-capping and / or a per-key bias, SDPA's arguments
    plus `sinks`, `softcap`, `key_bias` and `bias_scale` (`dropout_p` must be 0). `bias_follows`
    marks a bias computed from each key's own token (it changes nothing here: the keys are all there)."""
    if dropout_p != 0.0:
        raise ValueError(f"uniprefill::sink_attention runs inference only (dropout_p={dropout_p})")
    _check(q, k, sinks)
    return sink_attention_reference(q, k, v, attn_mask, scale, sinks, causal=is_causal, softcap=softcap, upcast=upcast,
                                    key_bias=key_bias, bias_scale=bias_scale)


@sink_attention.register_fake
def _(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=1.0, enable_gqa=False, sinks=None, softcap=0.0,
      upcast=False, key_bias=None, bias_scale=1.0, bias_follows=False):
    return _out_like(q, v)


# --------------------------------------------------------------------------------------
# dense and packed layouts, masks from ORIGINAL positions (attention_ops.dense_attention / packed_attention)
# --------------------------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::dense_sink_attention", mutates_args=())
def dense_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                         window: int, scale: float, sinks: torch.Tensor | None,
                         mask: torch.Tensor | None = None, softcap: float = 0.0, upcast: bool = False,
                         key_bias: torch.Tensor | None = None, bias_scale: float = 1.0) -> torch.Tensor:
    """`attention_ops.dense_attention` with sinks `[H]`: causal attention on dense `[B, H, N, d]` tensors, key j
    visible to query i when `0 <= i - j < window` (0: unbounded) and `key_valid[b, j]`. `mask` is
    the shared `attention_ops.dense_mask(q, key_valid, window, live_counts)`; an empty one: causal only.
    `key_bias`: the model's per-key bias over all N keys (`key_bias_4d`), times `bias_scale`."""
    _check(q, k, sinks)
    n = q.shape[-2]
    extra = dict(softcap=softcap, upcast=upcast, key_bias=key_bias, bias_scale=bias_scale)
    if mask is None and not (key_valid is None and (window <= 0 or window >= n)):
        mask = torch.ops.uniprefill.dense_mask(q, key_valid, window)
    if mask is None or mask.numel() == 0:  # causal, nothing padded
        return sink_attention_reference(q, k, v, None, scale, sinks, causal=True, **extra)
    return sink_attention_reference(q, k, v, mask, scale, sinks, **extra)


@dense_sink_attention.register_fake
def _(q, k, v, key_valid, window, scale, sinks, mask=None, softcap=0.0, upcast=False, key_bias=None, bias_scale=1.0):
    return _out_like(q, v)


@torch.library.custom_op(f"{LIB}::packed_sink_attention", mutates_args=())
def packed_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          counts: torch.Tensor, window: int, scale: float, sinks: torch.Tensor | None,
                          masks: torch.Tensor | None = None, softcap: float = 0.0,
                          upcast: bool = False, key_bias: torch.Tensor | None = None,
                          bias_scale: float = 1.0, bias_follows: bool = False) -> torch.Tensor:
    """`attention_ops.packed_attention` with sinks `[H]`: block-diagonal causal attention on packed
    `[1, H, T, d]` tensors (row r owns `counts[r]` tokens), windows over ORIGINAL `positions`;
    `masks` is the shared `ops.packed_masks(q, positions, counts, window, compacted)`. `key_bias`: the
    model's per-key bias over the ORIGINAL `[B, N]` grid (`key_bias_4d`), read at each row's kept keys;
    with `bias_follows`, the bias of the packed keys themselves (`[1, Hk | H, 1, T]`), sliced by row."""
    _check(q, k, sinks)
    bias = key_bias_4d(key_bias, q.shape[1]) if key_bias is not None else None
    if window > 0 and masks is None:
        masks = torch.ops.uniprefill.packed_masks(q, positions, counts, window)
    outs = []
    start = offset = 0
    for count in counts.tolist():
        end = start + count
        # window 0: positions increase along a row, so causal in positions == causal in index
        mask = masks[offset:offset + count * count].view(1, 1, count, count) if window > 0 else None
        row_bias = None
        if bias is not None and bias_follows:  # computed on the packed keys: the row's own slice
            row_bias = bias[..., start:end]
        elif bias is not None:  # the row's kept keys at their original positions
            row = bias[len(outs) if bias.shape[0] > 1 else 0]
            row_bias = row[None].index_select(-1, positions[start:end].to(row.device))
        outs.append(sink_attention_reference(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], mask,
                                             scale, sinks, causal=window <= 0, softcap=softcap, upcast=upcast,
                                             key_bias=row_bias, bias_scale=bias_scale))
        start, offset = end, offset + count * count
    return torch.cat(outs, dim=2) if len(outs) != 1 else outs[0]


@packed_sink_attention.register_fake
def _(q, k, v, positions, counts, window, scale, sinks, masks=None, softcap=0.0, upcast=False, key_bias=None,
      bias_scale=1.0, bias_follows=False):
    return _out_like(q, v)


@torch.library.custom_op(f"{LIB}::decode_sink_attention", mutates_args=())
def decode_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_positions: torch.Tensor | None,
                          query_position: int, window: int, scale: float, sinks: torch.Tensor | None,
                          softcap: float = 0.0, upcast: bool = False) -> torch.Tensor:
    """`attention_ops.decode_attention` with sinks `[H]`: one query `[1, H, 1, d]` against a (possibly
    compacted) cache `[1, Hk, K, d]`; key j visible when `0 <= query_position - key_positions[j] <
    window` (0: unbounded). `key_positions` None: every cached key is visible."""
    _check(q, k, sinks)
    mask = None
    if key_positions is not None:
        visible = key_positions <= query_position
        if window > 0:
            visible = visible & (key_positions > query_position - window)
        mask = visible.to(q.device)[None, None, None, :]
    return sink_attention_reference(q, k, v, mask, scale, sinks, softcap=softcap, upcast=upcast)


@decode_sink_attention.register_fake
def _(q, k, v, key_positions, query_position, window, scale, sinks, softcap=0.0, upcast=False):
    return _out_like(q, v)


# --------------------------------------------------------------------------------------
# a causal mask sliced from a table the model holds (`passes.causal_table`)
# --------------------------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::table_mask", mutates_args=())
def table_mask(table: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of a site whose logits a table slice masks (GPT-Neo, OpenAI-GPT): `mask`
    (the model's additive mask, e.g. padding; None: 0) where the slice is non-zero, the most negative
    float of `dtype` elsewhere; broadcast to both shapes, in `mask`'s dtype when given."""
    dtype = mask.dtype if mask is not None else dtype
    visible = table != 0
    shown = mask if mask is not None else torch.zeros((), dtype=dtype, device=table.device)
    return torch.where(visible, shown, torch.finfo(dtype).min).to(dtype)


@table_mask.register_fake
def _(table, mask, dtype):
    dtype = mask.dtype if mask is not None else dtype
    shape = torch.broadcast_shapes(table.shape, mask.shape) if mask is not None else table.shape
    return table.new_empty(shape, dtype=dtype)
