"""Score-and-select at Llama-3.1-8B shapes: our Triton kernels against the alternatives.

Shapes: 32 q heads, 8 kv heads, head_dim 128, bf16, the last 128 queries, blocks of 64,
sink 128, p = 0.99. For each sequence length (and a packed batch of 16 x 8K) it times, in
one process with `triton.testing.do_bench` (median):

  (a) triton     -- ours: `score_and_select(impl="triton")`, scoring + top-p + compaction
                    (plus its parts: scoring alone, selection alone, compaction alone);
  (b) materialised -- the released design: an explicit [heads, n, N] QK^T in bf16, a float32
                    softmax over it, reductions, `torch.sort` top-p, token mask + nonzero;
  (c) reference  -- ours: `score_and_select(impl="torch")`;
  (d) layer      -- one Llama-3.1-8B-shaped decoder layer prefill at the same N (RMSNorm,
                    q/k/v/o projections, SDPA causal GQA, SwiGLU MLP; no RoPE; random
                    bf16 weights),

and the peak extra memory of each (torch.cuda.max_memory_allocated minus what was
allocated before). It also checks (a) against (c). First it times a few tile shapes of the
two scoring passes at 128K and makes the fastest of each the default for the rest of the
run (the library's default should then be set to it). Writes JSON (--out) and prints a
Markdown table last.

    python benchmarks/bench_kernels.py --out results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from uniprefill.kernels import api
from uniprefill.kernels.score_blocks import kernel as score_module
from uniprefill.kernels.rule import SelectionRule
from uniprefill.kernels.score_blocks.kernel import ScoreTiles, score_blocks_fwd, softmax_lse_fwd, token_scores_fwd
from uniprefill.kernels.validation import read_layout

HQ, HK, D = 32, 8, 128
HIDDEN, FFN = 4096, 14336
LAST_Q, BLOCK, SINK, P = 128, 64, 128, 0.99
SCALE = D**-0.5
DTYPE = torch.bfloat16
CONFIGS = {  # name -> sequence lengths
    "4K": [4096],
    "16K": [16384],
    "32K": [32768],
    "64K": [65536],
    "128K": [131072],
    "16x8K": [8192] * 16,
}
STATS_VARIANTS = {  # pass 1 (row max / sum over key chunks), timed with its combine kernel
    "m128-n128-w8-s2": dict(stats_block_m=128, stats_block_n=128, stats_warps=8, stats_stages=2),
    "m128-n128-w8-s2-chunks-first": dict(stats_block_m=128, stats_block_n=128, stats_warps=8, stats_stages=2,
                                         stats_rows_first=False),  # the grid order before 2026-12-01
    "m128-n128-w8-s3": dict(stats_block_m=128, stats_block_n=128, stats_warps=8, stats_stages=3),
    "m128-n128-w8-s4": dict(stats_block_m=128, stats_block_n=128, stats_warps=8, stats_stages=4),
    "m128-n64-w4-s3": dict(stats_block_m=128, stats_block_n=64, stats_warps=4, stats_stages=3),
    "m128-n64-w4-s4": dict(stats_block_m=128, stats_block_n=64, stats_warps=4, stats_stages=4),
    "m64-n128-w4-s3": dict(stats_block_m=64, stats_block_n=128, stats_warps=4, stats_stages=3),
}
TOKENS_VARIANTS = {  # pass 2 (token scores per key tile)
    "m64-n64-w4-s2": dict(tokens_block_m=64, tokens_block_n=64, tokens_warps=4, tokens_stages=2),
    "m64-n128-w4-s2": dict(tokens_block_m=64, tokens_block_n=128, tokens_warps=4, tokens_stages=2),
    "m64-n128-w4-s3": dict(tokens_block_m=64, tokens_block_n=128, tokens_warps=4, tokens_stages=3),
    "m64-n128-w8-s3": dict(tokens_block_m=64, tokens_block_n=128, tokens_warps=8, tokens_stages=3),
    "m32-n128-w4-s3": dict(tokens_block_m=32, tokens_block_n=128, tokens_warps=4, tokens_stages=3),
    "m64-n256-w8-s2": dict(tokens_block_m=64, tokens_block_n=256, tokens_warps=8, tokens_stages=2),
    "m128-n128-w8-s3": dict(tokens_block_m=128, tokens_block_n=128, tokens_warps=8, tokens_stages=3),
}


def make_inputs(lens, device, planted=0.25):
    """q and k as the FX pass passes them: transposed views of [1, H, tokens, d] tensors.

    Pure noise spreads attention so evenly that p = 0.99 keeps 99% of the blocks. So the
    keys of each block carry a random bias (std `planted`) along one direction per kv head
    that the queries share: attention is uneven, and about half the blocks are kept at 8K.
    """
    total, q_lens = sum(lens), [min(LAST_Q, n) for n in lens]
    direction = torch.randn(HK, D, device=device)
    direction *= D**0.5 / direction.norm(dim=-1, keepdim=True)
    bias = (torch.randn(math.ceil(total / BLOCK), device=device) * planted).repeat_interleave(BLOCK)[:total]
    k_full = torch.randn(1, HK, total, D, device=device) + bias[None, None, :, None] * direction[None, :, None, :]
    q_full = torch.randn(1, HQ, sum(q_lens), D, device=device)
    q_full += direction.repeat_interleave(HQ // HK, 0)[None, :, None, :]
    q, k = q_full.to(DTYPE)[0].transpose(0, 1), k_full.to(DTYPE)[0].transpose(0, 1)
    cu_q_host, cu_k_host = _cumsum0(q_lens), _cumsum0(lens)
    cu_q = torch.tensor(cu_q_host, dtype=torch.int32, device=device)
    cu_k = torch.tensor(cu_k_host, dtype=torch.int32, device=device)
    return q, k, cu_q, cu_k, (cu_q_host, cu_k_host)


def _cumsum0(values):
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


RULE = SelectionRule(block_size=BLOCK, p=P, keep_ratio=None, sink=SINK, last_q=LAST_Q, min_tokens=0)


def ours(q, k, cu_q, cu_k, host, impl):
    return api.score_and_select(q, k, cu_q, cu_k, max(b - a for a, b in zip(host[1], host[1][1:])), RULE,
                                scale=SCALE, impl=impl, host_cu_seqlens=host)


def materialised(q, k, cu_k_host, lens):
    """The released code's design, in PyTorch: materialise [heads, n, N], one request at a time."""
    kept = []
    q0 = 0
    for start, n in zip(cu_k_host, lens):
        n_q = min(LAST_Q, n)
        q_i = q[q0 : q0 + n_q].transpose(0, 1).reshape(HK, (HQ // HK) * n_q, D)  # [Hk, g*n, d]
        q0 += n_q
        k_i = k[start : start + n].permute(1, 2, 0)  # [Hk, d, N]
        scores = torch.matmul(q_i, k_i).view(HQ, n_q, n)  # bf16 [heads, n, N]: ~1 GiB at 128K
        causal = torch.ones(n_q, n_q, dtype=torch.bool, device=q.device).triu(1)
        scores[:, :, n - n_q :].masked_fill_(causal, float("-inf"))
        probs = torch.softmax(scores.float() * SCALE, dim=-1)  # float32 [heads, n, N]
        token = probs.mean(1).sum(0)
        n_blocks = math.ceil(n / BLOCK)
        padded = F.pad(token, (0, n_blocks * BLOCK - n))
        counts = (n - torch.arange(n_blocks, device=q.device) * BLOCK).clamp(max=BLOCK)
        block = padded.view(n_blocks, BLOCK).sum(1) / counts
        starts = torch.arange(n_blocks, device=q.device) * BLOCK
        forced = (starts < SINK) | (starts + BLOCK > n - LAST_Q)
        order = torch.sort(torch.where(forced, math.inf, block), descending=True).indices
        prefix = torch.cumsum(block[order], 0)
        keep_sorted = (prefix - block[order]) < P * block.sum()
        keep = torch.zeros_like(forced)
        keep[order] = keep_sorted
        keep |= forced
        token_keep = keep.repeat_interleave(BLOCK)[:n]
        kept.append(token_keep.nonzero().flatten() + start)
    return torch.cat(kept)


class LlamaLayer:
    """One Llama-3.1-8B-shaped decoder layer (no RoPE), random bf16 weights."""

    def __init__(self, device):
        def w(out_f, in_f):
            return torch.randn(out_f, in_f, device=device, dtype=DTYPE) * in_f**-0.5

        self.wq, self.wk, self.wv, self.wo = w(HQ * D, HIDDEN), w(HK * D, HIDDEN), w(HK * D, HIDDEN), w(HIDDEN, HQ * D)
        self.gate, self.up, self.down = w(FFN, HIDDEN), w(FFN, HIDDEN), w(HIDDEN, FFN)
        self.norm1 = torch.ones(HIDDEN, device=device, dtype=DTYPE)
        self.norm2 = torch.ones(HIDDEN, device=device, dtype=DTYPE)
        self.attention = "sdpa enable_gqa"  # or "sdpa, k/v expanded" if the fused kernels refuse GQA

    def _attend(self, q, k, v):
        # Fused kernels only: the math backend would materialise [heads, N, N].
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        with sdpa_kernel(backends):
            if self.attention == "sdpa enable_gqa":
                try:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                except RuntimeError:
                    self.attention = "sdpa, k/v expanded"
            k, v = (t.repeat_interleave(HQ // HK, dim=1) for t in (k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    @torch.inference_mode()
    def __call__(self, x):  # x: [B, N, hidden]
        b, n, _ = x.shape
        h = F.rms_norm(x, (HIDDEN,), self.norm1, 1e-5)
        q = (h @ self.wq.T).view(b, n, HQ, D).transpose(1, 2)
        k = (h @ self.wk.T).view(b, n, HK, D).transpose(1, 2)
        v = (h @ self.wv.T).view(b, n, HK, D).transpose(1, 2)
        attn = self._attend(q, k, v)
        x = x + attn.transpose(1, 2).reshape(b, n, HQ * D) @ self.wo.T
        h = F.rms_norm(x, (HIDDEN,), self.norm2, 1e-5)
        return x + (F.silu(h @ self.gate.T) * (h @ self.up.T)) @ self.down.T


def timed(fn, rep_ms):
    return triton.testing.do_bench(fn, warmup=max(25, rep_ms // 10), rep=rep_ms, return_mode="median")


def peak_extra_bytes(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


def bench_one(name, lens, layer, device):
    q, k, cu_q, cu_k, host = make_inputs(lens, device)
    total = sum(lens)
    row = {"name": name, "lens": lens, "tokens": total}

    sel = ours(q, k, cu_q, cu_k, host, "triton")
    ref = ours(q, k, cu_q, cu_k, host, "torch")
    row["rel_err_scores_vs_reference"] = (
        (sel.block_scores.double() - ref.block_scores.double()).norm() / ref.block_scores.double().norm()
    ).item()
    row["same_blocks_as_reference"] = bool(torch.equal(sel.block_keep, ref.block_keep))
    row["kept_share"] = sum(sel.kept_counts) / total
    del ref

    layout = read_layout(cu_q, cu_k, total_q=q.shape[0], total_k=k.shape[0], max_seqlen_k=max(lens),
                         host_cu_seqlens=host)
    blocks = sel.block_scores
    t = {}
    t["triton"] = timed(lambda: ours(q, k, cu_q, cu_k, host, "triton"), 100)
    t["triton_score"] = timed(lambda: score_blocks_fwd(q, k, cu_q, cu_k, layout, block_size=BLOCK, scale=SCALE), 100)
    t["triton_pass1"] = timed(lambda: softmax_lse_fwd(q, k, cu_q, cu_k, layout, scale=SCALE,
                                                      tiles=score_module.ScoreTiles.for_head_dim(D)), 50)
    t["triton_select"] = timed(lambda: api.select_blocks(blocks, sel.cu_blocks, cu_k, RULE, impl="triton",
                                                          max_seqlen_k=max(lens)), 50)
    t["compact"] = timed(lambda: api.compact_tokens(sel.block_keep, sel.cu_blocks, cu_k, BLOCK), 50)
    t["materialised"] = timed(lambda: materialised(q, k, host[1], lens), 200)
    t["reference"] = timed(lambda: ours(q, k, cu_q, cu_k, host, "torch"), 200)
    x = torch.randn(len(lens), lens[0], HIDDEN, device=device, dtype=DTYPE)
    t["layer"] = timed(lambda: layer(x), 300)
    row["ms"] = t

    mem = {}
    mem["triton"] = peak_extra_bytes(lambda: ours(q, k, cu_q, cu_k, host, "triton"))
    mem["materialised"] = peak_extra_bytes(lambda: materialised(q, k, host[1], lens))
    mem["reference"] = peak_extra_bytes(lambda: ours(q, k, cu_q, cu_k, host, "torch"))
    mem["layer"] = peak_extra_bytes(lambda: layer(x))
    row["peak_extra_MiB"] = {key: v / 2**20 for key, v in mem.items()}
    x = None  # frees the input (not `del`: the lambdas above close over x, which ruff reads as F821)

    flops = 2 * 2 * HQ * sum(min(LAST_Q, n) * n for n in lens) * D  # two QK^T passes
    row["triton_score_TFLOPs"] = flops / (t["triton_score"] * 1e-3) / 1e12
    row["speedup_vs_materialised"] = t["materialised"] / t["triton"]
    row["share_of_layer_pct"] = 100 * t["triton"] / t["layer"]
    return row


def tile_sweep(lens, device):
    """Time each pass's tile variants alone; return the timings and the fastest ScoreTiles."""
    q, k, cu_q, cu_k, host = make_inputs(lens, device)
    layout = read_layout(cu_q, cu_k, total_q=q.shape[0], total_k=k.shape[0], max_seqlen_k=max(lens),
                         host_cu_seqlens=host)
    lse = softmax_lse_fwd(q, k, cu_q, cu_k, layout, scale=SCALE, tiles=ScoreTiles())
    timings, best = {"stats": {}, "tokens": {}}, {}
    for kind, variants, run in (
        ("stats", STATS_VARIANTS, lambda t: softmax_lse_fwd(q, k, cu_q, cu_k, layout, scale=SCALE, tiles=t)),
        ("tokens", TOKENS_VARIANTS, lambda t: token_scores_fwd(q, k, cu_q, cu_k, layout, lse, scale=SCALE, tiles=t)),
    ):
        for name, fields in variants.items():
            try:
                timings[kind][name] = timed(lambda: run(ScoreTiles(**fields)), 100)
            except Exception as exc:  # a variant that fails to compile is reported, not fatal
                timings[kind][name] = f"failed: {type(exc).__name__}: {exc}"[:300]
        ok = {n: v for n, v in timings[kind].items() if isinstance(v, float)}
        if ok:
            best.update(variants[min(ok, key=ok.get)])
    return timings, ScoreTiles(**best)


def profile_once(lens, device, calls=10):
    """torch.profiler over `calls` score_and_select calls: device time per kernel vs wall time."""
    from torch.profiler import ProfilerActivity, profile

    q, k, cu_q, cu_k, host = make_inputs(lens, device)
    for _ in range(3):
        ours(q, k, cu_q, cu_k, host, "triton")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            ours(q, k, cu_q, cu_k, host, "triton")
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / calls
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels = {e.key: e.device_time_total / 1e3 / calls for e in events if e.count >= calls}
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    return {"wall_ms_per_call_under_profiler": wall_ms, "device_ms_per_call": kernels}, table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="kernels-h200.json")
    parser.add_argument("--only", nargs="*", default=list(CONFIGS), help=f"of {list(CONFIGS)}")
    parser.add_argument("--profile", default="128K", help="also profile one size's calls (empty: none)")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    layer = LlamaLayer(device)
    started = time.time()
    sweep, best = tile_sweep(CONFIGS["128K"], device)
    print(json.dumps({"tile_sweep_128K_ms": sweep, "chosen": dataclasses.asdict(best)}), flush=True)
    # The fastest tiles become the default of score_blocks_fwd for the rest of this run.
    class Chosen(ScoreTiles):
        @classmethod
        def for_head_dim(cls, head_dim, element_size=2):
            return best

    score_module.ScoreTiles = Chosen
    rows = []
    for name in args.only:
        try:
            rows.append(bench_one(name, CONFIGS[name], layer, device))
        except Exception as exc:  # keep the other sizes' numbers
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    profiled = None
    if args.profile:
        profiled, table = profile_once(CONFIGS[args.profile], device)
        profiled["size"] = args.profile
        print(table, flush=True)
        print(json.dumps(profiled), flush=True)
    result = {
        "machine": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shapes": dict(hq=HQ, hk=HK, d=D, dtype=str(DTYPE), last_q=LAST_Q, block=BLOCK, sink=SINK, p=P),
        "layer_attention": layer.attention,
        "rows": rows,
        "tile_sweep_128K_ms": sweep,
        "tiles": dataclasses.asdict(best),
        "profile": profiled,
        "seconds": time.time() - started,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown_table(rows))


def markdown_table(rows):
    lines = [
        "| N | (a) triton ms | score (pass 1) / select / compact ms | (b) materialised ms | (c) reference ms "
        "| (d) layer ms | speedup vs (b) | share of (d) | peak extra MiB (a) / (b) / (c) | rel err vs (c) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error'][:120]} |")
            continue
        t, m = r["ms"], r["peak_extra_MiB"]
        lines.append(
            f"| {r['name']} | {t['triton']:.3f} | {t['triton_score']:.3f} ({t['triton_pass1']:.3f}) / "
            f"{t['triton_select']:.3f} / "
            f"{t['compact']:.3f} | {t['materialised']:.2f} | {t['reference']:.2f} | {t['layer']:.2f} | "
            f"{r['speedup_vs_materialised']:.1f}x | {r['share_of_layer_pct']:.2f}% | "
            f"{m['triton']:.0f} / {m['materialised']:.0f} / {m['reference']:.0f} | "
            f"{r['rel_err_scores_vs_reference']:.1e} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
