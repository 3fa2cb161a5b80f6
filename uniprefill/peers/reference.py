"""PyTorch reference of block-sparse causal attention, and the CPU stand-in peer built on it.

`block_sparse_attention` computes exactly what FlexPrefill's Triton block kernel computes
(`triton_block_wise_attention`): causal attention where query block i sees key block j only
if (i, j) is selected. At full selection it is plain causal attention, which is what the
adapter tests on CPU check against the model's own SDPA path.
"""

from __future__ import annotations

import math

import torch


def causal_block_count(num_blocks: int) -> int:
    return num_blocks * (num_blocks + 1) // 2


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, h_kv, n, d] -> [b, h_kv * groups, n, d] (each key head serves `groups` query heads)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                           block_size: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention restricted to selected (query block, key block) pairs.

    Args:
        q: [batch, heads, n, d]; k, v: [batch, kv_heads, n, d] (kv_heads divides heads).
        blocks: bool [batch, heads, num_blocks, num_blocks]; entries above the diagonal are ignored.
        block_size: tokens per block (the last block may be short).
    Returns:
        [batch, heads, n, d] in q's dtype. A query whose selected keys are all masked (cannot
        happen when the diagonal block is selected) gets zeros.
    """
    b, h, n, d = q.shape
    if blocks.shape != (b, h, math.ceil(n / block_size), math.ceil(n / block_size)):
        raise ValueError(f"blocks has shape {tuple(blocks.shape)}, expected "
                         f"{(b, h, math.ceil(n / block_size), math.ceil(n / block_size))}")
    groups = h // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    token_block = torch.arange(n, device=q.device) // block_size
    allowed = blocks[:, :, token_block][:, :, :, token_block]  # [b, h, n, n]
    allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = (q.float() @ k.float().transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ v.float()).to(q.dtype)


def standin_blocks(b: int, h: int, num_blocks: int, keep: float, device) -> torch.Tensor:
    """The stand-in's selection: per query block, the sink block, the diagonal block and the
    nearest earlier blocks, `keep` of its causal blocks in all (rounded up)."""
    i = torch.arange(num_blocks, device=device)[:, None]
    j = torch.arange(num_blocks, device=device)[None, :]
    budget = torch.ceil(keep * (i + 1).float())
    selected = (j <= i) & ((i - j) < budget) | (j == 0)
    return selected.expand(b, h, num_blocks, num_blocks)
