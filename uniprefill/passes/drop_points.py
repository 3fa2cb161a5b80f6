"""Choose the drop points (decoder layers after whose attention tokens are dropped).

`drop_layers="auto"` applies one rule computed from the layer kinds and the depth alone:

* candidates are the full-attention layers with index in `[start, L - 2]` (dropping at the
  last layer saves almost nothing), where `start` depends on the kind of model:
  - a model whose every layer is full attention (Llama, Qwen2, SmolLM2, ...): `L // 2 - 1`.
    The early full-attention layers of such models do not single out the needle: on
    SmolLM2-135M (30 layers) its mean rank among the blocks is that of a random block in
    layers 0-13 (`docs/selection.md`), and drop points from there lose it. Measured on the
    H200 (`docs/benchmarks.md`, "Choosing the defaults"): drops at 6, 10, 14, ... scored -6.4 points
    at 4K under the paper's rule at p = 0.99; drops at 14, 18, 22, 26 (this rule) +0.0 under it
    and +0.8 under "content" at p = 0.95;
  - a hybrid (sliding-window or linear layers between the full ones: Gemma-3, Qwen3-Next,
    GPT-OSS, ...): `L // 4 - 1`, the first quarter of the network building the
    representations the scores rely on. Gemma-3-270M's first full layer (5 of 18) keeps its
    accuracy and gives most of its speed-up.
* walking up from the first candidate, a candidate is taken when it is at least
  `ceil(L / 8)` layers after the previous drop point.

Llama-3.1-8B (32 full layers): 15, 19, 23, 27 (the paper's release drops from layer 7: pass
`drop_layers=(7, 11, 15, 19, 23, 27)` for it). SmolLM2-135M: 14, 18, 22, 26. Gemma-3
(5 sliding : 1 full): every full layer from `L // 4 - 1` except the last layer
(Gemma-3-270M: 5, 11). `config.AUTO_RULE` numbers the rule; it enters the config's stable hash
whenever `drop_layers="auto"`, so results and caches keyed by that hash never mix rules.
"""

from __future__ import annotations

import math

from ..models.layer_kinds import LayerKind
from .classify import LayerInfo


def auto_drop_layers(kinds: list[str]) -> tuple[int, ...]:
    num_layers = len(kinds)
    every_layer_full = bool(kinds) and all(kind == LayerKind.FULL for kind in kinds)
    start = num_layers // 2 - 1 if every_layer_full else num_layers // 4 - 1
    low, high = max(start, 0), num_layers - 2
    spacing = max(math.ceil(num_layers / 8), 1)
    chosen: list[int] = []
    for idx, kind in enumerate(kinds):
        if kind != LayerKind.FULL or not (low <= idx <= high):
            continue
        if not chosen or idx - chosen[-1] >= spacing:
            chosen.append(idx)
    return tuple(chosen)


def resolve_drop_layers(drop_layers, layers: dict[int, LayerInfo]) -> tuple[int, ...]:
    """The drop points for `drop_layers` ("auto", "all" or indices); ValueError if one is not full attention."""
    kinds = [layers[i].kind if i in layers else LayerKind.OTHER for i in range(max(layers, default=-1) + 1)]
    if drop_layers == "all":
        return tuple(i for i, k in enumerate(kinds) if k == LayerKind.FULL)
    if drop_layers == "auto":
        return auto_drop_layers(kinds)
    bad = [(i, kinds[i] if i < len(kinds) else "missing") for i in drop_layers if i >= len(kinds) or kinds[i] != LayerKind.FULL]
    if bad:
        full = [i for i, k in enumerate(kinds) if k == LayerKind.FULL]
        raise ValueError(
            f"drop_layers={list(drop_layers)}: layer(s) {bad} are not full-attention layers; "
            f"the full-attention layers of this model are {full}"
        )
    return tuple(drop_layers)
