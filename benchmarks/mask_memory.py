"""Peak host memory of building one sliding-window mask, block by block vs whole (CPU).

`uniprefill.ops.dense_mask` gives the sliding layers before the first drop point one additive
`[N, N]` mask. It used to build the whole boolean mask, then its negation and the float mask:
four N x N buffers at once. `ops.additive_position_mask` now fills the float mask a block of
query rows at a time. This script builds the mask both ways, each in its own process, and
prints the growth of the process's peak resident memory (`ru_maxrss`) beside the mask's size:

    python3 benchmarks/mask_memory.py --tokens 16384 --window 1024

The GPU figure that matters (`torch.cuda.max_memory_allocated` of a 128K prefill) is in
`docs/benchmarks.md`; this is the same effect measured where CI runs.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys


def build(how: str, tokens: int, window: int) -> None:
    import torch

    from uniprefill import ops

    q = torch.zeros(1, 1, tokens, 8, dtype=torch.bfloat16)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if how == "whole":  # the construction before the fix, kept here for the comparison only
        pos = torch.arange(tokens)
        visible = ops._position_mask(pos, pos, window)[None, None]
        mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(visible.logical_not(), float("-inf"))
    else:
        mask = torch.ops.uniprefill.dense_mask(q, None, window, None)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"{how:6s}  mask {mask.numel() * mask.element_size() / 2**20:8.0f} MiB   peak growth {grown:8.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--how", choices=("whole", "blocks"), help=argparse.SUPPRESS)  # one child process
    args = parser.parse_args()
    if args.how:
        build(args.how, args.tokens, args.window)
        return
    for how in ("whole", "blocks"):
        subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--window", str(args.window),
                        "--how", how], check=True)


if __name__ == "__main__":
    main()
