"""PyTorch reference of block scoring: readable, not fast.

It follows the definition in `uniprefill.kernels.api.score_blocks` literally, one sequence at
a time, and materialises each sequence's [heads, queries, keys] score matrix in float32, a few
heads at a time so that memory stays bounded (`_SCORE_ELEMENTS` floats per chunk). The Triton
kernel (`kernel.py`) is tested against it; it runs on any device (host loops, host syncs).
"""

from __future__ import annotations

import torch

from .._common import cdiv
from ..validation import VarlenLayout

# Score-matrix elements materialised at once (256 MiB of float32).
_SCORE_ELEMENTS = 1 << 26


def score_blocks_reference(
    q: torch.Tensor, k: torch.Tensor, layout: VarlenLayout, *, block_size: int, scale: float
) -> torch.Tensor:
    """Block scores, float32 [total_blocks]; see `api.score_blocks` for the definition."""
    group = q.shape[1] // k.shape[1]
    out = []
    q_start = k_start = 0
    for n_q, n_k in zip(layout.seqlens_q, layout.seqlens_k):
        q_i = q[q_start : q_start + n_q].float()
        k_i = k[k_start : k_start + n_k].float()
        q_start, k_start = q_start + n_q, k_start + n_k
        if n_k == 0:
            continue
        token = token_scores(q_i, k_i, group, scale)
        out.append(block_means(token, block_size))
    if not out:
        return torch.zeros(0, dtype=torch.float32, device=q.device)
    return torch.cat(out)


def token_scores(q_i: torch.Tensor, k_i: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """sum over heads of mean over queries of softmax(q k^T * scale), causal: [n_k]."""
    n_q, n_k = q_i.shape[0], k_i.shape[0]
    positions = torch.arange(n_k - n_q, n_k, device=q_i.device)
    hidden = torch.arange(n_k, device=q_i.device)[None, :] > positions[:, None]  # [n_q, n_k]
    heads_at_once = max(1, min(group, _SCORE_ELEMENTS // max(1, n_q * n_k)))
    token = torch.zeros(n_k, dtype=torch.float32, device=q_i.device)
    for kv_head in range(k_i.shape[1]):
        keys = k_i[:, kv_head]  # [n_k, d]
        for h0 in range(0, group, heads_at_once):
            heads = slice(kv_head * group + h0, kv_head * group + min(group, h0 + heads_at_once))
            scores = torch.einsum("qhd,kd->hqk", q_i[:, heads], keys) * scale
            scores.masked_fill_(hidden, float("-inf"))
            token += torch.softmax(scores, dim=-1).sum(dim=(0, 1)) / n_q
    return token


def block_means(token: torch.Tensor, block_size: int) -> torch.Tensor:
    n_k = token.shape[0]
    n_blocks = cdiv(n_k, block_size)
    padded = torch.zeros(n_blocks * block_size, dtype=token.dtype, device=token.device)
    padded[:n_k] = token
    return padded.view(n_blocks, block_size).sum(1) / block_token_counts(n_k, block_size, token.device)


def block_offsets(cu_seqlens_k: torch.Tensor, block_size: int) -> torch.Tensor:
    """cu_blocks int32 [B+1] from cu_seqlens_k, on device, without a host sync."""
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    cu_blocks = torch.zeros(cu_seqlens_k.shape[0], dtype=torch.int32, device=cu_seqlens_k.device)
    cu_blocks[1:] = torch.cumsum((lengths + block_size - 1) // block_size, dim=0)
    return cu_blocks


def block_token_counts(n_tokens: int, block_size: int, device) -> torch.Tensor:
    """Real tokens in each block of one sequence (the last block may be partial)."""
    starts = torch.arange(0, n_tokens, block_size, device=device)
    return (n_tokens - starts).clamp(max=block_size)
