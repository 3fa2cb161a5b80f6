"""The paged per-row-window attention (vLLM sliding layers after a drop) at Gemma-3 shapes.

For R rows (the kept tokens of one request after a drop point) it times, with CUDA events
(median of `--repeats` after a warm-up), one sliding layer's attention three ways:

  (a) triton     -- `kernels.paged_window` (what `VllmDropRuntime.window_attention` runs: the per-row kernel),
                    and each of its two kernels (`per_row_ms`, `tiled_ms`: the tiled kernel, one read of a key per
                    tile of rows, not yet measured on a GPU);
  (b) reference  -- its PyTorch reference (row chunks of gathered keys);
  (c) sdpa-window -- for scale: SDPA over the same R rows of one contiguous request with a
                    uniform window of W rows (what FlashAttention's own sliding window costs on
                    the same rows; it reads each key once per tile, not once per query row),

and checks (a) against (b); then decode steps (`--decode-rows`: a row per request at the end of a full window)
on the per-row kernel with 1, 2, 4 and 8 programs a row (split-KV). Shapes: Gemma-3-270M's sliding layers by default (4 query heads,
1 KV head, head size 256, window 512, block 16), bf16; `--heads 16 --kv-heads 8 --head-dim 256
--window 1024` for Gemma-3-12B's. Prints a Markdown table; `--out` writes JSON.

    python benchmarks/bench_paged_window.py --rows 4096,16384,32768 --out paged-window-h200.json
"""

from __future__ import annotations

import argparse
import json

import torch


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# (query rows x heads per program, warps, entries per loop step or None: the launcher's, stages or None: Triton's)
TILED_VARIANTS = ((32, 4, None, None), (64, 4, None, None), (64, 8, None, None), (128, 8, None, None),
                  (128, 8, 64, None), (128, 8, 16, None), (128, 8, 32, 2), (128, 8, 32, 3), (64, 4, 64, 2),
                  (128, 4, 32, None))


def run_one(rows: int, args) -> dict:
    from uniprefill.kernels.paged_window import (paged_window_attention, paged_window_attention_torch,
                                                 paged_window_attention_triton)

    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    block = args.block
    blocks = -(-rows // block) + 1
    packed = torch.randn(blocks + 1, args.kv_heads, block, 2 * args.head_dim, device=dev, dtype=dtype, generator=gen)
    key_cache, value_cache = packed.transpose(1, 2).split(args.head_dim, dim=-1)
    table = (torch.randperm(blocks, device=dev, generator=gen) + 1).int()[None, :]
    logical = torch.arange(rows, device=dev)
    # a retention-like window: each row sees min(W, i + 1) entries (the densest case)
    count = torch.clamp(logical + 1, max=args.window)
    request = torch.zeros(rows, dtype=torch.long, device=dev)
    query = torch.randn(rows, args.heads, args.head_dim, device=dev, dtype=dtype, generator=gen)
    call = (query, key_cache, value_cache, table, request, logical, count)
    kw = dict(window=args.window, scale=args.head_dim ** -0.5)
    out = paged_window_attention(*call, **kw, impl="triton")
    ref = paged_window_attention_torch(*call, **kw)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    errors = {}
    for tiled in (False, True):
        forced = paged_window_attention_triton(*call, **kw, tiled=tiled)
        errors[tiled] = ((forced.float() - ref.float()).norm() / ref.float().norm()).item()
    k = key_cache[table[0, logical // block].long(), logical % block]  # [rows, Hk, D], contiguous rows
    v = value_cache[table[0, logical // block].long(), logical % block]
    group = args.heads // args.kv_heads
    q4 = query.transpose(0, 1)[None]
    k4 = k.transpose(0, 1).repeat_interleave(group, 0)[None]
    v4 = v.transpose(0, 1).repeat_interleave(group, 0)[None]
    distance = logical[:, None] - logical[None, :]
    mask = (distance >= 0) & (distance < args.window)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    variants = {}  # the tiled kernel's tuning knobs: query rows x heads per program, warps, entries a step, stages
    for tile_rows, warps, block_n, stages in TILED_VARIANTS:
        name = f"rows{tile_rows}-warps{warps}" + (f"-n{block_n}" if block_n else "") + (f"-s{stages}" if stages else "")
        try:
            def one(tile_rows=tile_rows, warps=warps, block_n=block_n, stages=stages):
                return paged_window_attention_triton(*call, **kw, tiled=True, tile_rows=tile_rows, num_warps=warps,
                                                     tile_block_n=block_n, num_stages=stages)
            rel = ((one().float() - ref.float()).norm() / ref.float().norm()).item()
            variants[name] = {"ms": _time(one, args.repeats), "rel_err": rel}
        except Exception as error:  # e.g. out of shared memory at this tile
            variants[name] = f"{type(error).__name__}: {str(error)[:200]}"
    return {
        "tiled_variants_ms": variants,
        "rows": rows, "rel_err": err, "rel_err_per_row": errors[False], "rel_err_tiled": errors[True],
        "triton_ms": _time(lambda: paged_window_attention(*call, **kw, impl="triton"), args.repeats),
        "per_row_ms": _time(lambda: paged_window_attention_triton(*call, **kw, tiled=False), args.repeats),
        "tiled_ms": _time(lambda: paged_window_attention_triton(*call, **kw, tiled=True), args.repeats),
        "reference_ms": _time(lambda: paged_window_attention_torch(*call, **kw), args.repeats),
        "sdpa_window_ms": _time(lambda: sdpa(q4, k4, v4, attn_mask=mask), args.repeats),
    }


def run_decode(rows: int, args) -> dict:
    """A decode step: `rows` requests, one row each at the end of a full window (entry 4095 of its own 256
    blocks): the per-row kernel with one program per row and KV head, and split over 2-8 programs a row."""
    from uniprefill.kernels.paged_window import paged_window_attention_torch, paged_window_attention_triton

    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(1)
    per_request = 4096 // args.block
    packed = torch.randn(rows * per_request + 1, args.kv_heads, args.block, 2 * args.head_dim, device=dev,
                         dtype=dtype, generator=gen)
    key_cache, value_cache = packed.transpose(1, 2).split(args.head_dim, dim=-1)
    table = (torch.randperm(rows * per_request, device=dev, generator=gen) + 1).int().view(rows, per_request)
    request = torch.arange(rows, device=dev)
    logical = torch.full((rows,), 4095, device=dev)
    count = torch.full((rows,), args.window, device=dev)
    query = torch.randn(rows, args.heads, args.head_dim, device=dev, dtype=dtype, generator=gen)
    call = (query, key_cache, value_cache, table, request, logical, count)
    kw = dict(window=args.window, scale=args.head_dim ** -0.5)
    ref = paged_window_attention_torch(*call, **kw)
    out = {"rows": rows}
    for splits in (1, 2, 4, 8):
        def one(splits=splits):
            return paged_window_attention_triton(*call, **kw, splits=splits)
        out[f"splits{splits}"] = {"ms": _time(one, args.repeats),
                                  "rel_err": ((one().float() - ref.float()).norm() / ref.float().norm()).item()}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4096,16384,32768")
    parser.add_argument("--decode-rows", default="1,4,16,64", help="decode steps of this many requests ('' for none)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    results = [run_one(int(r), args) for r in args.rows.split(",")]
    print("| rows | triton ms (per row / tiled) | reference ms | SDPA, uniform window, ms | rel. error (per row / tiled) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['per_row_ms']:.3f} / {r['tiled_ms']:.3f} | {r['reference_ms']:.3f} "
              f"| {r['sdpa_window_ms']:.3f} | {r['rel_err_per_row']:.1e} / {r['rel_err_tiled']:.1e} |")
    decode = [run_decode(int(r), args) for r in args.decode_rows.split(",") if r]
    if decode:
        print("| decode rows | per-row kernel ms: 1 / 2 / 4 / 8 programs a row |")
        print("|---|---|")
        for r in decode:
            print(f"| {r['rows']} | " + " / ".join(f"{r[f'splits{s}']['ms']:.4f}" for s in (1, 2, 4, 8)) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "device": torch.cuda.get_device_name(), "results": results,
                       "decode": decode}, f, indent=1)


if __name__ == "__main__":
    main()
