"""The PyTorch reference of block-sparse causal attention: dense float32 scores, masked by the
block pattern (`sparse_attention/__init__.py` says how the pattern is chosen)."""

from __future__ import annotations

import torch

from .._common import cdiv


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
