"""Triton block scoring without materialising the [queries, keys, heads] score matrix.

The score of key t is sum_h mean_j softmax_t(q_hj . k_t * scale), causal, in float32.
The softmax needs each query row's normaliser over ALL keys before any key's share is
known, so the work runs in two passes over the keys, like a flash-attention forward
without V, split along the key axis to fill the GPU even for one sequence:

1. `_softmax_stats_kernel`, grid (kv head x row block, key chunk, sequence): the row max
   and sum of exp over one chunk of keys, online, for a block of query rows. A row is a
   (q head of the kv head's GQA group, query) pair, so the group's heads share each K tile.
2. `_combine_stats_kernel`, grid (row block, sequence, kv head): merges the chunks' partial
   statistics, in chunk order, into one log-sum-exp per row.
3. `_token_scores_kernel`, grid (key tile, sequence, kv head): recomputes the scores of one
   tile of keys for every row of the group, exp(s - lse), and sums them over rows: one
   partial token score per kv head, float32 [Hk, total_k].
4. `_block_means_kernel`, grid (block tile, sequence): sums the kv heads and averages the
   tokens of each block (the last, partial block over its real tokens).

Every reduction has a fixed order and nothing uses atomics, so equal inputs give bit-equal
outputs. Extra memory is O(N): the [Hk, N] partial token scores plus per-chunk row
statistics (a few MiB at 128K). Exponentials are base 2, with log2(e) folded into the scale
(which must be positive: maxima are taken on raw q.k). The exponentials dominate the cost,
so each score takes one multiply-add, one exp2 and one add, and the causal mask is applied
only to the tiles that reach the last n keys.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from .._common import cdiv, interpret_enabled, multiprocessor_count, next_power_of_2
from .reference import block_offsets
from ..validation import VarlenLayout


@dataclasses.dataclass(frozen=True)
class ScoreTiles:
    """Tile shapes of the scoring kernels.

    The defaults won a sweep at 128K tokens, Llama-3.1-8B shapes, on one H200 on 2026-12-01
    (pass 1 0.34 ms, pass 2 0.40 ms; see docs/benchmarks.md); tests shrink them to cover
    every loop.
    """

    stats_block_m: int = 128  # pass 1: query rows per program
    stats_block_n: int = 64  # pass 1: keys per loop step
    stats_warps: int = 4
    stats_stages: int = 3
    stats_rows_first: bool = True  # pass-1 grid order: row blocks of one key chunk run side by side
    tokens_block_m: int = 64  # pass 2: query rows per loop step
    tokens_block_n: int = 256  # pass 2: keys per program
    tokens_warps: int = 8
    tokens_stages: int = 2
    chunk: int | None = None  # keys per pass-1 program; None picks one that fills the GPU

    @classmethod
    def for_head_dim(cls, head_dim: int, element_size: int = 2) -> "ScoreTiles":
        """The defaults, with row/key tiles shrunk for heads wider than 128 so that the
        shared-memory tiles stay within one SM's budget (Gemma-3 has head_dim 256), and
        shrunk again for 4-byte inputs (float32 at head_dim 256 asked for 256 KiB on the
        H200 with the bf16 tiles: Triton OutOfResources, 2026-12-01)."""
        shrink = max(1, -(-head_dim // 128))
        if shrink == 1:
            return cls()
        shrink *= max(1, element_size // 2)
        # at head_dim 256 in bf16: the tiles Gemma-3-270M ran with in the H200 evals of 2026-12-01
        return cls(stats_block_m=max(16, 128 // shrink), stats_block_n=max(16, 128 // shrink), stats_warps=8,
                   stats_stages=2, tokens_block_m=max(16, 64 // shrink), tokens_block_n=64, tokens_warps=4)


@triton.jit
def _softmax_stats_kernel(
    q_ptr, k_ptr, cu_q_ptr, cu_k_ptr, row_max_ptr, row_sum_ptr,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    qk_scale, batch, num_kv_heads, rows_per_kv_head, chunk_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, ROWS_FIRST: tl.constexpr,
):
    if ROWS_FIRST:
        # grid (kv head x row block, chunk, sequence): the programs that read the same
        # chunk of keys are launched next to each other, so K comes from L2 after the first.
        row_blocks = tl.cdiv(rows_per_kv_head, BLOCK_M)
        kv_head = tl.program_id(0) // row_blocks
        row_block = tl.program_id(0) % row_blocks
        chunk = tl.program_id(1)
        seq = tl.program_id(2)
    else:
        # grid (chunk, sequence, row block x kv head): every chunk of one row block first
        chunk = tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2) % num_kv_heads
        row_block = tl.program_id(2) // num_kv_heads
    q_start = tl.load(cu_q_ptr + seq).to(tl.int64)
    n_q = (tl.load(cu_q_ptr + seq + 1) - q_start).to(tl.int32)
    k_start = tl.load(cu_k_ptr + seq).to(tl.int64)
    n_k = (tl.load(cu_k_ptr + seq + 1) - k_start).to(tl.int32)
    key_lo = chunk * chunk_size
    if key_lo >= n_k or row_block * BLOCK_M >= GROUP * n_q:
        return
    key_hi = tl.minimum(key_lo + chunk_size, n_k)

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * n_q
    head_in_group = rows // n_q
    query = rows - head_in_group * n_q
    position = n_k - n_q + query
    head = (kv_head * GROUP + head_in_group).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + query)[:, None] * stride_qt + head[:, None] * stride_qh
        + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    k_ptrs = (k_ptr + (k_start + key_lo) * stride_kt + kv_head.to(tl.int64) * stride_kh
              + offs_n[None, :] * stride_kt + dims[:, None] * stride_kd)

    # Maxima are kept in raw q.k units and scaled inside one fused multiply-add per score
    # (scale > 0). Keys at or before n_k - n_q are visible to every query: whole tiles of
    # them need no mask; only the tiles that reach the query window or the chunk's end do.
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    open_end = key_lo + tl.maximum(tl.minimum(key_hi, n_k - n_q + 1) - key_lo, 0) // BLOCK_N * BLOCK_N
    for _ in range(key_lo, open_end, BLOCK_N):
        k_t = tl.load(k_ptrs, mask=dim_ok[:, None], other=0.0)
        if DOT_FP32:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=PRECISION)
        new_max = tl.maximum(row_max, tl.max(s, 1))
        shift = new_max * qk_scale
        row_sum = row_sum * tl.exp2(row_max * qk_scale - shift) + tl.sum(
            tl.exp2(s * qk_scale - shift[:, None]), 1
        )
        row_max = new_max
        k_ptrs += BLOCK_N * stride_kt
    for start in range(open_end, key_hi, BLOCK_N):
        keys = start + offs_n
        key_ok = keys < key_hi
        k_t = tl.load(k_ptrs, mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
        if DOT_FP32:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=PRECISION)
        s = tl.where((keys[None, :] <= position[:, None]) & key_ok[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        # A row that has seen no visible key yet keeps max -inf; shift by 0 so that
        # exp2(-inf - shift) is 0 rather than NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max * qk_scale)
        row_sum = row_sum * tl.exp2(row_max * qk_scale - shift) + tl.sum(
            tl.exp2(s * qk_scale - shift[:, None]), 1
        )
        row_max = new_max
        k_ptrs += BLOCK_N * stride_kt

    out = ((chunk * batch + seq) * num_kv_heads + kv_head).to(tl.int64) * rows_per_kv_head + rows
    tl.store(row_max_ptr + out, row_max * qk_scale, mask=row_ok)
    tl.store(row_sum_ptr + out, row_sum, mask=row_ok)


@triton.jit
def _combine_stats_kernel(
    row_max_ptr, row_sum_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
    batch, num_kv_heads, rows_per_kv_head, chunk_size,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    n_q = tl.load(cu_q_ptr + seq + 1) - tl.load(cu_q_ptr + seq)
    n_k = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    if row_block * BLOCK_R >= GROUP * n_q:
        return
    rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < GROUP * n_q
    n_chunks = (n_k + chunk_size - 1) // chunk_size

    total_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total_sum = tl.zeros([BLOCK_R], tl.float32)
    for c0 in range(0, n_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        ok = (chunks < n_chunks)[:, None] & row_ok[None, :]
        at = ((chunks[:, None] * batch + seq) * num_kv_heads + kv_head).to(tl.int64)
        at = at * rows_per_kv_head + rows[None, :]
        part_max = tl.load(row_max_ptr + at, mask=ok, other=float("-inf"))
        part_sum = tl.load(row_sum_ptr + at, mask=ok, other=0.0)
        new_max = tl.maximum(total_max, tl.max(part_max, 0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        total_sum = total_sum * tl.exp2(total_max - shift) + tl.sum(
            part_sum * tl.exp2(part_max - shift[None, :]), 0
        )
        total_max = new_max
    # Key 0 is visible to every query, so each valid row has total_sum >= 1.
    lse = total_max + tl.log2(tl.where(row_ok, total_sum, 1.0))
    tl.store(lse_ptr + (seq * num_kv_heads + kv_head).to(tl.int64) * rows_per_kv_head + rows,
             lse, mask=row_ok)


@triton.jit
def _token_scores_kernel(
    q_ptr, k_ptr, cu_q_ptr, cu_k_ptr, lse_ptr, token_ptr,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    qk_scale, num_kv_heads, rows_per_kv_head, total_k,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq).to(tl.int64)
    n_q = (tl.load(cu_q_ptr + seq + 1) - q_start).to(tl.int32)
    k_start = tl.load(cu_k_ptr + seq).to(tl.int64)
    n_k = (tl.load(cu_k_ptr + seq + 1) - k_start).to(tl.int32)
    if tile * BLOCK_N >= n_k:
        return
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < n_k
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    # Keys are the rows of this product (s is [keys, query rows]), so summing a key's
    # probabilities over the query rows stays inside a warp.
    k = tl.load(
        k_ptr + (k_start + keys)[:, None] * stride_kt + kv_head.to(tl.int64) * stride_kh
        + dims[None, :] * stride_kd,
        mask=key_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    if DOT_FP32:
        k = k.to(tl.float32)
    lse_base = lse_ptr + (seq * num_kv_heads + kv_head).to(tl.int64) * rows_per_kv_head
    # Only a tile that reaches the last n_q keys needs the causal mask.
    needs_mask = (tile + 1) * BLOCK_N > n_k - n_q + 1

    acc = tl.zeros([BLOCK_N], tl.float32)
    n_rows = GROUP * n_q
    for r0 in range(0, n_rows, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        head_in_group = rows // n_q
        query = rows - head_in_group * n_q
        head = (kv_head * GROUP + head_in_group).to(tl.int64)
        q_t = tl.load(
            q_ptr + (q_start + query)[None, :] * stride_qt + head[None, :] * stride_qh
            + dims[:, None] * stride_qd,
            mask=dim_ok[:, None] & row_ok[None, :], other=0.0,
        )
        if DOT_FP32:
            q_t = q_t.to(tl.float32)
        # Rows past the end get lse = +inf, hence probability 0.
        lse = tl.load(lse_base + rows, mask=row_ok, other=float("inf"))
        s = tl.dot(k, q_t, input_precision=PRECISION)
        p = tl.exp2(s * qk_scale - lse[None, :])
        if needs_mask:
            p = tl.where(keys[:, None] <= (n_k - n_q + query)[None, :], p, 0.0)
        acc += tl.sum(p, 1)
    tl.store(token_ptr + kv_head.to(tl.int64) * total_k + k_start + keys, acc / n_q, mask=key_ok)


@triton.jit
def _block_means_kernel(
    token_ptr, cu_k_ptr, cu_blocks_ptr, out_ptr, num_kv_heads, total_k, block_size,
    BLOCKS: tl.constexpr, TOKENS: tl.constexpr,
):
    pid = tl.program_id(0)
    seq = tl.program_id(1)
    k_start = tl.load(cu_k_ptr + seq).to(tl.int64)
    n_k = (tl.load(cu_k_ptr + seq + 1) - k_start).to(tl.int32)
    n_blocks = (n_k + block_size - 1) // block_size
    if pid * BLOCKS >= n_blocks:
        return
    blocks = pid * BLOCKS + tl.arange(0, BLOCKS)
    block_ok = blocks < n_blocks
    acc = tl.zeros([BLOCKS], tl.float32)
    for t0 in range(0, block_size, TOKENS):
        offs = t0 + tl.arange(0, TOKENS)
        tokens = blocks[:, None] * block_size + offs[None, :]
        ok = block_ok[:, None] & (offs < block_size)[None, :] & (tokens < n_k)
        tile = tl.zeros([BLOCKS, TOKENS], tl.float32)
        for h in range(num_kv_heads):
            tile += tl.load(token_ptr + h * total_k + k_start + tokens, mask=ok, other=0.0)
        acc += tl.sum(tile, 1)
    count = tl.maximum(tl.minimum(n_k - blocks * block_size, block_size), 1)
    block_start = tl.load(cu_blocks_ptr + seq)
    tl.store(out_ptr + block_start + blocks, acc / count.to(tl.float32), mask=block_ok)


def score_blocks_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    layout: VarlenLayout,
    *,
    block_size: int,
    scale: float,
    tiles: ScoreTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host wrapper: allocate, size the grids from `layout`, launch the four kernels."""
    tiles = tiles or ScoreTiles.for_head_dim(q.shape[-1], q.element_size())
    cu_blocks = block_offsets(cu_seqlens_k, block_size)
    block_scores = torch.empty(layout.num_blocks(block_size), dtype=torch.float32, device=q.device)
    if layout.max_seqlen_k == 0:
        return block_scores, cu_blocks
    lse = softmax_lse_fwd(q, k, cu_seqlens_q, cu_seqlens_k, layout, scale=scale, tiles=tiles)
    token = token_scores_fwd(q, k, cu_seqlens_q, cu_seqlens_k, layout, lse, scale=scale, tiles=tiles)
    tokens_tile = min(256, next_power_of_2(block_size))
    blocks_tile = max(1, 2048 // tokens_tile)
    _block_means_kernel[(cdiv(cdiv(layout.max_seqlen_k, block_size), blocks_tile), layout.batch)](
        token, cu_seqlens_k, cu_blocks, block_scores, k.shape[1], k.shape[0], block_size,
        BLOCKS=blocks_tile, TOKENS=tokens_tile,
    )
    return block_scores, cu_blocks


def softmax_lse_fwd(q, k, cu_seqlens_q, cu_seqlens_k, layout: VarlenLayout, *, scale: float,
                    tiles: ScoreTiles) -> torch.Tensor:
    """Kernels 1 and 2 of the module docstring: log2-sum-exp2 per (sequence, kv head, row)."""
    batch, num_kv_heads = layout.batch, k.shape[1]
    rows = (q.shape[1] // num_kv_heads) * layout.max_seqlen_q
    row_blocks = cdiv(rows, tiles.stats_block_m)
    chunk = tiles.chunk or _pick_chunk(
        layout.max_seqlen_k, batch * num_kv_heads * row_blocks, tiles.stats_block_n, q.device
    )
    n_chunks = cdiv(layout.max_seqlen_k, chunk)
    row_max = torch.empty(n_chunks * batch * num_kv_heads * rows, dtype=torch.float32, device=q.device)
    row_sum = torch.empty_like(row_max)
    if tiles.stats_rows_first:
        grid = (num_kv_heads * row_blocks, n_chunks, batch)
    else:
        grid = (n_chunks, batch, num_kv_heads * row_blocks)
    _softmax_stats_kernel[grid](
        q, k, cu_seqlens_q, cu_seqlens_k, row_max, row_sum,
        *q.stride(), *k.stride(), _log2_scale(scale), batch, num_kv_heads, rows, chunk,
        BLOCK_M=tiles.stats_block_m, BLOCK_N=tiles.stats_block_n, ROWS_FIRST=tiles.stats_rows_first,
        **_common(q, k), num_warps=tiles.stats_warps, num_stages=tiles.stats_stages,
    )
    lse = torch.empty(batch * num_kv_heads * rows, dtype=torch.float32, device=q.device)
    _combine_stats_kernel[(cdiv(rows, _COMBINE_ROWS), batch, num_kv_heads)](
        row_max, row_sum, lse, cu_seqlens_q, cu_seqlens_k, batch, num_kv_heads, rows, chunk,
        GROUP=q.shape[1] // num_kv_heads, BLOCK_R=_COMBINE_ROWS, BLOCK_C=16,
    )
    return lse


def token_scores_fwd(q, k, cu_seqlens_q, cu_seqlens_k, layout: VarlenLayout, lse, *, scale: float,
                     tiles: ScoreTiles) -> torch.Tensor:
    """Kernel 3 of the module docstring: float32 [Hk, total_k], each kv head's token scores."""
    num_kv_heads = k.shape[1]
    rows = (q.shape[1] // num_kv_heads) * layout.max_seqlen_q
    token = torch.empty(num_kv_heads * k.shape[0], dtype=torch.float32, device=q.device)
    _token_scores_kernel[(cdiv(layout.max_seqlen_k, tiles.tokens_block_n), layout.batch, num_kv_heads)](
        q, k, cu_seqlens_q, cu_seqlens_k, lse, token,
        *q.stride(), *k.stride(), _log2_scale(scale), num_kv_heads, rows, k.shape[0],
        BLOCK_M=tiles.tokens_block_m, BLOCK_N=tiles.tokens_block_n, **_common(q, k),
        num_warps=tiles.tokens_warps, num_stages=tiles.tokens_stages,
    )
    return token


_COMBINE_ROWS = 64


def _common(q: torch.Tensor, k: torch.Tensor) -> dict:
    head_dim = q.shape[2]
    return dict(
        GROUP=q.shape[1] // k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        DOT_FP32=interpret_enabled() and q.dtype != torch.float32,  # the interpreter's bf16 dot is wrong
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _log2_scale(scale: float) -> float:
    return float(scale) * math.log2(math.e)


def _pick_chunk(max_n_k: int, programs_per_chunk: int, block_n: int, device: torch.device) -> int:
    """Keys per pass-1 program: about eight programs per multiprocessor, whole tiles."""
    tiles = cdiv(max_n_k, block_n)
    target_programs = 8 * multiprocessor_count(device)
    tiles_per_chunk = max(1, (tiles * programs_per_chunk) // target_programs)
    return tiles_per_chunk * block_n
