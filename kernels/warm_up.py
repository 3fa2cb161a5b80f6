"""Compile the score-and-select Triton kernels before a server's first requests.

Triton compiles a kernel once per specialisation: its constexprs, and for each integer
argument whether it equals 1 or is a multiple of 16. A serving engine meets new
specialisations in its first real steps: the first step with several dropping prompts (the
sequence count was 1, then 2..15, then a multiple of 16), the first prompt whose token count
is not a multiple of 16, the first prompt long enough for a larger sort in `select_blocks`
(its block count rounded up to a power of two, at least 256 on the GPU). Each costs a
compile inside a request's prefill: on the H200 on 2026-12-01, Gemma-3-270M's first step
with four dropping prompts took 2.1 s instead of ~0.2 s in vLLM, and
`scripts/gpu/probe_first_calls.py` counted 14 compiles over a server's first nine prefills
(0.9-6.6 s each step that met one); after this warm-up (14.8 s, 16 compiles) the same steps
compiled nothing (docs/benchmarks.md, "First-call compiles").

`warm_up_score_and_select` runs `score_and_select` on small random inputs for 1, 2 and 16
sequences with a total token count that is and one that is not a multiple of 16, then
`select_blocks` and `compact_tokens` on random block scores for every sort size up to
`max_seqlen`, in each selection mode the caller may use (one p, a p per sequence, or a
forced keep ratio: one `SelectionRule` each). Nothing it computes is kept. The largest input is 16 sequences of a few
hundred tokens, so it adds little to a profiling run's memory.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ._common import cdiv, next_power_of_2
from .api import compact_tokens, score_and_select, select_blocks
from .score_blocks.reference import block_offsets
from .rule import SelectionRule

SEQUENCE_COUNTS = (1, 2, 16)  # == 1, neither, a multiple of 16: Triton's integer specialisations


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What `warm_up_score_and_select` ran: calls of each API function, and the wall time."""

    score_and_select_calls: int
    select_calls: int
    seconds: float


def _offsets(lengths: list[int], device) -> tuple[torch.Tensor, list[int]]:
    host = [0]
    for n in lengths:
        host.append(host[-1] + n)
    return torch.tensor(host, dtype=torch.int32, device=device), host


def selection_modes(p: float, keep_ratio: float | None, per_sequence_p: bool) -> list[tuple[str, float | None]]:
    """(p kind, keep ratio) pairs to compile: a forced keep ratio ignores p; otherwise one p
    for all sequences and, when requests may bring their own, a p per sequence."""
    if keep_ratio is not None:
        return [("one", keep_ratio)]
    return [("one", None)] + ([("per_sequence", None)] if per_sequence_p else [])


def _rule_for(base: SelectionRule, kind: str, keep_ratio: float | None, batch: int,
              per_sequence_sink: bool = False) -> SelectionRule:
    """`base` in one selection mode: its p for every sequence, or as a tensor of `batch` copies; its sink as one
    number, or (`per_sequence_sink`) as a tensor of `batch` copies."""
    p = torch.full((batch,), base.p, dtype=torch.float32) if kind == "per_sequence" else base.p
    sink = torch.full((batch,), base.sink, dtype=torch.int64) if per_sequence_sink else base.sink
    return dataclasses.replace(base, p=p, sink=sink, keep_ratio=keep_ratio)


def warm_up_score_and_select(*, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             device: torch.device | str, block_size: int, sink: int, last_q: int,
                             min_tokens: int, max_seqlen: int, p: float = 0.95, keep_ratio: float | None = None,
                             per_sequence_p: bool = True, impl: str = "auto", selection: str = "paper",
                             per_sequence_sink: bool = False) -> WarmUp:
    """Run the kernel variants a server will meet (module docstring); returns what ran. `per_sequence_sink`: the
    caller passes its sink counts as a tensor (one per sequence, the vLLM runtime's selection), so compile that
    variant instead of the one-number one."""
    start = time.perf_counter()
    base = SelectionRule(block_size=block_size, sink=sink, last_q=last_q, min_tokens=min_tokens, p=p,
                         keep_ratio=keep_ratio, selection=selection)
    modes = selection_modes(p, keep_ratio, per_sequence_p)
    generator = torch.Generator(device=device).manual_seed(0)
    # The shortest prompt that drops, rounded up to a multiple of 16; the odd variant makes the
    # first prompt one token longer, so that the total token count is not a multiple of 16 for
    # any sequence count (16 equal odd prompts would sum to a multiple of 16).
    even = cdiv(max(base.effective_min_tokens, 2 * block_size), 16) * 16
    scored = 0
    for batch in SEQUENCE_COUNTS:
        for extra in (0, 1):
            lengths = [even + extra] + [even] * (batch - 1)
            length = even + extra
            n_q = [min(n, last_q) for n in lengths]
            q = torch.randn(sum(n_q), num_heads, head_dim, generator=generator, device=device).to(dtype)
            k = torch.randn(sum(lengths), num_kv_heads, head_dim, generator=generator, device=device).to(dtype)
            (cu_q, host_q), (cu_k, host_k) = _offsets(n_q, device), _offsets(lengths, device)
            for kind, ratio in modes:
                score_and_select(q, k, cu_q, cu_k, length, _rule_for(base, kind, ratio, batch, per_sequence_sink),
                                 scale=head_dim ** -0.5, impl=impl, host_cu_seqlens=(host_q, host_k))
                scored += 1
    selected = 0
    from .select_blocks.kernel import MAX_BLOCKS_PER_SEQUENCE  # imports Triton: only where its kernels run

    most_blocks = min(next_power_of_2(cdiv(max_seqlen, block_size)), MAX_BLOCKS_PER_SEQUENCE)
    for batch in SEQUENCE_COUNTS[:2]:
        blocks = 1
        while blocks <= most_blocks:  # every power of two: each sort size the kernel rounds to
            lengths = [blocks * block_size] * batch
            cu_k, _ = _offsets(lengths, device)
            cu_blocks = block_offsets(cu_k, block_size)
            scores = torch.rand(batch * blocks, generator=generator, device=device)
            for kind, ratio in modes:
                rule = _rule_for(base, kind, ratio, batch, per_sequence_sink)
                keep = select_blocks(scores, cu_blocks, cu_k, rule, impl=impl, max_seqlen_k=lengths[0])
                compact_tokens(keep, cu_blocks, cu_k, block_size, impl=impl)
                selected += 1
            blocks *= 2
    return WarmUp(scored, selected, time.perf_counter() - start)
