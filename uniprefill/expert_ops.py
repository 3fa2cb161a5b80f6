"""Mixture-of-experts loops of transformers as one `torch.library` op (`uniprefill::routed_experts`).

transformers' experts modules share one interface: `forward(hidden_states, top_k_index,
top_k_weights)`, a `[tokens, hidden]` input (or `[batch, length, hidden]`), each token's chosen
experts and their weights, and an output of the input's shape. Most classes carry transformers'
`use_experts_implementation` decorator, which under `torch.compile` dispatches to batched or
grouped matmul forms that dynamo traces into one graph. A few do not (DBRX, LongCat-Flash,
Step-3.7): their forward loops in Python over `expert_mask.sum(...).nonzero()`, the experts that
received a token, a loop whose trip count is data. dynamo breaks the graph there (even with
`capture_dynamic_output_shape_ops`, it cannot iterate over an unbacked number of rows), so the
model arrives at the backend as pieces that start from hidden states, and nothing is dropped.

`uniprefill::routed_experts` is that forward as one node: its implementation calls the module's
own forward eagerly on the tokens it receives (the very computation the plain model runs), its
fake gives the input's shape and dtype. Routing is per token (a token's output depends on its
own hidden state and its own top-k), so on the kept tokens after a drop point the op computes
exactly what the plain model computes for those tokens. The implementation checks that the
output has the fake's shape and dtype, so a class that returns something else fails loudly
(the backend then runs the original graph) instead of flowing a wrong value on.

Ops take no Python objects: `register` gives a module a key (its class and id, kept on it as
`KEY`), by which the op finds it in a weak-valued mapping (an entry goes with its module, as a
name in transformers' `AttentionInterface` names a function). `compat.make_experts_opaque` binds
`opaque_experts` in the class's place; it calls the op only while dynamo traces a module that has
a key, with gradients off (the op has no backward): every other call is the class's own forward.
"""

from __future__ import annotations

import weakref

import torch

from .scan_ops import MARK, unaliased

KEY = "_uniprefill_experts_key"  # on an experts module that `register` gave a key
_MODULES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> module


def register(module: torch.nn.Module) -> str:
    """The key by which `uniprefill::routed_experts` finds `module` (given once, kept on it)."""
    key = getattr(module, KEY, None)
    if key is None:
        key = f"{type(module).__module__}.{type(module).__qualname__}@{id(module):#x}"
        object.__setattr__(module, KEY, key)
    _MODULES[key] = module
    return key


def original_forward(cls: type):
    """The class's forward as transformers defined it (the drop-in keeps it)."""
    return getattr(cls.forward, MARK, cls.forward)


@torch.library.custom_op("uniprefill::routed_experts", mutates_args=())
def routed_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   key: str) -> torch.Tensor:
    """The experts module `key` run on `hidden_states` with the given routing (its own forward)."""
    module = _MODULES.get(key)
    if module is None:
        raise RuntimeError(f"uniprefill::routed_experts: the experts module {key} no longer exists")
    out = original_forward(type(module))(module, hidden_states, top_k_index, top_k_weights)
    if not isinstance(out, torch.Tensor) or out.shape != hidden_states.shape or out.dtype != hidden_states.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"{key} returned {got}, expected {tuple(hidden_states.shape)} {hidden_states.dtype}: "
                        "uniprefill::routed_experts's fake would be wrong")
    return unaliased(out, hidden_states)


@routed_experts.register_fake
def _(hidden_states, top_k_index, top_k_weights, key):
    return torch.empty_like(hidden_states)


def opaque_experts(original):
    """A drop-in for an experts class's `original` forward that calls the op (see the module docstring)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        key = getattr(self, KEY, None)
        if key is None or torch.is_grad_enabled() or not torch.compiler.is_compiling():
            return original(self, hidden_states, top_k_index, top_k_weights)
        return torch.ops.uniprefill.routed_experts(hidden_states, top_k_index, top_k_weights, key)

    forward.__doc__ = original.__doc__
    setattr(forward, MARK, original)
    return forward
