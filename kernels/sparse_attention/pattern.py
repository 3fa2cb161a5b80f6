"""The block pattern of sparse prefill attention: key blocks per query block, chosen from the
softmax attention of the last `last_q` queries (`sparse_attention/__init__.py` says what is kept)."""

from __future__ import annotations

import math

import torch

from .._common import cdiv

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
