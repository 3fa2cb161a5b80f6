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

import torch

from .flex import flex_block_mask, run_flex
from .pattern import SPARSE_BLOCK, block_scores, select_key_blocks
from .reference import block_sparse_attention_reference

__all__ = ["SPARSE_BLOCK", "block_scores", "block_sparse_attention", "block_sparse_attention_reference",
           "flex_block_mask", "select_key_blocks"]


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, *,
                           scale: float, impl: str = "flex", block_size: int = SPARSE_BLOCK) -> torch.Tensor:
    """Run the pattern: impl "flex" (fused on CUDA, unfused on the CPU) or "torch" (the reference)."""
    if impl == "torch":
        return block_sparse_attention_reference(q, k, v, blocks, block_size, scale)
    if impl != "flex":
        raise ValueError(f"impl={impl!r} is not 'flex' or 'torch'")
    return run_flex(q, k, v, blocks, scale=scale, block_size=block_size)
