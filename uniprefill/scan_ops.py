"""Causal scans of transformers' PyTorch fallbacks as `torch.library` ops (one graph node each).

A Mamba layer's selective scan (`mamba_selective_scan` of Mamba, Falcon-Mamba, Jamba and Zamba)
is a recurrence over the token axis. Traced by dynamo it becomes a program for one range of
lengths: with `use_associative_scan` (the default on torch >= 2.9) torch's
`generic_associative_scan`, an odd/even recursion whose depth and parity branches follow the
length bits (a trace at 300 tokens holds for 256..383 only), and without it the sequential
loop unrolled once per token. Neither can run on the kept tokens after a drop point.

`uniprefill::selective_scan` is the scan as one op: its implementation calls the model's own
function eagerly on whatever length it receives (outside dynamo, so the function takes its
sequential loop, exactly as the plain model runs it), and its fake gives the output shapes
from the input shapes alone. The token-drop pass then reads it as any other op whose token
axis is the axis of its inputs: run on the kept tokens in their order, the scan is the
method's causal mixer (`compat.make_linear_attention_opaque` routes the function here; the op finds the
original by its module-qualified name, `original_of`). The
op has no backward: where gradients are wanted the drop-in calls the function itself (and
the token-drop pass refuses such graphs anyway).

The fake's dtypes follow the function's arithmetic (type promotion of dt, A, B, the input, C,
D and z); the implementation checks that its results have them, so a model whose fallback
computes otherwise fails loudly (the backend then runs the original graph) instead of
flowing a wrong dtype on.
"""

from __future__ import annotations

import sys

import torch

MARK = "_uniprefill_original"  # on a drop-in `compat` bound in a fallback's place: the function it replaced


def original_of(qualified: str):
    """The fallback `module.function` as transformers defined it (compat's drop-in keeps it)."""
    module, function = qualified.rsplit(".", 1)
    fn = getattr(sys.modules[module], function)
    return getattr(fn, MARK, fn)


def unaliased(out: torch.Tensor, *inputs) -> torch.Tensor:
    """`out`, cloned where it shares storage with one of `inputs` (tensors or None): a custom op's output may not
    alias its inputs, and a fallback may hand one back (a scan over zero tokens returns its initial state)."""
    storage = out.untyped_storage().data_ptr()
    if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage for t in inputs):
        return out.clone()
    return out


def _promote(*dtypes: torch.dtype) -> torch.dtype:
    out = dtypes[0]
    for dtype in dtypes[1:]:
        out = torch.promote_types(out, dtype)
    return out


def _selective_scan_dtypes(hidden_states, dt, A, B, C, D, z) -> tuple[torch.dtype, torch.dtype]:
    """(output dtype, final-state dtype) of transformers' sequential `mamba_selective_scan`."""
    f32 = torch.float32
    state = _promote(_promote(A.dtype, dt.dtype), hidden_states.dtype, _promote(dt.dtype, f32, f32))
    out = _promote(hidden_states.dtype, C.dtype)  # matmul(state.to(input dtype), C)
    if D is not None:
        out = _promote(out, hidden_states.dtype, D.dtype)
    if z is not None:
        out = _promote(out, z.dtype)
    return out, state


@torch.library.custom_op("uniprefill::selective_scan", mutates_args=())
def selective_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    return_last_state: bool,
    use_mambapy: bool,
    use_associative_scan: bool,
    function: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[batch, channels, length]` inputs (B, C: `[batch, state, length]`) scanned over `length`;
    returns (output, final state `[batch, channels, state]`, or an empty tensor)."""
    result = original_of(function)(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                 delta_softplus=delta_softplus, return_last_state=return_last_state,
                                 use_mambapy=use_mambapy, use_associative_scan=use_associative_scan)
    out, state = result if return_last_state else (result, None)
    want_out, want_state = _selective_scan_dtypes(hidden_states, dt, A, B, C, D, z)
    if out.dtype != want_out or (state is not None and state.dtype != want_state):
        raise TypeError(f"{function} returned {out.dtype}/{getattr(state, 'dtype', None)}, "
                        f"expected {want_out}/{want_state}: uniprefill::selective_scan's fake would be wrong")
    inputs = (hidden_states, dt, A, B, C, D, z, delta_bias)
    return unaliased(out, *inputs), (unaliased(state, *inputs, out) if state is not None
                                     else hidden_states.new_empty(0))


@selective_scan.register_fake
def _(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, use_mambapy,
      use_associative_scan, function):
    out_dtype, state_dtype = _selective_scan_dtypes(hidden_states, dt, A, B, C, D, z)
    batch, channels, _ = hidden_states.shape
    state = (hidden_states.new_empty((batch, channels, A.shape[-1]), dtype=state_dtype) if return_last_state
             else hidden_states.new_empty(0))
    return hidden_states.new_empty(hidden_states.shape, dtype=out_dtype), state


def needs_grad(*tensors) -> bool:
    """Whether autograd would record through these tensors (the ops have no backward)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def opaque_selective_scan(function: str, original):
    """A drop-in for `original`, the `mamba_selective_scan` named `function`, that calls the op."""

    def opaque(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
               return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
        if kwargs or needs_grad(hidden_states, dt, A, B, C, D, z, delta_bias):
            # an argument the op does not carry (packed sequences), or training (the op has no
            # backward): the model's own function
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=return_last_state,
                            use_mambapy=use_mambapy, use_associative_scan=use_associative_scan, **kwargs)
        out, state = torch.ops.uniprefill.selective_scan(
            hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, use_mambapy,
            use_associative_scan, function)
        return (out, state) if return_last_state else out

    setattr(opaque, MARK, original)
    return opaque
