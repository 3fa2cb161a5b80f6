"""Block-sparse causal attention for the layers before the first drop point.

Token dropping leaves the layers before the first drop point at full length, and at long
prompts most of their time is the N x N attention. This module makes that attention
block-sparse with a pattern chosen from the same statistic the drop points use: the softmax
attention of the last `last_q` queries.

Pattern (per batch row and query head, blocks of `SPARSE_BLOCK` tokens):

* the key blocks holding the first `sink` tokens (attention sinks);
* a local band: query block i sees key blocks i - ceil(window / SPARSE_BLOCK) .. i, so every
  query sees at least its `window` preceding tokens;
* "vertical" key blocks: the blocks the last queries attend to most, seen by every later
  query block. Chosen per head by top-p over the blocks outside the sink and the last band
  (p is the share of that *content* attention, as `selection="content"` at a drop point), or
  by a forced share `keep` of those blocks.

`select_key_blocks` returns the (query block, key block) pattern and its density (selected
causal blocks / all causal blocks). `block_sparse_attention` runs it: "flex" through PyTorch's
`flex_attention` with a `BlockMask` built from the pattern (compiled to a fused Triton kernel
on CUDA; on the CPU it runs unfused, exactly, for tests), "torch" through
`block_sparse_attention_reference`, a dense masked softmax in fp32 that is the definition.
At p = 1 (or keep = 1) every causal block is selected and both equal causal attention.
"""

from __future__ import annotations

import functools
import math

import torch

from ._common import cdiv

SPARSE_BLOCK = 128  # tokens per block of the pattern (flex_attention's default block size)


def block_scores(q: torch.Tensor, k: torch.Tensor, scale: float, *, last_q: int, block_size: int) -> torch.Tensor:
    """Mean softmax attention each key block receives from the last `last_q` queries, per head.

    q: [B, H, N, d]; k: [B, Hk, N, d] (Hk divides H). Returns fp32 [B, H, ceil(N / block_size)].
    One key head's query group at a time, so the fp32 logits stay at B * (H / Hk) * last_q * N.
    """
    b, h, n, _ = q.shape
    hk = k.shape[1]
    groups = h // hk
    last = min(last_q, n)
    nb = cdiv(n, block_size)
    q_pos = torch.arange(n - last, n, device=q.device)[:, None]
    future = torch.arange(n, device=q.device)[None, :] > q_pos  # [last, N]
    per_block = torch.full((nb,), float(block_size), device=q.device)
    per_block[-1] = n - (nb - 1) * block_size
    out = torch.empty(b, h, nb, dtype=torch.float32, device=q.device)
    for kh in range(hk):
        qg = q[:, kh * groups:(kh + 1) * groups, n - last:].float()
        logits = (qg @ k[:, kh:kh + 1].float().transpose(-1, -2)) * scale  # [B, g, last, N]
        weights = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1).sum(2)  # [B, g, N]
        weights = torch.nn.functional.pad(weights, (0, nb * block_size - n))
        out[:, kh * groups:(kh + 1) * groups] = weights.view(b, groups, nb, block_size).sum(-1) / per_block
    return out


def select_key_blocks(q: torch.Tensor, k: torch.Tensor, scale: float, *, last_q: int, sink: int, window: int,
                      p: float | None = None, keep: float | None = None,
                      block_size: int = SPARSE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The block pattern of the module docstring: bool [B, H, nb, nb] (entries above the
    diagonal False) and its density, a 0-d fp32 tensor on q's device (no host sync)."""
    if (p is None) == (keep is None):
        raise ValueError("give exactly one of p (top-p of the content attention) and keep (a share of the blocks)")
    for name, value in (("p", p), ("keep", keep)):
        if value is not None and not 0.0 < value <= 1.0:
            raise ValueError(f"{name}={value} must be in (0, 1]")
    n = q.shape[-2]
    nb = cdiv(n, block_size)
    device = q.device
    idx = torch.arange(nb, device=device)
    band = cdiv(max(window, 0), block_size)
    sink_blocks = idx < cdiv(sink, block_size)
    forced = sink_blocks | (idx >= nb - 1 - band)  # what the last queries see anyway
    # forced blocks rank last (-1) and never count toward p
    scores = block_scores(q, k, scale, last_q=last_q, block_size=block_size).masked_fill(forced, -1.0)
    order = torch.argsort(scores, dim=-1, descending=True)
    if keep is not None:
        free = int((~forced).sum())
        rank_kept = torch.arange(nb, device=device) < math.ceil(keep * free)
    else:
        ranked = torch.gather(scores, -1, order).clamp(min=0.0)
        total = ranked.sum(-1, keepdim=True)
        before = ranked.cumsum(-1) - ranked  # the share held by the blocks ranked above
        rank_kept = (before < p * total) & (ranked > 0)
    vertical = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, rank_kept.expand_as(order))
    vertical &= ~forced
    i, j = idx[:, None], idx[None, :]
    blocks = (j <= i) & (sink_blocks[None, :] | (i - j <= band) | vertical[..., None, :])
    density = blocks.sum(dtype=torch.float32) / (blocks.shape[0] * blocks.shape[1] * nb * (nb + 1) / 2)
    return blocks, density


def block_sparse_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                                     block_size: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention where query block i sees key block j only if blocks[b, h, i, j].

    q: [B, H, N, d]; k, v: [B, Hk, N, d]; blocks: bool [B, H, nb, nb]. Dense fp32 softmax; a
    query that sees no key gets zeros (cannot happen when the diagonal block is selected).
    """
    b, h, n, d = q.shape
    nb = cdiv(n, block_size)
    if blocks.shape != (b, h, nb, nb):
        raise ValueError(f"blocks has shape {tuple(blocks.shape)}, expected {(b, h, nb, nb)}")
    groups = h // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    token_block = torch.arange(n, device=q.device) // block_size
    allowed = blocks[:, :, token_block][:, :, :, token_block]
    allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = (q.float() @ k.float().transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return (weights @ v.float()).to(q.dtype)


def _pattern_mod(blocks: torch.Tensor, block_size: int):
    """flex_attention's mask function of the pattern: causal, and inside a selected block.

    The compiled kernel visits only the blocks the `BlockMask` lists and applies this on the
    diagonal ones; the unfused (CPU) path applies it everywhere. Both then compute the same."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & blocks[b, h, q_idx // block_size, kv_idx // block_size]

    return mask_mod


def _kv_lists(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) per query block of a bool [B, H, nb, nb], selected key blocks first."""
    counts = selected.sum(-1, dtype=torch.int32)
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts, order


def flex_block_mask(blocks: torch.Tensor, n: int, block_size: int = SPARSE_BLOCK):
    """A flex_attention `BlockMask` for the pattern: off-diagonal blocks are full (no mask
    function runs there), the diagonal blocks apply the causal mask."""
    from torch.nn.attention.flex_attention import BlockMask

    nb = blocks.shape[-1]
    diagonal = torch.eye(nb, dtype=torch.bool, device=blocks.device)
    partial_counts, partial_idx = _kv_lists(blocks & diagonal)
    full_counts, full_idx = _kv_lists(blocks & ~diagonal)
    return BlockMask.from_kv_blocks(partial_counts, partial_idx, full_counts, full_idx,
                                    BLOCK_SIZE=block_size, mask_mod=_pattern_mod(blocks, block_size),
                                    seq_lengths=(n, n))


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # automatic dynamic shapes: the second prompt length compiles once for every later one; a new
    # pattern (the mask function's captured tensor) is an input, not a recompile
    return torch.compile(flex_attention)


def _eager_flex(*args, **kwargs):
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # "called without torch.compile()": unfused on purpose here
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(*args, **kwargs)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, *,
                           scale: float, impl: str = "flex", block_size: int = SPARSE_BLOCK) -> torch.Tensor:
    """Run the pattern: impl "flex" (fused on CUDA, unfused on the CPU) or "torch" (the reference)."""
    if impl == "torch":
        return block_sparse_attention_reference(q, k, v, blocks, block_size, scale)
    if impl != "flex":
        raise ValueError(f"impl={impl!r} is not 'flex' or 'torch'")
    mask = flex_block_mask(blocks, q.shape[-2], block_size)
    run = _compiled_flex() if q.is_cuda else _eager_flex
    return run(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
