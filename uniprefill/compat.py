"""Make transformers' pure-PyTorch scan fallbacks visible to dynamo as ONE op each.

Without flash-linear-attention or mamba-ssm, transformers runs its linear-attention and
state-space mixers through Python loops over the token axis:

* `torch_chunk_gated_delta_rule` (Gated DeltaNet: Qwen3-Next, Qwen3.5, ...) and
  `chunk_kimi_delta_attention` (Kimi-Linear), loops over 64-token chunks;
* `mamba_selective_scan` (Mamba, Falcon-Mamba, Jamba, Zamba), a per-token recurrence that
  dynamo traces as torch's recursive associative scan or as a loop unrolled per token.

Dynamo unrolls such a loop for the traced prompt length, so the traced graph is only valid
for that length (or number of chunks), and the layers after a drop point (which see fewer
tokens) cannot reuse it. `make_linear_attention_opaque(model)` routes each fallback through
a custom op (`uniprefill::chunk_gated_delta_rule` here, `uniprefill::selective_scan` in
`scan_ops`) that runs the very same function eagerly on whatever length it receives; dynamo
then records one node, exactly as it records fla's or mamba-ssm's kernel where installed.
These mixers are causal scans: run on the kept tokens in their order, they are the method.

This rebinds module-level names in the transformers modeling modules the model uses
(process-wide, idempotent, numerically identical to the plain model, which runs the same
functions outside dynamo); `uniprefill.compile` calls it. A name bound to an installed
kernel package (transformers' hub wrapper resolved it to something other than its PyTorch
function) is left alone.
"""

from __future__ import annotations

import inspect
import sys

import torch

from .scan_ops import ORIGINALS as _ORIGINALS
from .scan_ops import _needs_grad, opaque_selective_scan


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
    """Runs the original fallback `module_name` (module-qualified function name); returns
    (output, final state or empty)."""
    fn = _ORIGINALS[module_name]
    out, state = fn(query, key, value, g=g, beta=beta, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if out.dtype != query.dtype or (state is not None and state.dtype != torch.float32):
        raise TypeError(f"{module_name} returned {out.dtype}/{getattr(state, 'dtype', None)}, expected "
                        f"{query.dtype}/float32: uniprefill::chunk_gated_delta_rule's fake would be wrong")
    return out, (state if state is not None else value.new_empty(0))


@chunk_gated_delta_rule.register_fake
def _(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, module_name):
    # the fallbacks compute in float32 and cast the output back to the query's dtype
    batch, _, heads, v_dim = value.shape
    state = (value.new_empty((batch, heads, key.shape[-1], v_dim), dtype=torch.float32) if output_final_state
             else value.new_empty(0))
    return value.new_empty(value.shape, dtype=query.dtype), state


def _opaque_for(module_name: str):
    def opaque(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None or chunk_size != 64 or _needs_grad(query, key, value, g, beta, initial_state):
            return _ORIGINALS[module_name](query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                                           initial_state=initial_state, output_final_state=output_final_state,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
        out, state = torch.ops.uniprefill.chunk_gated_delta_rule(
            query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, module_name)
        return out, (state if output_final_state else None)

    opaque._uniprefill_opaque = True
    return opaque


# fallback name -> the drop-in that calls its op, given the module-qualified name of the original
_FALLBACKS = {
    "torch_chunk_gated_delta_rule": _opaque_for,
    "chunk_kimi_delta_attention": _opaque_for,  # the same signature, a per-channel gate
    "mamba_selective_scan": opaque_selective_scan,
}


def _runs_pytorch(fn) -> bool:
    """Whether `fn` runs its PyTorch code: a plain function, or transformers' hub wrapper that
    found no kernel package (its closure's `is_new_implementation` is False)."""
    if not hasattr(fn, "__wrapped__"):
        return True
    try:
        return inspect.getclosurevars(fn).nonlocals.get("is_new_implementation") is False
    except (TypeError, ValueError):
        return False


def make_linear_attention_opaque(model: torch.nn.Module) -> list[str]:
    """Patch the fallbacks of the modeling modules `model` uses; returns their qualified names."""
    patched = []
    for module in model.modules():
        name = type(module).__module__
        py_module = sys.modules.get(name)
        for fallback, make in _FALLBACKS.items():
            fn = getattr(py_module, fallback, None)
            if fn is None or getattr(fn, "_uniprefill_opaque", False) or not _runs_pytorch(fn):
                continue
            qualified = f"{name}.{fallback}"
            _ORIGINALS[qualified] = fn
            setattr(py_module, fallback, make(qualified))
            patched.append(qualified)
    return patched
