"""The Triton kernel of paged sliding-window attention and its launcher (imported only when it runs:
importing it imports triton). One program per (row, KV head), an online-softmax loop over the row's
entries in tiles of BLOCK_N, the GQA query heads of that KV head together."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import interpret_enabled, next_power_of_2


@triton.jit
def paged_window_kernel(
    Q, K, V, O, TABLE, REQ, LOGICAL, COUNT,
    sq_t, sq_h, sq_d, sk_b, sk_n, sk_h, sk_d, sv_b, sv_n, sv_h, sv_d, so_t, so_h, so_d, st_r, st_b,
    scale, softcap,
    CACHE_BLOCK: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """Program (t, h): query row t, KV head h and its GROUP query heads; online softmax over
    the entries [logical[t] - count[t] + 1, logical[t]] of request req[t], BLOCK_N at a time."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    req = tl.load(REQ + t).to(tl.int64)
    own = tl.load(LOGICAL + t).to(tl.int64)
    count = tl.load(COUNT + t).to(tl.int64)
    first = own - count + 1
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(Q + t * sq_t + (h * GROUP + g)[:, None] * sq_h + d[None, :] * sq_d,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for start in range(0, count, BLOCK_N):
        idx = first + start + tl.arange(0, BLOCK_N)
        n_ok = idx <= own
        idx = tl.where(n_ok, idx, own)  # never read outside the window (freed blocks)
        blk = tl.load(TABLE + req * st_r + (idx // CACHE_BLOCK) * st_b).to(tl.int64)
        off = idx % CACHE_BLOCK
        k = tl.load(K + blk[:, None] * sk_b + off[:, None] * sk_n + h * sk_h + d[None, :] * sk_d,
                    mask=d_ok[None, :], other=0.0)
        v = tl.load(V + blk[:, None] * sv_b + off[:, None] * sv_n + h * sv_h + d[None, :] * sv_d,
                    mask=d_ok[None, :], other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        if USE_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / denom[:, None]
    tl.store(O + t * so_t + (h * GROUP + g)[:, None] * so_h + d[None, :] * so_d,
             out.to(O.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_window_attention_triton(query, key_cache, value_cache, block_table, row_request, row_logical, row_count,
                                  *, window: int, scale: float, softcap: float | None = None,
                                  block_n: int = 64) -> torch.Tensor:
    """The Triton kernel (see the module docstring); same contract as the reference."""
    tokens, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(query)
    if tokens == 0:
        return out
    fp32_dot = query.dtype == torch.float32 or interpret_enabled()  # the interpreter's bf16 dot is wrong
    paged_window_kernel[(tokens, kv_heads)](
        query, key_cache, value_cache, out, block_table, row_request, row_logical, row_count,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(), *block_table.stride(),
        float(scale), float(softcap or 0.0),
        CACHE_BLOCK=key_cache.shape[1], GROUP=group, BLOCK_G=max(16, next_power_of_2(group)),
        HEAD_DIM=dim, BLOCK_D=max(16, next_power_of_2(dim)), BLOCK_N=block_n,
        USE_SOFTCAP=bool(softcap), FP32_DOT=fp32_dot,
    )
    return out
