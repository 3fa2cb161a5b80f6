"""Host-side ops of the rewritten prefill graph: the prompt's real tokens and the drop recorder.

The token-drop rewrite puts only `torch.library` ops into a graph (each with a fake). Besides the
tensor work (`ops.py`) it needs a little host bookkeeping once per prefill:

* `live_tokens(padding, rows, seq, like)`: flat indices and per-row counts of the real (non-pad)
  tokens of the dense `[rows, seq]` grid (counts on the host: one copy per prefill);
* `arange_like(size, like)`: `arange(size)` on `like`'s device (the packed layout's row indices);
* `begin_prefill`, `record_drop`, `record_sparse`, `record_attention`: the drop recorder's hooks. They take no Python
  object: they write into the recorder that `recording_into` made current for the call
  (`runtime.history`; the backend wraps every call of a rewritten graph in it), and do nothing
  outside one. The rewrite marks them to survive dead-code elimination (`passes.graph_calls.keep_node`).
"""

from __future__ import annotations

import torch

from .runtime.history import active_recorder

LIB = "uniprefill"


@torch.library.custom_op(f"{LIB}::live_tokens", mutates_args=())
def live_tokens(padding: torch.Tensor | None, rows: int, seq: int,
                like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat `b * seq + t` index of every real token in row-major order, tokens per row on the host);
    `padding` None: every token of the grid is real."""
    if padding is None:
        flat = torch.arange(rows * seq, device=like.device)
        return flat, torch.full((rows,), seq, dtype=torch.int64)
    valid = padding.bool().reshape(-1)
    counts = padding.bool().sum(1).cpu()  # one host copy
    order = torch.argsort((~valid).to(torch.int8), stable=True)
    return order[: int(counts.sum())], counts


@live_tokens.register_fake
def _(padding, rows, seq, like):
    real = torch.library.get_ctx().new_dynamic_size()
    return like.new_empty(real, dtype=torch.int64), torch.empty(rows, dtype=torch.int64, device="cpu")


@torch.library.custom_op(f"{LIB}::arange_like", mutates_args=())
def arange_like(size: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(size, device=like.device)


@arange_like.register_fake
def _(size, like):
    return like.new_empty(size, dtype=torch.int64)


@torch.library.custom_op(f"{LIB}::begin_prefill", mutates_args=())
def begin_prefill(rows: int, seq: int) -> None:
    """A prefill of `rows` x `seq` tokens starts: the current recorder opens a new history."""
    recorder = active_recorder()
    if recorder is not None:
        recorder.begin(rows, seq)


@begin_prefill.register_fake
def _(rows, seq):
    return None


@torch.library.custom_op(f"{LIB}::record_drop", mutates_args=())
def record_drop(layer: int, counts_in: torch.Tensor, counts_out: torch.Tensor, kept_flat: torch.Tensor) -> None:
    """A drop point at `layer` kept `counts_out` of `counts_in` tokens per row (host tensors), at the
    original flat positions `kept_flat`."""
    recorder = active_recorder()
    if recorder is not None:
        recorder.record(layer, counts_in, counts_out, kept_flat)


@record_drop.register_fake
def _(layer, counts_in, counts_out, kept_flat):
    return None


@torch.library.custom_op(f"{LIB}::record_sparse", mutates_args=())
def record_sparse(layer: int, density: torch.Tensor) -> None:
    """Early sparse attention at `layer` computed this share of the causal key blocks."""
    recorder = active_recorder()
    if recorder is not None:
        recorder.record_sparse(layer, density)


@record_sparse.register_fake
def _(layer, density):
    return None


@torch.library.custom_op(f"{LIB}::record_attention", mutates_args=())
def record_attention(layer: int, softcap: float, upcast: bool, sinks: bool, key_bias: bool = False) -> None:
    """The prefill ran `layer`'s attention as `sink_ops` eager attention of this form (logit
    soft-capping, float32 softmax, learned sinks, a per-key bias): its decode steps must compute the same."""
    recorder = active_recorder()
    if recorder is not None:
        recorder.record_attention(layer, softcap, upcast, sinks, key_bias)


@record_attention.register_fake
def _(layer, softcap, upcast, sinks, key_bias=False):
    return None


RECORDER_OPS = ("begin_prefill", "record_drop", "record_sparse", "record_attention")  # names in torch.ops.uniprefill
