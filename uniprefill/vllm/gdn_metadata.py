"""Gated DeltaNet layers (Qwen3-Next) after a drop point in vLLM: their metadata built again for the kept rows.

vLLM 0.26 runs a GDN layer's causal conv1d and delta rule inside the op
`vllm::qwen_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name=...)`, which reads
`forward_context.attn_metadata[layer_name]`: a `GDNAttentionMetadata` that
`GDNAttentionMetadataBuilder.build(common_prefix_len, common_attn_metadata, num_accepted_tokens,
num_decode_draft_tokens_cpu)` makes once per KV-cache group per step ([read] vllm/v1/attention/backends/gdn_attn.py).
Part of it follows each request's query length: the prefill/decode counts, `num_actual_tokens`, the
`*_query_start_loc` cu_seqlens, the FLA chunk indices and the causal-conv1d pointers (`nums_dict`, `batch_ptr`,
`token_chunk_offset_ptr`, computed on the host from `query_start_loc_cpu`). The rest follows the request alone:
its state slot (`block_table[:, 0]`, or the column `seq_lens` picks in `mamba_cache_mode="align"`, which prefix
caching turns on for Qwen3-Next) and `has_initial_state` (context > 0).

After a drop point the op gets the kept rows only, so those fields must describe them. Rather than re-derive
vLLM's arithmetic, `rebuild_for_rows` calls vLLM's own builder again on its own `CommonAttentionMetadata` with
`query_start_loc` (device and host), `num_actual_tokens` and `max_query_len` of the kept rows, and everything
that follows the request left as vLLM gave it: `seq_lens` and the block table (the state slot), and the
context count (`_num_computed_tokens_cache`, which `has_initial_state` reads; from the replaced fields the
builder would compute a wrong one). The recurrent state then holds the recurrence over the kept rows, which is
what the method means by running every later sublayer on the kept tokens; decode needs nothing more.

`record_builds(builder_cls)` wraps the builder class's `build` (reversibly, `class_patch`) so that each result
carries its inputs; the hooks install it on vLLM's class (`VllmHooks.from_vllm`), tests on a fake one.

One guard. vLLM's builder classifies requests as decodes by their row count (`split_decodes_and_prefills`:
leading requests of at most one row), and its decode kernels read the state slot without `has_initial_state`:
a fresh prompt cut to one row would read the slot's previous owner's state. A request that drops keeps at
least its last `last_q` rows, and the plugin refuses Gated DeltaNet graphs with `last_q < 2`
(`plugin._rewrite`), so this does not happen; `rebuild_for_rows` still checks that the rebuilt metadata counts
the same decodes and spec decodes as vLLM's, and raises rather than run a decode kernel on an unwritten state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .class_patch import unwrap_method, wrap_method

_MARK = "_uniprefill_gdn_record"
BUILD_INPUTS = "_uniprefill_build_inputs"  # the attribute of a built metadata object that holds its `BuildInputs`


@dataclass(frozen=True)
class BuildInputs:
    """What one `build` call got: the builder, and its arguments."""

    builder: Any
    common_prefix_len: int
    common: Any  # vLLM's CommonAttentionMetadata of the step (this KV-cache group's block table)
    extra: tuple  # num_accepted_tokens, num_decode_draft_tokens_cpu, ... as passed
    kwargs: dict


def record_builds(builder_cls: Any) -> bool:
    """Wrap `builder_cls.build` so that every result remembers its `BuildInputs`; False when already wrapped."""

    def make(original):
        def build(self, common_prefix_len, common_attn_metadata, *extra, **kwargs):
            result = original(self, common_prefix_len, common_attn_metadata, *extra, **kwargs)
            setattr(result, BUILD_INPUTS, BuildInputs(self, common_prefix_len, common_attn_metadata, extra, kwargs))
            return result

        return build

    return wrap_method(builder_cls, "build", make, _MARK)


def unrecord_builds(builder_cls: Any) -> bool:
    return unwrap_method(builder_cls, "build", _MARK)


def record_vllm_builds() -> bool:
    """`record_builds` on vLLM 0.26's `GDNAttentionMetadataBuilder` (False: already recorded, or no such class)."""
    try:
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    except ImportError:
        return False
    return record_builds(GDNAttentionMetadataBuilder)


def rebuild_for_rows(meta: Any, query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor,
                     max_query_len: int) -> Any:
    """vLLM's GDN metadata for the step's requests holding the given rows (module docstring).

    `meta`: the metadata vLLM built for the step (or one this function built: its inputs are vLLM's).
    `query_start_loc` [R + 1] int32 on the device and `query_start_loc_cpu` on the host: the kept rows per request.
    """
    inputs: BuildInputs | None = getattr(meta, BUILD_INPUTS, None)
    if inputs is None:
        raise RuntimeError(f"a Gated DeltaNet layer's metadata ({type(meta).__name__}) carries no record of its build: "
                           "uniprefill.vllm.gdn_metadata.record_builds is not installed on its builder class, so its "
                           "metadata cannot be rebuilt for the kept rows")
    common = inputs.common
    context = common.compute_num_computed_tokens()  # vLLM's context per request, from vLLM's own fields
    kept = common.replace(query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc_cpu.to(torch.int32),
                          num_actual_tokens=int(query_start_loc_cpu[-1]), max_query_len=int(max_query_len),
                          _num_computed_tokens_cache=context, _token_to_req_indices_cache=None)
    rebuilt = inputs.builder.build(inputs.common_prefix_len, kept, *inputs.extra, **inputs.kwargs)
    for field in ("num_decodes", "num_spec_decodes"):
        if getattr(rebuilt, field, 0) != getattr(meta, field, 0):
            raise RuntimeError(f"the Gated DeltaNet metadata rebuilt for the kept rows has {field}="
                               f"{getattr(rebuilt, field, 0)} where vLLM's has {getattr(meta, field, 0)}: a request "
                               "left with one row would run vLLM's decode kernels on a state it never wrote")
    setattr(rebuilt, BUILD_INPUTS, inputs)
    return rebuilt


def install_rows(attn_metadata: dict, names: list[str], query_start_loc: torch.Tensor,
                 query_start_loc_cpu: torch.Tensor, max_query_len: int) -> int:
    """Replace the metadata of the GDN layers `names` by metadata for the given rows, built once per object vLLM
    shared between layers (one per KV-cache group); the number of builds."""
    built: dict[int, tuple[Any, Any]] = {}  # id -> (vLLM's object, kept alive while ids are compared; rebuilt)
    for name in names:
        meta = attn_metadata[name]
        if id(meta) not in built:
            built[id(meta)] = meta, rebuild_for_rows(meta, query_start_loc, query_start_loc_cpu, max_query_len)
        attn_metadata[name] = built[id(meta)][1]
    return len(built)
