"""Every process-wide change uniprefill makes to transformers, in one place.

1. `register_decode_attention()`: adds the attention function "uniprefill_decode"
   (`runtime.decode_attention`) to transformers' `AttentionInterface` and `AttentionMaskInterface`,
   the public hooks transformers offers for custom attention. Idempotent; it adds a name and
   replaces none, so no model that does not ask for that name sees a difference.
2. `make_linear_attention_opaque(model)`: makes transformers' pure-PyTorch linear-attention
   fallbacks visible to dynamo as ONE op (below). Idempotent and reversible
   (`restore_linear_attention`). transformers picks that fallback by a module-level name and
   offers no registry for linear attention (as `AttentionInterface` is for softmax attention),
   so rebinding the name is the one place to intervene without per-model code.

Without flash-linear-attention, transformers runs Gated DeltaNet through
`torch_chunk_gated_delta_rule`, a Python loop over 64-token chunks. Dynamo unrolls that
loop for the traced prompt length, so the traced graph is only valid for that number of
chunks, and the layers after a drop point (which see fewer tokens) cannot reuse it.
`make_linear_attention_opaque(model)` routes the fallback through the custom op
`uniprefill::chunk_gated_delta_rule`, which runs the very same function eagerly; dynamo then
records one node, exactly as it records fla's kernel on a GPU that has fla.

This rebinds a module-level name in the transformers modeling modules the model uses
(process-wide, numerically identical: the op runs the original); `uniprefill.compile` calls it.
The original stays reachable as the replacement's `_uniprefill_original` (not `__wrapped__`: the
fallback may already be a decorated function); no table of originals is kept.
"""

from __future__ import annotations

import functools
import sys

import torch

_FALLBACK = "torch_chunk_gated_delta_rule"
_MARK = "_uniprefill_original"  # on a replacement: the function it replaced


@functools.cache
def register_decode_attention() -> None:
    """Add "uniprefill_decode" to transformers' attention registries (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from . import ops, sink_ops  # noqa: F401  (registers uniprefill::decode_attention, decode_sink_attention)
    from .runtime.decode_attention import ATTENTION_NAME, decode_attention

    AttentionInterface.register(ATTENTION_NAME, decode_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _original(module_name: str):
    """The fallback of `module_name` as transformers defined it."""
    fn = getattr(sys.modules[module_name], _FALLBACK)
    return getattr(fn, _MARK, fn)


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
    fn = _original(module_name)
    out, state = fn(query, key, value, g=g, beta=beta, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out, (state if state is not None else value.new_empty(0))


@chunk_gated_delta_rule.register_fake
def _(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, module_name):
    batch, _, heads, v_dim = value.shape
    state = value.new_empty((batch, heads, key.shape[-1], v_dim)) if output_final_state else value.new_empty(0)
    return value.new_empty(value.shape), state


def _opaque_for(module_name: str, original):
    def opaque(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None or chunk_size != 64:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                                           initial_state=initial_state, output_final_state=output_final_state,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
        out, state = torch.ops.uniprefill.chunk_gated_delta_rule(
            query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, module_name)
        return out, (state if output_final_state else None)

    setattr(opaque, _MARK, original)
    return opaque


def _fallback_modules(model: torch.nn.Module) -> dict[str, object]:
    """The modeling modules `model` uses that define the fallback, by name."""
    names = {type(module).__module__ for module in model.modules()}
    return {name: sys.modules[name] for name in sorted(names)
            if name in sys.modules and getattr(sys.modules[name], _FALLBACK, None) is not None}


def make_linear_attention_opaque(model: torch.nn.Module) -> list[str]:
    """Route the fallbacks of the modeling modules `model` uses through the op; returns the
    modules changed by this call (none when they already were)."""
    patched = []
    for name, py_module in _fallback_modules(model).items():
        fn = getattr(py_module, _FALLBACK)
        if hasattr(fn, _MARK):
            continue
        setattr(py_module, _FALLBACK, _opaque_for(name, fn))
        patched.append(name)
    return patched


def restore_linear_attention(model: torch.nn.Module) -> list[str]:
    """Undo `make_linear_attention_opaque` for the modules `model` uses; returns those restored.
    Graphs already compiled keep working (the op finds the original either way)."""
    restored = []
    for name, py_module in _fallback_modules(model).items():
        fn = getattr(py_module, _FALLBACK)
        if hasattr(fn, _MARK):
            setattr(py_module, _FALLBACK, getattr(fn, _MARK))
            restored.append(name)
    return restored
