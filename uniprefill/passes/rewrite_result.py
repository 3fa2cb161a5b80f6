"""What one run of the token-drop rewrite returns: the new graph and a report per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass
class LayerReport:
    layer: int
    kind: str
    window: int
    drop_point: bool
    why: str

    def __str__(self) -> str:
        mark = "DROP" if self.drop_point else "    "
        return f"layer {self.layer:3d}  {self.kind:8s} {mark}  {self.why}"


@dataclass
class RewriteResult:
    graph_module: fx.GraphModule
    layers: list[LayerReport]
    drop_layers: tuple[int, ...]
    counts: dict[str, int]
    single_row_only: bool
    single_row_reason: str = ""
    returns_cache: bool = False
    input_checks: tuple = ()  # mask_inputs.InputCheck: run before the rewritten graph
    # a convolution or scan sees every position, pads included: dropping pads from the middle
    # of a row (holes) changes its neighbourhoods, so such graphs accept left padding only
    left_padding_only: bool = False
    tokens_index: int = 0  # the token input's position among the graph's inputs
