"""Whether a censused type is a causal decoder, measured on the plain model (the causality probe).

The issue counts decoder-only models, and token dropping in the prefill assumes a causal one: the
output at position i depends on tokens 0..i only, so the scores of the last queries say which
earlier tokens later layers need. A model whose earlier outputs depend on later tokens (XLNet's
two-stream attention, CPM-Ant's all-visible context mask, BertGeneration built without
`is_decoder=True`) is not such a decoder, whatever its class is called; its row stays in the table
but outside the accelerated share (`census_attention.accelerated_share`).

The probe asks the plain model, not the graph: the same prompt is run with every token from the
middle on replaced (each by another id of the same range), and the logits before the middle are
compared with the census tolerance. A causal model gives the same logits there (the same shapes
and kernels: in practice bit for bit); a bidirectional one moves them. Changing the whole second
half rather than the last token alone is for the margin: in a tiny random model one token of 300
moves a bidirectional model's earlier logits by about the tolerance (XLNet: 1.2e-4 against 1e-4),
half the prompt by ten times that.
"""

from __future__ import annotations

from typing import Callable

import torch

NOT_CAUSAL = "no: earlier logits change with later tokens"


def causal_probe(model, ids: torch.Tensor, logits: torch.Tensor, low: int, high: int,
                 close: Callable[[torch.Tensor, torch.Tensor], bool]) -> bool:
    """Whether `model` is causal: its `logits` on `ids` (`[1, N]`, ids in `[low, high)`) before position
    N // 2 are `close` to those of a prompt whose tokens from N // 2 on are all different."""
    if not low < high - 1:
        raise ValueError(f"the probe needs two token ids to swap between, got the range [{low}, {high})")
    middle = ids.shape[1] // 2
    changed = ids.clone()
    changed[:, middle:] = low + (ids[:, middle:] - low + 1) % (high - low)  # another id, same range
    with torch.no_grad():
        again = model(input_ids=changed, use_cache=False).logits
    return close(again[:, :middle], logits[:, :middle])


def causal_cell(causal: bool | None, status: str) -> str:
    """The table's "causal" cell: yes, no (and why), empty for a skipped row, "?" when not measured."""
    if causal is None:
        return "" if status == "skipped" else "?"
    return "yes" if causal else NOT_CAUSAL
