"""Every process-wide change uniprefill makes to transformers, in one place.

1. `register_decode_attention()`: adds the attention function "uniprefill_decode"
   (`runtime.decode_attention`) to transformers' `AttentionInterface` and `AttentionMaskInterface`,
   the public hooks transformers offers for custom attention. Idempotent; it adds a name and
   replaces none, so no model that does not ask for that name sees a difference.
2. `make_linear_attention_opaque(model)`: makes transformers' pure-PyTorch scan fallbacks
   visible to dynamo as ONE op each (below). Idempotent and reversible
   (`restore_linear_attention`). transformers picks a fallback by a module-level name and
   offers no registry for linear attention or state-space scans (as `AttentionInterface` is for
   softmax attention), so rebinding the name is the one place to intervene without per-model code.

3. `make_experts_opaque(model)`: the experts classes of transformers' MoE interface
   (`forward(hidden_states, top_k_index, top_k_weights)`) that lack its
   `use_experts_implementation` decorator loop in Python over the experts a prompt hit, a loop
   dynamo cannot trace; their forward is rebound to one that calls `uniprefill::routed_experts`
   (`expert_ops`) for the modules of `model`, and the class's own forward for every other
   instance. Idempotent and reversible (`restore_experts`). transformers offers
   `ExpertsInterface` for decorated classes only, so rebinding the class's forward is again
   the one place to intervene without per-model code.

Without flash-linear-attention or mamba-ssm, transformers runs its linear-attention and
state-space mixers through Python loops over the token axis:

* `torch_chunk_gated_delta_rule` (Gated DeltaNet: Qwen3-Next, Qwen3.5, ...) and
  `chunk_kimi_delta_attention` (Kimi-Linear), loops over 64-token chunks;
* `mamba_selective_scan` (Mamba, Falcon-Mamba, Jamba, Zamba), a per-token recurrence that
  dynamo traces as torch's recursive associative scan or as a loop unrolled per token;
* MiniMax's lightning attention, a loop over 256-token blocks written inline in
  `MiniMaxLightningAttention.forward`: there the class's `forward` is rebound to a drop-in
  (`lightning_ops`) that runs the method's own steps around `uniprefill::lightning_attention_blocks`.

Dynamo unrolls such a loop for the traced prompt length, so the traced graph is only valid
for that length (or number of chunks), and the layers after a drop point (which see fewer
tokens) cannot reuse it. `make_linear_attention_opaque(model)` routes each fallback through
a custom op (`uniprefill::chunk_gated_delta_rule` here, `uniprefill::selective_scan` in
`scan_ops`) that runs the very same function eagerly on whatever length it receives; dynamo
then records one node, exactly as it records fla's or mamba-ssm's kernel where installed.
These mixers are causal scans: run on the kept tokens in their order, they are the method.

This rebinds module-level names in the transformers modeling modules the model uses
(process-wide, numerically identical: the op runs the original); `uniprefill.compile` calls it.
A name transformers' hub wrapper bound to an installed kernel package is left alone. The
original stays reachable as the replacement's `_uniprefill_original` (not `__wrapped__`: the
fallback may already be a decorated function); no table of originals is kept. The ops name the
original by its module-qualified name (`module.function`), `scan_ops.original_of`.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from . import expert_ops
from .lightning_ops import lightning_forward
from .scan_ops import MARK as _MARK
from .scan_ops import needs_grad, opaque_selective_scan, original_of, unaliased


@functools.cache
def register_decode_attention() -> None:
    """Add "uniprefill_decode" to transformers' attention registries (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from . import ops, sink_ops  # noqa: F401  (registers uniprefill::decode_attention, decode_sink_attention)
    from .runtime.decode_attention import ATTENTION_NAME, decode_attention

    AttentionInterface.register(ATTENTION_NAME, decode_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


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
    fn = original_of(module_name)
    out, state = fn(query, key, value, g=g, beta=beta, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if out.dtype != query.dtype or (state is not None and state.dtype != torch.float32):
        raise TypeError(f"{module_name} returned {out.dtype}/{getattr(state, 'dtype', None)}, expected "
                        f"{query.dtype}/float32: uniprefill::chunk_gated_delta_rule's fake would be wrong")
    inputs = (query, key, value, g, beta, initial_state)
    return unaliased(out, *inputs), (unaliased(state, *inputs, out) if state is not None else value.new_empty(0))


@chunk_gated_delta_rule.register_fake
def _(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, module_name):
    # the fallbacks compute in float32 and cast the output back to the query's dtype
    batch, _, heads, v_dim = value.shape
    state = (value.new_empty((batch, heads, key.shape[-1], v_dim), dtype=torch.float32) if output_final_state
             else value.new_empty(0))
    return value.new_empty(value.shape, dtype=query.dtype), state


def _opaque_chunked(qualified: str, original):
    def opaque(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None or chunk_size != 64 or needs_grad(query, key, value, g, beta, initial_state):
            # packed sequences or another chunk size (the op carries neither), or training (no backward)
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                            initial_state=initial_state, output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
        out, state = torch.ops.uniprefill.chunk_gated_delta_rule(
            query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, qualified)
        return out, (state if output_final_state else None)

    setattr(opaque, _MARK, original)
    return opaque


# fallback name -> the drop-in that calls its op, given the qualified name and the original
_FALLBACKS = {
    "torch_chunk_gated_delta_rule": _opaque_chunked,
    "chunk_kimi_delta_attention": _opaque_chunked,  # the same signature, a per-channel gate
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


def _fallbacks(model: torch.nn.Module) -> list[tuple[str, object, str]]:
    """(module name, module, fallback name) of every fallback the modeling modules `model` uses define."""
    names = {type(module).__module__ for module in model.modules()}
    return [(name, sys.modules[name], fallback) for name in sorted(names) if name in sys.modules
            for fallback in _FALLBACKS if getattr(sys.modules[name], fallback, None) is not None]


# the same for a loop written inline in a method: (class name, method) -> its drop-in, given the original
_METHOD_FALLBACKS = {("MiniMaxLightningAttention", "forward"): lightning_forward}


def _method_fallbacks(model: torch.nn.Module) -> list[tuple[type, str]]:
    """(class, method) of every module class `model` uses that has a method drop-in."""
    classes = {type(module) for module in model.modules()}
    return sorted(((cls, method) for cls in classes for name, method in _METHOD_FALLBACKS if cls.__name__ == name),
                  key=lambda item: (item[0].__module__, item[0].__qualname__))


def make_linear_attention_opaque(model: torch.nn.Module) -> list[str]:
    """Route the fallbacks of the modeling modules `model` uses through their ops; returns the
    modules changed by this call (none when they already were)."""
    patched = []
    for name, py_module, fallback in _fallbacks(model):
        fn = getattr(py_module, fallback)
        if hasattr(fn, _MARK) or not _runs_pytorch(fn):
            continue
        setattr(py_module, fallback, _FALLBACKS[fallback](f"{name}.{fallback}", fn))
        patched.append(name)
    for cls, method in _method_fallbacks(model):
        fn = cls.__dict__.get(method)
        if fn is not None and not hasattr(fn, _MARK):
            setattr(cls, method, _METHOD_FALLBACKS[(cls.__name__, method)](fn))
            patched.append(cls.__module__)
    return sorted(set(patched))


def restore_linear_attention(model: torch.nn.Module) -> list[str]:
    """Undo `make_linear_attention_opaque` for the modules `model` uses; returns those restored.
    Graphs already compiled keep working (the ops find the original either way)."""
    restored = []
    for name, py_module, fallback in _fallbacks(model):
        fn = getattr(py_module, fallback)
        if hasattr(fn, _MARK):
            setattr(py_module, fallback, getattr(fn, _MARK))
            restored.append(name)
    for cls, method in _method_fallbacks(model):
        fn = cls.__dict__.get(method)
        if fn is not None and hasattr(fn, _MARK):
            setattr(cls, method, getattr(fn, _MARK))
            restored.append(cls.__module__)
    return sorted(set(restored))


_EXPERTS_SIGNATURE = ["self", "hidden_states", "top_k_index", "top_k_weights"]


def _loop_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` whose class is a transformers experts class without
    `use_experts_implementation` (its forward carries no `__wrapped__`), ours or not yet."""
    found = []
    for module in model.modules():
        cls = type(module)
        forward = expert_ops.original_forward(cls)
        if not cls.__module__.startswith("transformers.") or hasattr(forward, "__wrapped__"):
            continue
        try:
            if list(inspect.signature(forward).parameters) == _EXPERTS_SIGNATURE:
                found.append(module)
        except (TypeError, ValueError):
            continue
    return found


def make_experts_opaque(model: torch.nn.Module) -> list[str]:
    """Route the Python-loop experts modules of `model` through `uniprefill::routed_experts`;
    returns the classes rebound by this call (none when they already were)."""
    patched = set()
    for module in _loop_experts(model):
        expert_ops.register(module)
        cls = type(module)
        if not hasattr(cls.forward, _MARK):
            cls.forward = expert_ops.opaque_experts(cls.forward)
            patched.add(f"{cls.__module__}.{cls.__qualname__}")
    return sorted(patched)


def restore_experts(model: torch.nn.Module) -> list[str]:
    """Undo `make_experts_opaque` for the experts classes `model` uses; returns those restored.
    Graphs already compiled keep working (the op calls the class's original forward either way)."""
    restored = set()
    for module in _loop_experts(model):
        cls = type(module)
        if hasattr(cls.forward, _MARK):
            cls.forward = getattr(cls.forward, _MARK)
            restored.add(f"{cls.__module__}.{cls.__qualname__}")
    return sorted(restored)
