"""A differential fuzzer of one sliding layer's step after a drop in vLLM (`uniprefill.vllm.window.paged_window_step`):
random steps of 1-6 requests (decode rows, short prompts, prompts of 16-70 rows: steps on the per-row kernel, the tiled
one, or both, "mixed"), random windows, heads, head sizes, cache blocks, softcaps and padded buffers. Each step runs
on the Triton kernels (Triton's CPU interpreter with the tensors on the CPU; compiled with `--device cuda`) and on
the PyTorch reference (float32 throughout; the kernels' dots are IEEE);
equal within 1e-5 on every row of the step, and the padding rows untouched. A mixed step is also run the way it ran
before the kernels took `rows=` (each kernel's rows gathered into a query of their own, the output copied back): equal
bit for bit.

    TRITON_INTERPRET=1 python scripts/fuzz_window_steps.py --seed 1000 --seconds 900
    python scripts/fuzz_window_steps.py --device cuda --seed 1000 --seconds 120     # on a GPU
"""
import argparse
import random
import time
import types

import torch
from uniprefill.kernels.paged_window import paged_window_attention

from uniprefill.vllm.drop_records import WindowLayer, WindowRows
from uniprefill.vllm.window import kernel_plan, paged_window_step, split_count


def layout(lens, device):
    """What `kernel_plan` reads of a step's layout."""
    qsl = torch.tensor([0] + lens).cumsum(0)
    return types.SimpleNamespace(query_lens_cpu=torch.tensor(lens), query_start_loc_cpu=qsl,
                                 query_start_loc=qsl.to(device))


def case(seed: int, device: str = "cpu") -> str:
    """One random step; its kernel plan."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    reqs = rng.randint(1, 6)
    lens = [rng.choice([1, 1, rng.randint(2, 15), rng.randint(16, 70)]) for _ in range(reqs)]
    kv_heads, dim, block = rng.choice([1, 2]), rng.choice([8, 16]), rng.choice([4, 16])
    window = rng.choice([4, 24, 64, 200])
    heads = kv_heads * rng.choice([1, 2, 4])
    maxlog = 300
    blocks_per = -(-maxlog // block)
    num_blocks = reqs * blocks_per + 1
    packed = torch.randn(num_blocks, kv_heads, block, 2 * dim)
    key_cache, value_cache = packed.transpose(1, 2).split(dim, dim=-1)
    table = (torch.randperm(num_blocks - 1)[:reqs * blocks_per].view(reqs, blocks_per) + 1).int()
    request = torch.repeat_interleave(torch.arange(reqs), torch.tensor(lens))
    logical = torch.cat([torch.arange(s, s + n) for s, n in ((rng.randint(0, maxlog - n), n) for n in lens)])
    count = torch.minimum(torch.randint(1, window + 1, logical.shape), logical + 1)
    T = int(sum(lens))
    extra = rng.randint(0, 3)  # output/query buffers longer than the step (vLLM's padded buffers)
    query = torch.randn(T + extra, heads * dim)
    packed, table, request, logical, count, query = (t.to(device) for t in (packed, table, request, logical, count,
                                                                            query))
    key_cache, value_cache = packed.transpose(1, 2).split(dim, dim=-1)
    kernel, tiled_rows, per_row_rows = kernel_plan(layout(lens, device))
    rows = WindowRows(table, request, logical, count, kernel, tiled_rows, per_row_rows)
    cache = WindowLayer(key_cache, value_cache, dim ** -0.5, rng.choice([None, 5.0]))
    outs = {}
    for impl in ("triton", "torch"):
        out = torch.full_like(query, float("nan"))
        paged_window_step(query, out, rows, cache, window, impl)
        outs[impl] = out
    ref = outs["torch"]
    assert torch.isnan(outs["triton"][T:]).all(), seed
    torch.testing.assert_close(outs["triton"][:T], ref[:T], atol=1e-5, rtol=1e-5, msg=f"seed {seed} {lens}")
    if kernel == "mixed":  # the old path: gather, run on a compact query, copy back
        q = query[:T].view(T, heads, dim)
        old = torch.full((T, heads, dim), float("nan"), device=device)
        for which, tiled in ((tiled_rows, True), (per_row_rows, False)):
            n = which.numel()
            splits = 1 if tiled else split_count(n * kv_heads, window)
            got = paged_window_attention(q[which], key_cache, value_cache, table, request[which], logical[which],
                                         count[which], window=window, scale=dim ** -0.5, softcap=cache.softcap,
                                         impl="triton", tiled=tiled, splits=splits)
            old.index_copy_(0, which, got)
        assert torch.equal(old.view(T, -1), outs["triton"][:T]), f"seed {seed}: in-place differs from gathered"
    return kernel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed (then +1 per case)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--device", default="cpu", help="cpu (set TRITON_INTERPRET=1) or cuda")
    args = parser.parse_args(argv)
    start, seed, kinds = time.time(), args.seed, {}
    while time.time() - start < args.seconds:
        kind = case(seed, args.device)  # raises, naming the seed, on the first difference
        kinds[kind] = kinds.get(kind, 0) + 1
        seed += 1
    print(f"{args.device}: {sum(kinds.values())} steps {kinds} in {time.time() - start:.0f} s, seeds {args.seed}-{seed - 1}: "
          "all equal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
