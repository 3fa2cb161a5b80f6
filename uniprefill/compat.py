"""Make transformers' pure-PyTorch linear-attention fallbacks visible to dynamo as ONE op.

Without flash-linear-attention, transformers runs Gated DeltaNet through
`torch_chunk_gated_delta_rule`, a Python loop over 64-token chunks. Dynamo unrolls that
loop for the traced prompt length, so the traced graph is only valid for that number of
chunks, and the layers after a drop point (which see fewer tokens) cannot reuse it.
`make_linear_attention_opaque(model)` routes the fallback through the custom op
`uniprefill::chunk_gated_delta_rule`, which runs the very same function eagerly; dynamo then
records one node, exactly as it records fla's kernel on a GPU that has fla.

This rebinds a module-level name in the transformers modeling modules the model uses
(process-wide, idempotent, numerically identical); `uniprefill.compile` calls it.
"""

from __future__ import annotations

import sys

import torch

_FALLBACK = "torch_chunk_gated_delta_rule"
_ORIGINALS: dict[str, object] = {}


@torch.library.custom_op("uniprefill::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    module_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the original fallback of `module_name`; returns (output, final state or empty)."""
    fn = _ORIGINALS[module_name]
    out, state = fn(query, key, value, g=g, beta=beta, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out, (state if state is not None else value.new_empty(0))


@chunk_gated_delta_rule.register_fake
def _(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, module_name):
    batch, _, heads, v_dim = value.shape
    state = value.new_empty((batch, heads, key.shape[-1], v_dim)) if output_final_state else value.new_empty(0)
    return value.new_empty(value.shape), state


def _opaque_for(module_name: str):
    def opaque(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None or chunk_size != 64:
            return _ORIGINALS[module_name](query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                                           initial_state=initial_state, output_final_state=output_final_state,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
        out, state = torch.ops.uniprefill.chunk_gated_delta_rule(
            query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, module_name)
        return out, (state if output_final_state else None)

    opaque._uniprefill_opaque = True
    return opaque


def make_linear_attention_opaque(model: torch.nn.Module) -> list[str]:
    """Patch the fallbacks of the modeling modules `model` uses; returns their names."""
    patched = []
    for module in model.modules():
        name = type(module).__module__
        py_module = sys.modules.get(name)
        fn = getattr(py_module, _FALLBACK, None)
        if fn is None or getattr(fn, "_uniprefill_opaque", False):
            continue
        _ORIGINALS[name] = fn
        setattr(py_module, _FALLBACK, _opaque_for(name))
        patched.append(name)
    return patched
