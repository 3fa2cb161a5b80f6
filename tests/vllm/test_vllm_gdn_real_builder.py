"""`gdn_metadata.rebuild_for_rows` against vLLM 0.26's own `GDNAttentionMetadataBuilder` (needs vLLM importable: skipped
in CI; runs on the GPU box, and on CPU with vLLM's wheel unpacked on the path, its pinned-memory switch off).

The oracle: vLLM's builder on the batch the kept rows make, described natively (query lengths = the kept counts,
`seq_lens` = context + kept). In `mamba_cache_mode="none"` every field of the rebuild must equal the oracle's: the
counts, the cu_seqlens (device and the prefill ones), the FLA chunk indices and offsets, the causal-conv1d pointers,
`has_initial_state` and the state slots. In "align" the state slots must stay those vLLM picked from the ORIGINAL
`seq_lens` (the request's cache block), where the oracle's would move.
"""

from __future__ import annotations

import types

import pytest
import torch

gdn_attn = pytest.importorskip("vllm.v1.attention.backends.gdn_attn")
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from uniprefill.vllm import gdn_metadata  # noqa: E402

FIELDS = ("num_prefills", "num_prefill_tokens", "num_decodes", "num_decode_tokens", "num_spec_decodes",
          "num_actual_tokens", "non_spec_query_start_loc", "non_spec_state_indices_tensor", "has_initial_state",
          "prefill_query_start_loc", "prefill_state_indices", "prefill_has_initial_state", "chunk_indices",
          "chunk_offsets", "batch_ptr", "token_chunk_offset_ptr")


@pytest.fixture
def builder_cls(monkeypatch):
    if not torch.cuda.is_available():  # vLLM pins its host copies; CPU-only torch has no pinned allocator
        import vllm.utils.torch_utils as torch_utils
        import vllm.v1.attention.backends.utils as backend_utils

        monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
        monkeypatch.setattr(backend_utils, "PIN_MEMORY", False)
    cls = gdn_attn.GDNAttentionMetadataBuilder
    gdn_metadata.record_builds(cls)
    yield cls
    gdn_metadata.unrecord_builds(cls)


def make_builder(cls, mode: str, block: int):
    """vLLM's builder without its engine: the attributes `build` reads (no speculative decoding, no full graphs)."""
    builder = cls.__new__(cls)
    builder.vllm_config = types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode=mode))
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec.__new__(MambaSpec)  # the two fields `mamba_get_block_table_tensor` reads ("align" checks the type)
    object.__setattr__(spec, "block_size", block)
    object.__setattr__(spec, "num_speculative_blocks", 0)
    builder.kv_cache_spec = spec
    builder.use_spec_decode, builder.num_spec, builder.use_full_cuda_graph = False, 0, False
    builder.gdn_prefill_backend, builder.decode_cudagraph_max_bs = "triton", 8
    return builder


def common(query_lens: list[int], context: list[int], table: torch.Tensor) -> CommonAttentionMetadata:
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(context, query_lens)], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
        block_table_tensor=table, slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64))


def value(x):
    if isinstance(x, dict):
        return {k: value(v) for k, v in x.items()}
    return x.tolist() if isinstance(x, torch.Tensor) else x


# (query lengths, context, kept counts): decodes first, as vLLM orders them; fresh prompts and last chunks
CASES = [([300, 120], [0, 0], [90, 40]),
         ([1, 1, 300, 120], [50, 70, 0, 80], [1, 1, 90, 40]),
         ([1, 700, 65, 2000], [10, 4096, 0, 0], [1, 200, 65, 321])]


@pytest.mark.parametrize("query_lens, context, kept", CASES, ids=["prefills", "decodes-and-a-last-chunk", "long"])
def test_the_rebuild_equals_vllms_builder_on_the_kept_batch(builder_cls, query_lens, context, kept):
    builder = make_builder(builder_cls, "none", 64)
    table = torch.arange(3, 3 + 2 * len(query_lens), dtype=torch.int32).view(-1, 2)
    meta = builder.build(0, common(query_lens, context, table))
    kept_qsl = torch.tensor([0] + kept).cumsum(0).to(torch.int32)
    rebuilt = gdn_metadata.rebuild_for_rows(meta, kept_qsl, kept_qsl.clone(), max(kept))
    oracle = builder.build(0, common(kept, context, table))
    for field in FIELDS + ("nums_dict",):
        assert value(getattr(rebuilt, field)) == value(getattr(oracle, field)), field
    assert rebuilt.num_actual_tokens == sum(kept) < meta.num_actual_tokens


def test_in_align_mode_the_state_slots_stay_vllms(builder_cls):
    builder = make_builder(builder_cls, "align", 64)
    table = torch.arange(1, 1 + 2 * 8, dtype=torch.int32).view(2, 8)
    meta = builder.build(0, common([300, 150], [0, 100], table))
    kept_qsl = torch.tensor([0, 90, 140], dtype=torch.int32)
    rebuilt = gdn_metadata.rebuild_for_rows(meta, kept_qsl, kept_qsl.clone(), 90)
    assert value(meta.non_spec_state_indices_tensor) == [5, 12]  # columns 299 // 64 = 4 and 249 // 64 = 3
    assert value(rebuilt.non_spec_state_indices_tensor) == [5, 12]
    assert value(rebuilt.has_initial_state) == [False, True] and rebuilt.num_actual_tokens == 140
