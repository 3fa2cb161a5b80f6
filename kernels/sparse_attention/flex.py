"""Block-sparse causal attention through PyTorch's flex_attention: the pattern as a `BlockMask`
(off-diagonal blocks full, diagonal blocks causal), compiled on CUDA, unfused on the CPU."""

from __future__ import annotations

import functools

import torch

from .pattern import SPARSE_BLOCK


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


def run_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, *, scale: float,
             block_size: int = SPARSE_BLOCK) -> torch.Tensor:
    """The pattern through flex_attention: fused (compiled) on CUDA, unfused on the CPU."""
    mask = flex_block_mask(blocks, q.shape[-2], block_size)
    run = _compiled_flex() if q.is_cuda else _eager_flex
    return run(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
