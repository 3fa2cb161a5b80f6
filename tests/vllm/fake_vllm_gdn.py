"""The fake vLLM's Gated DeltaNet side (Qwen3-Next), for `test_vllm_gdn.py` (not a test module).

- `FakeCommon`: the fields of vLLM 0.26's `CommonAttentionMetadata` that GDN's builder reads, with its
  `replace` and `compute_num_computed_tokens`.
- `FakeGDNBuilder.build`: vLLM 0.26's `GDNAttentionMetadataBuilder.build` without speculative decoding
  ([read] vllm/v1/attention/backends/gdn_attn.py): requests split by `split_decodes_and_prefills` (vLLM's rule:
  the LEADING requests of at most one row are decodes; a batch whose longest query is one row is all decodes),
  the state slot `block_table[:, 0]`, `has_initial_state` (context > 0) only when there are prefills.
- The op `uniprefill_fakevllm::gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name=...)`: a gated
  linear recurrence per request, `h = sigmoid(a) * h + b * x`, output h, through the metadata as vLLM's op goes:
  the first `num_actual_tokens` rows, per-request rows from `non_spec_query_start_loc`, the state slot's state
  as the start of a decode (never zeroed: vLLM's decode kernels) and of a prefill with `has_initial_state`.
  State slots start filled with garbage, as vLLM leaves freed Mamba blocks.
- `HybridBackbone`: Qwen3-Next's pattern in small (`KINDS`), with `reference` over kept rows.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fake_vllm_model import (BLOCK, DIM, HEADS, HIDDEN, VOCAB, WORLD, TinyBackbone, causal_attention, fake_context,
                             rope, step_context)

KINDS = ["linear", "full", "linear", "full", "linear", "linear"]  # attention at 1 and 3, GDN after both
CHANNELS = 8
GDN_GROUPS = 2  # GDN layers in KV-cache groups by order: 0 and 4 in one, 2 and 5 in the other (vLLM shares one
# metadata object per group)


@dataclasses.dataclass
class FakeCommon:
    query_start_loc: torch.Tensor  # [R + 1] int32
    query_start_loc_cpu: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor  # [R, blocks] int32
    _num_computed_tokens_cache: torch.Tensor | None = None
    _token_to_req_indices_cache: torch.Tensor | None = None

    def replace(self, **kwargs) -> "FakeCommon":
        return dataclasses.replace(self, **kwargs)

    def compute_num_computed_tokens(self) -> torch.Tensor:
        if self._num_computed_tokens_cache is None:
            self._num_computed_tokens_cache = self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])
        return self._num_computed_tokens_cache


@dataclasses.dataclass
class FakeGDNMeta:
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_spec_decodes: int
    num_actual_tokens: int
    non_spec_query_start_loc: torch.Tensor
    non_spec_state_indices_tensor: torch.Tensor
    has_initial_state: torch.Tensor | None
    prefill_query_start_loc: torch.Tensor | None  # from the HOST copy, as vLLM's chunk and conv1d metadata


def split_decodes_and_prefills(m: FakeCommon) -> tuple[int, int, int, int]:
    """vLLM 0.26's rule with decode_threshold=1 (vllm/v1/attention/backends/utils.py)."""
    qsl = m.query_start_loc_cpu
    lens = qsl[1:] - qsl[:-1]
    if m.max_query_len <= 1:
        return m.num_reqs, 0, m.num_actual_tokens, 0
    if int(lens[0]) > 1:
        return 0, m.num_reqs, 0, m.num_actual_tokens
    first_prefill = int(torch.argmax((lens > 1).int()))
    decode_tokens = int(qsl[first_prefill])
    return first_prefill, m.num_reqs - first_prefill, decode_tokens, m.num_actual_tokens - decode_tokens


class FakeGDNBuilder:
    """`align_block`: vLLM's `mamba_cache_mode="align"` (prefix caching on), where the state slot is the block
    table's column `(seq_lens - 1) // align_block` (`mamba_get_block_table_tensor`); None: column 0."""

    def __init__(self, align_block: int | None = None) -> None:
        self.align_block = align_block

    def build(self, common_prefix_len: int, m: FakeCommon, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build: bool = False) -> FakeGDNMeta:
        context = m.compute_num_computed_tokens()
        decodes, prefills, decode_tokens, prefill_tokens = split_decodes_and_prefills(m)
        table = m.block_table_tensor
        if self.align_block is not None:
            table = table.gather(1, ((m.seq_lens.long() - 1) // self.align_block)[:, None])
        prefill_qsl = (m.query_start_loc_cpu[decodes:] - decode_tokens).clone() if prefills else None
        return FakeGDNMeta(prefills, prefill_tokens, decodes, decode_tokens, 0, m.num_actual_tokens, m.query_start_loc,
                           table[:, 0], context > 0 if prefills else None, prefill_qsl)


@torch.library.custom_op("uniprefill_fakevllm::gdn_attention_core", mutates_args=("core_attn_out",))
def gdn_attention_core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core_attn_out: torch.Tensor,
                       layer_name: str) -> None:
    ctx = WORLD.context
    if ctx.attn_metadata is None:  # a profiling run
        return
    meta = ctx.attn_metadata[layer_name]
    states = ctx.gdn_states[layer_name]  # [slots, CHANNELS]
    n = meta.num_actual_tokens
    assert int(meta.non_spec_query_start_loc[-1]) == n <= mixed_qkv.shape[0], \
        f"{layer_name}: metadata for {n} rows, {mixed_qkv.shape[0]} came"
    gate, scale = torch.sigmoid(a[:n]), b[:n]
    # vLLM's order: the decodes' rows first (one each, their state as it is), then the prefills' by their host-built
    # cu_seqlens (zero state unless `has_initial_state`)
    runs = [(r, r, r + 1) for r in range(meta.num_decodes)]
    if meta.num_prefills:
        qsl = (meta.prefill_query_start_loc + meta.num_decode_tokens).tolist()
        runs += [(meta.num_decodes + j, qsl[j], qsl[j + 1]) for j in range(meta.num_prefills)]
    for r, first, last in runs:
        slot = int(meta.non_spec_state_indices_tensor[r])
        starts_from_state = r < meta.num_decodes or bool(meta.has_initial_state[r])
        h = states[slot].clone() if starts_from_state else torch.zeros(CHANNELS)
        for t in range(first, last):
            h = gate[t] * h + scale[t] * mixed_qkv[t]
            core_attn_out[t] = h
        states[slot] = h


@gdn_attention_core.register_fake
def _(mixed_qkv, b, a, core_attn_out, layer_name):
    return None


def layer_name(i: int) -> str:
    return f"model.layers.{i}.linear_attn" if KINDS[i] == "linear" else f"model.layers.{i}.self_attn.attn"


def gdn_world(query_lens: list[int], builder: FakeGDNBuilder, room: int = 8):
    """`fake_context` plus GDN state slots (garbage-filled) and per-group slot tables; then `gdn_step`."""
    world = fake_context(query_lens, room=room)
    torch.manual_seed(7)
    slots = 2 * len(query_lens) * GDN_GROUPS + 1
    world.gdn_states = {layer_name(i): torch.randn(slots, CHANNELS) for i, k in enumerate(KINDS) if k == "linear"}
    world.gdn_tables = [torch.randperm(slots - 1)[:len(query_lens)].add(1).to(torch.int32)[:, None]
                        for _ in range(GDN_GROUPS)]
    world.gdn_builder = builder
    return gdn_step(world, [0] * len(query_lens), query_lens)


def gdn_step(world, computed: list[int], query_lens: list[int]):
    """The fake vLLM's step (`step_context`) plus one GDN metadata object per group, built by the builder."""
    ctx = step_context(world, computed, query_lens)
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(computed, query_lens)], dtype=torch.int32)
    metas = [world.gdn_builder.build(0, FakeCommon(qsl, qsl.clone(), seq_lens, len(query_lens), int(qsl[-1]),
                                                    max(query_lens), table))
             for table in world.gdn_tables]
    linear = [layer_name(i) for i, k in enumerate(KINDS) if k == "linear"]
    for g, name in enumerate(linear):
        ctx.attn_metadata[name] = metas[g % GDN_GROUPS]
    return ctx


class HybridBackbone(nn.Module):
    """Token-major, vLLM style, GDN and attention layers in Qwen3-Next's manner."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = len(KINDS)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, 3 * HEADS * DIM, bias=False) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(HEADS * DIM, HIDDEN, bias=False) for _ in range(layers))
        self.gdn_in = nn.ModuleList(nn.Linear(HIDDEN, 3 * CHANNELS) for _ in range(layers))
        self.gdn_out = nn.ModuleList(nn.Linear(CHANNELS, HIDDEN, bias=False) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, 64), nn.GELU(), nn.Linear(64, HIDDEN))
                                 for _ in range(layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for i, kind in enumerate(KINDS):
            if kind == "linear":
                mixed, b, a = self.gdn_in[i](x).chunk(3, -1)
                # vLLM's fix_query_key_value_ordering: a reshape whose -1 divides by the row count (on the H200 its
                # fake run needed the kept count known to be >= 1)
                mixed = mixed.reshape(mixed.size(0), -1, 4).reshape(mixed.size(0), CHANNELS)
                out = torch.zeros((x.shape[0], CHANNELS))  # as vLLM's GDN layer: zeros, filled by the op
                torch.ops.uniprefill_fakevllm.gdn_attention_core(mixed, b, a, out, layer_name=layer_name(i))
                x = x + self.gdn_out[i](out)
            else:
                name = layer_name(i)
                q, k, v = self.qkv[i](x).view(-1, 3, HEADS, DIM).unbind(1)
                q, k = rope(q, positions), rope(k, positions)
                out = torch.empty((q.shape[0], HEADS, DIM))
                dep = torch.ops.uniprefill_fakevllm.unified_kv_cache_update(k, v, name)
                torch.ops.uniprefill_fakevllm.unified_attention_with_output(q, k, v, out, name, kv_cache_dummy_dep=dep)
                x = x + self.o[i](out.view(-1, HEADS * DIM))
            x = x + self.mlp[i](x)
        return x

    def reference(self, ids: torch.Tensor, kept: dict[int, torch.Tensor]) -> torch.Tensor:
        """One request alone from an empty state; `kept[layer]` = rows kept right after that layer's attention."""
        x, positions = self.embed(ids), torch.arange(ids.numel())
        for i, kind in enumerate(KINDS):
            if kind == "linear":
                mixed, b, a = self.gdn_in[i](x).chunk(3, -1)
                h, rows = torch.zeros(CHANNELS), []
                for t in range(x.shape[0]):
                    h = torch.sigmoid(a[t]) * h + b[t] * mixed[t]
                    rows.append(h)
                x = x + self.gdn_out[i](torch.stack(rows))
            else:
                q, k, v = self.qkv[i](x).view(-1, 3, HEADS, DIM).unbind(1)
                q, k = rope(q, positions), rope(k, positions)
                x = x + self.o[i](causal_attention(q, k, v).reshape(-1, HEADS * DIM))
                if i in kept:
                    x, positions = x[kept[i]], positions[kept[i]]
            x = x + self.mlp[i](x)
        return x[-1]

    decode_reference = TinyBackbone.decode_reference  # the same composition of kept rows, over this `reference`


__all__ = ["BLOCK", "KINDS", "FakeGDNBuilder", "HybridBackbone", "gdn_step", "gdn_world", "layer_name"]
