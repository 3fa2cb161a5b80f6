"""Choose the drop points (decoder layers after whose attention tokens are dropped).

`drop_layers="auto"` applies one rule computed from the layer kinds and the depth alone:

* candidates are the full-attention layers with index in `[L // 4 - 1, L - 2]` (the first
  quarter of the network builds the representations the scores rely on; dropping at the
  last layer saves almost nothing);
* walking up from the first candidate, a candidate is taken when it is at least
  `ceil(L / 8)` layers after the previous drop point.

On Llama-3.1-8B (32 full layers) this gives 7, 11, 15, 19, 23, 27: the paper's release.
On Gemma-3 (5 sliding : 1 full) it gives every full layer in that range except the last
layer (Gemma-3-270M: 5, 11). Measured so far on CPU only, on small slices
(`docs/benchmarks.md`, "Choosing drop_layers"): on SmolLM2-135M (30 full layers) at p = 0.99
it keeps the needle where dropping from layer 0 loses it, and matches a later start in
accuracy at lower retention; on Gemma-3-270M it did not differ from "all". The GPU eval of
issue 5 has to confirm it at more lengths and samples.
"""

from __future__ import annotations

import math

from .classify import LayerInfo


def auto_drop_layers(kinds: list[str]) -> tuple[int, ...]:
    num_layers = len(kinds)
    low, high = max(num_layers // 4 - 1, 0), num_layers - 2
    spacing = max(math.ceil(num_layers / 8), 1)
    chosen: list[int] = []
    for idx, kind in enumerate(kinds):
        if kind != "full" or not (low <= idx <= high):
            continue
        if not chosen or idx - chosen[-1] >= spacing:
            chosen.append(idx)
    return tuple(chosen)


def resolve_drop_layers(drop_layers, layers: dict[int, LayerInfo]) -> tuple[int, ...]:
    """The drop points for `drop_layers` ("auto", "all" or indices); ValueError if one is not full attention."""
    kinds = [layers[i].kind if i in layers else "other" for i in range(max(layers, default=-1) + 1)]
    if drop_layers == "all":
        return tuple(i for i, k in enumerate(kinds) if k == "full")
    if drop_layers == "auto":
        return auto_drop_layers(kinds)
    bad = [(i, kinds[i] if i < len(kinds) else "missing") for i in drop_layers if i >= len(kinds) or kinds[i] != "full"]
    if bad:
        full = [i for i, k in enumerate(kinds) if k == "full"]
        raise ValueError(
            f"drop_layers={list(drop_layers)}: layer(s) {bad} are not full-attention layers; "
            f"the full-attention layers of this model are {full}"
        )
    return tuple(drop_layers)
