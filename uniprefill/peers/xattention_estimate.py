"""XAttention's block estimate on its Triton path, on any CUDA device.

`minference.modules.xattention.xattn_estimate` takes its Triton kernels only where the device
name contains "100" (A100); elsewhere it switches to a PyTorch path that, when the key length is
a multiple of `chunk_size` (4K, 32K, 128K ...), masks every key outside the query's own chunk:
`causal_mask[..., -k_reshaped_num_to_pad:] = -inf` with a pad of 0 is `[..., 0:]`, the whole
row. On an H200 at 4,096 tokens and threshold 1.0 it then keeps 55% of the causal blocks instead
of all. `estimate` below is the package's Triton path, step for step, with the package's own
kernels (`ops.xattention_fa`) and block finder (`find_blocks_chunked`); only the device-name
gate is gone. `PeerSpec("xattention", (("estimate", "package"),))` runs the package's function
as it stands instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .minference_loader import load

LOG2E = 1.4426950408889634


def estimate(q: torch.Tensor, k: torch.Tensor, *, block_size: int, stride: int, threshold: float,
             chunk_size: int, norm: float = 1.0) -> torch.Tensor:
    """Boolean block mask [b, h, q_blocks, k_blocks] (padded to whole chunks), causal.

    q, k: [b, h, n, d] with equal head counts (repeat the keys for GQA first).
    """
    xattn, kernels = load("modules.xattention"), load("ops.xattention_fa")
    b, h, k_len, d = k.shape
    q_len = q.shape[2]
    k_pad = -k_len % chunk_size
    q_pad = -q_len % chunk_size
    k_block_num, q_block_num = (k_len + k_pad) // block_size, (q_len + q_pad) // block_size
    q_chunk_num = (q_len + q_pad) // chunk_size
    q = F.pad(q, (0, 0, 0, q_pad)) if q_pad else q
    k = F.pad(k, (0, 0, 0, k_pad)) if k_pad else k
    reshaped_chunk, reshaped_block = chunk_size // stride, block_size // stride
    k_reshaped_len, k_reshaped_pad = (k_len + k_pad) // stride, k_pad // stride
    blocks_per_chunk = reshaped_chunk // reshaped_block
    masks = []
    for chunk in range(q_chunk_num):
        start = (k_block_num - q_block_num) * reshaped_block + chunk * reshaped_chunk
        end = start + reshaped_chunk
        weights = kernels.flat_group_gemm_fuse_reshape(
            q[:, :, chunk * reshaped_chunk * stride:(chunk * reshaped_chunk + reshaped_chunk) * stride, :],
            k, stride, start, end, is_causal=True)
        sums = kernels.softmax_fuse_block_sum(weights, reshaped_block, min(4096, reshaped_block), start, end,
                                              k_reshaped_len - k_reshaped_pad,
                                              LOG2E / math.sqrt(d) / stride / norm, is_causal=True)
        masks.append(xattn.find_blocks_chunked(sums, k_block_num - q_block_num + chunk * blocks_per_chunk,
                                               threshold, None, decoding=False, mode="prefill", causal=True))
    mask = torch.cat(masks, dim=-2)
    causal = torch.ones(q_block_num, q_block_num, dtype=torch.bool, device=mask.device).tril()
    mask[:, :, -q_block_num:, -q_block_num:] &= causal
    return mask
