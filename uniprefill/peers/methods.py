"""Each peer's prefill attention: [batch, heads, n, d] tensors in, output and density out.

The selection and the kernels are the peers' own code from the `minference` package
(`minference_loader`); this module only calls them with the right layout and measures the
density, the share of the causal (query block, key block) pairs a method computed, averaged
over batch rows and heads. A method returns None where its own code would not run sparse
(too short for its blocks); the adapter then runs SDPA and counts the reason.

- FlexPrefill: `get_active_blocks` (query-aware vertical/slash selection with a JS-divergence
  switch) and its Triton block kernel, as `flex_prefill_attention` runs them (called with
  keywords: the package's own forward passes `block_size` into `gqa_interleave`'s place).
- XAttention: its antidiagonal block estimate (threshold over block sums) on its Triton path
  (`xattention_estimate`: the package gates that path to A100s and its PyTorch path masks
  earlier chunks away at chunk-multiple lengths); its prefill kernel is MIT's
  `block_sparse_attn` (not on PyPI), so the mask runs on FlexPrefill's block kernel instead: a
  stand-in kernel of the same block granularity (128).
- MInference: the "vertical_and_slash" pattern of `minference_prefill_kernel` (last 64 queries,
  top vertical lines and diagonals) for all heads at once, with the package's CUDA index builder
  and Triton vertical/slash kernel called directly (`_vertical_slash_attention` says why).
- blocks: the CPU stand-in (`reference`), no `minference` needed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .minference_loader import PeerUnavailable, load
from .xattention_estimate import estimate
from .reference import block_sparse_attention, causal_block_count, repeat_kv, standin_blocks

Result = tuple[torch.Tensor, float] | None


def _flex_layout(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[b, h, n, d] -> FlexPrefill's [b, n, h, d], contiguous."""
    return [t.transpose(1, 2).contiguous() for t in tensors]


def _check_flex_kernel(q: torch.Tensor, block_size: int) -> None:
    if q.dtype != torch.bfloat16:
        raise PeerUnavailable(f"FlexPrefill's block kernel runs bfloat16 only (got {q.dtype})")
    if q.shape[-1] not in (16, 32, 64, 128):
        raise PeerUnavailable(f"FlexPrefill's block kernel takes head_dim 16-128 (got {q.shape[-1]})")
    if block_size not in (32, 64, 128):
        raise PeerUnavailable(f"FlexPrefill's block kernel takes block_size 32, 64 or 128 (got {block_size})")


def _padded_block_index(flat: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[b, h, blocks*blocks] bool -> FlexPrefill's block index [b, h, k]: the selected flat indices
    in order, padded with the value its kernel skips (num_blocks * (num_blocks + 1))."""
    pad = num_blocks * (num_blocks + 1)
    positions = torch.arange(flat.shape[-1], device=flat.device).expand_as(flat)
    index = torch.where(flat, positions, torch.full_like(positions, pad)).sort(dim=-1).values
    return index[..., :max(int(flat.sum(-1).max()), 1)].contiguous()


def _density_of_lists(block_idx, num_blocks: int) -> float:
    counts = [len(idx) for row in block_idx for idx in row]
    return sum(counts) / (len(counts) * causal_block_count(num_blocks))


def flexprefill(q, k, v, scale: float, s: dict[str, Any]) -> Result:
    flex = load("modules.flexprefill")
    n, block = q.shape[2], int(s["block_size"])
    _check_flex_kernel(q, block)
    min_budget = 1 if s["min_budget"] is None else int(s["min_budget"])
    max_budget = 2147483647 if s["max_budget"] is None else int(s["max_budget"])
    if n <= max(2 * block, math.ceil(min_budget / block) * block):
        return None  # flex_prefill_attention runs dense attention there
    qt, kt, vt = _flex_layout(q, k, v)
    block_idx = flex.get_active_blocks(qt, kt, vt, block, float(s["gamma"]), math.ceil(min_budget / block),
                                       math.ceil(max_budget / block), tau=float(s["tau"]), gqa_interleave=False)
    out = flex.triton_block_wise_attention(qt, kt, vt, block_idx, block, softmax_scale=scale,
                                           gqa_interleave=False)
    return out.transpose(1, 2), _density_of_lists(block_idx, math.ceil(n / block))


def xattention(q, k, v, scale: float, s: dict[str, Any]) -> Result:
    xattn, flex = load("modules.xattention"), load("modules.flexprefill")
    n, block = q.shape[2], int(s["block_size"])
    _check_flex_kernel(q, block)
    if n <= 2 * block:
        return None
    keys = repeat_kv(k, q.shape[1] // k.shape[1])  # the estimate takes equal head counts
    if s["estimate"] == "package":  # as the package runs it (its PyTorch path off A100s)
        _, mask = xattn.xattn_estimate(q, keys, block_size=block, stride=int(s["stride"]), norm=1,
                                       threshold=float(s["threshold"]), select_mode="inverse", use_triton=True,
                                       causal=True, chunk_size=int(s["chunk_size"]))
    else:
        mask = estimate(q, keys, block_size=block, stride=int(s["stride"]), threshold=float(s["threshold"]),
                        chunk_size=int(s["chunk_size"]))
    num_blocks = math.ceil(n / block)
    mask = mask[:, :, :num_blocks, :num_blocks].to(q.device)
    mask = mask & torch.ones(num_blocks, num_blocks, dtype=torch.bool, device=q.device).tril()
    flat = mask.flatten(2)
    block_idx = _padded_block_index(flat, num_blocks)
    qt, kt, vt = _flex_layout(q, k, v)
    out = flex.triton_block_wise_attention(qt, kt, vt, block_idx, block, softmax_scale=scale,
                                           gqa_interleave=False)
    return out.transpose(1, 2), float(mask.sum()) / (flat.shape[0] * flat.shape[1] * causal_block_count(num_blocks))


def minference(q, k, v, scale: float, s: dict[str, Any]) -> Result:
    pit, flex = load("ops.pit_sparse_flash_attention_v2"), load("modules.flexprefill")
    b, h, n, d = q.shape
    last_q = min(int(s["last_q"]), n)
    if n <= 2 * last_q:
        return None
    if d not in (16, 32, 64, 128) or q.dtype not in (torch.bfloat16, torch.float16):
        raise PeerUnavailable(f"MInference's vertical/slash kernel takes head_dim 16-128 in bf16/fp16 "
                              f"(got {d}, {q.dtype})")
    vertical_size, slash_size = min(n, max(int(s["vertical_size"]), 30)), min(n, max(int(s["slash_size"]), 50))
    groups = h // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    # minference_prefill_kernel's vertical_and_slash_kernel, for every head at once, with the
    # model's softmax scale (the package divides by sqrt(head_dim), the same for most models)
    qk = torch.einsum("bhmk,bhnk->bhmn", q[:, :, -last_q:, :], k) * scale
    tail = torch.ones(last_q, last_q, dtype=torch.bool, device=q.device).tril()
    qk[..., -last_q:] = qk[..., -last_q:].masked_fill(~tail, float("-inf"))
    qk = torch.softmax(qk, dim=-1, dtype=torch.float32)
    vertical = qk.sum(-2, keepdim=True)
    vertical[..., :30] = torch.inf
    vertical_topk = torch.topk(vertical, vertical_size, -1).indices
    # FlexPrefill's diagonal sums have one entry per distance, n - 1 down to 0; the package's own
    # function has last_q - 1 more, which its `[..., :-last_q + 1]` cuts. Cutting these instead
    # would drop the 63 nearest distances, the diagonal included.
    slash = flex.sum_all_diagonal_matrix(qk)
    slash[..., -100:] = torch.inf
    slash = (n - 1) - torch.topk(slash, slash_size, -1).indices
    return _vertical_slash_attention(pit, q, k, v, vertical_topk, slash, scale)


def _vertical_slash_attention(pit, q, k, v, v_idx, s_idx, scale: float, block: int = 64):
    """The package's CUDA index builder and Triton vertical/slash kernel, with one sequence length
    per row and the model's scale; the density from that same index (64x64 tiles count whole,
    capped at 1).

    The package's wrapper is not used: where sgl_kernel or vLLM's ops import it switches to their
    kernels, and it passes one sequence length for the whole batch, which the builder and the
    kernel read per row."""
    b, h, n, d = q.shape
    pad = -n % block
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)).contiguous() for t in (q, k, v))
    v_idx = v_idx.to(torch.int32).reshape(b, h, -1).sort(dim=-1).values.contiguous()
    s_idx = s_idx.to(torch.int32).reshape(b, h, -1).sort(dim=-1, descending=True).values.contiguous()
    seqlens = torch.full((b,), n, dtype=torch.int32, device=q.device)
    block_count, block_offset, column_count, column_index = pit.convert_vertical_slash_indexes(
        seqlens, v_idx, s_idx, n, block, block)
    out = pit._triton_mixed_sparse_attention(q, k, v, seqlens, block_count, block_offset, column_count,
                                             column_index, scale, block, block)
    pairs = block_count.double().sum() * block * block + column_count.double().sum() * block
    return out[:, :, :n], min(1.0, float(pairs / (b * h * n * (n + 1) / 2)))


def blocks(q, k, v, scale: float, s: dict[str, Any]) -> Result:
    block = int(s["block_size"])
    num_blocks = math.ceil(q.shape[2] / block)
    selected = standin_blocks(q.shape[0], q.shape[1], num_blocks, float(s["keep"]), q.device)
    out = block_sparse_attention(q, k, v, selected, block, scale)
    return out, float(selected[0, 0].tril().sum()) / causal_block_count(num_blocks)


PREFILL = {"flexprefill": flexprefill, "xattention": xattention, "minference": minference, "blocks": blocks}
