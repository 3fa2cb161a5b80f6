"""A fake vLLM forward context for the vLLM-rewrite tests (not a test module; `pythonpath` in
pyproject.toml puts tests/ on the path): per KV-cache group one block table, one metadata
object shaped like vLLM 0.26's `FlashAttentionMetadata` shared by the group's layers and one
slot mapping by vLLM's formula; per layer its own paged cache `[2, slots, kv heads, head size]`."""

from __future__ import annotations

import dataclasses
import types

import torch


@dataclasses.dataclass
class FlashMeta:  # the fields of vLLM 0.26's FlashAttentionMetadata that attention reads
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    use_cascade: bool = False
    scheduler_metadata: object = None
    causal: bool = True


def make_world(query_lens: list[int], *, layers: int, groups: int, block: int, kv_heads: int, head_size: int,
               dtype: torch.dtype = torch.float32, room: int = 8, request_prefix: str = "req-"):
    """A prefill-only step of fresh requests: layer i in group i % groups; blocks for `room`
    more tokens per request are allocated (decode steps); block 0 is vLLM's null block."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    blocks_per_req = [-(-(q + room) // block) for q in query_lens]
    tables = []
    for g in range(groups):
        ids = torch.randperm(sum(blocks_per_req), generator=torch.Generator().manual_seed(g)) + 1
        table = torch.zeros(len(query_lens), max(blocks_per_req), dtype=torch.int32)
        start = 0
        for r, n in enumerate(blocks_per_req):
            table[r, :n] = ids[start:start + n]
            start += n
        tables.append(table)
    num_slots = (sum(blocks_per_req) + 1) * block
    world = types.SimpleNamespace(
        names=names, tables=tables, groups=groups, block=block, windows={}, visible=None,
        request_ids=[f"{request_prefix}{r}" for r in range(len(query_lens))],
        kv_caches={n: torch.zeros(2, num_slots, kv_heads, head_size, dtype=dtype) for n in names})
    return step(world, [0] * len(query_lens), query_lens)


def step(world, computed: list[int], query_lens: list[int]):
    """vLLM's metadata for a step in which request r has `computed[r]` tokens cached and
    `query_lens[r]` new ones (one shared object per group, slots by vLLM's formula)."""
    block = world.block
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(computed, query_lens)], dtype=torch.int32)
    metas, slots_of_group = [], []
    for table in world.tables:
        logical = [torch.arange(c, c + q) for c, q in zip(computed, query_lens)]
        slots = torch.cat([table[r, idx // block].long() * block + idx % block for r, idx in enumerate(logical)])
        metas.append(FlashMeta(int(qsl[-1]), max(query_lens), qsl, int(seq_lens.max()), seq_lens, table, slots))
        slots_of_group.append(slots)
    world.attn_metadata = {n: metas[i % world.groups] for i, n in enumerate(world.names)}
    world.slot_mapping = {n: slots_of_group[i % world.groups] for i, n in enumerate(world.names)}
    return world
