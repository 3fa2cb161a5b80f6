"""Classify the attention sites of a dynamo graph, architecture-agnostically.

Every `scaled_dot_product_attention` node is grouped by the decoder layer it was traced
in (from `nn_module_stack`, the module list that holds the attention modules). Its mask
argument is read structurally: the subgraph that builds the mask may only compare token
indices (`kv <= q` makes it causal, `kv > q - W` adds a sliding window of W tokens) and
look up the 2-D padding mask. Anything else makes the site "other" and it is left alone. An SDPA
call whose queries and keys have a constant length, the tokens on another axis, attends within
each token (Inkling2's block attention residual, over layer blocks): it is "other" with the reason
`WITHIN_TOKEN`, never "bidirectional", since it says nothing of how tokens see one another.
Layers without SDPA are "linear" when they hold a recurrent or convolutional token mixer
(conv1d, cumulative ops, or modules named like DeltaNet / Mamba / SSM / Conv), else
"other". No per-model table is involved; `config.layer_types` is only used by tests to
confirm the result.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..models.layer_kinds import LayerKind
from .causal_table import TableRole, is_table_shaped
from .fx_utils import (ancestors, example_value, is_sdpa, is_table_mask, layer_container, layer_index,
                       layer_module_classes, target_name)
from .indexer_mask import IndexerMask, match_indexer_mask
from .mask_words import is_selection, unknown_mask_reason

_COMPARISONS = {operator.le, operator.lt, operator.gt, operator.ge, torch.le, torch.lt, torch.gt, torch.ge}
_MASK_SAFE_NAMES = (
    "arange", "add", "sub", "le", "lt", "gt", "ge", "eq", "ne", "and_", "or_", "getitem",
    "expand", "to", "new_ones", "unsqueeze", "cumsum", "diff", "sym_size", "bool", "float",
    "view", "reshape", "ones", "full", "mul", "floordiv", "invert", "logical_and", "where",
    "sym_max", "sym_min", "maximum", "minimum", "clamp",
)
_MASK_SAFE = tuple(name.strip("_") for name in _MASK_SAFE_NAMES)
BIDIRECTIONAL = "no mask and is_causal=False (bidirectional attention)"
WITHIN_TOKEN = "attention within each token over a fixed-size axis (e.g. over layer blocks), not over the tokens"
_LINEAR_HINTS = ("deltanet", "mamba", "ssm", "conv", "linearattention", "rwkv", "gla", "retention", "lightning")


@dataclass(frozen=True)
class MaskInfo:
    recognized: bool
    causal: bool = False
    window: int = 0  # 0: unbounded
    padding: fx.Node | None = None  # the 2-D padding-mask placeholder, when the mask reads one
    reason: str = ""
    indexer: object = None  # indexer_mask.IndexerMask: keys chosen by this layer's indexer (DSA)


@dataclass
class LayerInfo:
    index: int
    kind: LayerKind
    sdpa: list[fx.Node] = field(default_factory=list)
    masks: list[MaskInfo] = field(default_factory=list)
    window: int = 0
    detail: str = ""


def analyse_mask(sdpa: fx.Node, input_roles: dict) -> MaskInfo:
    """Read the mask of one SDPA node; `input_roles` maps graph inputs a mask may read to
    their `mask_inputs.InputRole` (any other tensor input makes the mask not understood)."""
    if attends_within_token(sdpa):
        return MaskInfo(False, reason=WITHIN_TOKEN)
    mask = sdpa_mask_node(sdpa)
    dsa = match_indexer_mask(sdpa, mask) if isinstance(mask, fx.Node) else None
    if isinstance(dsa, IndexerMask):  # DeepSeek sparse attention: the causal part must be one we read
        visible = _analyse(sdpa, dsa.visible, False, input_roles)
        if visible.recognized and visible.window == 0:
            return MaskInfo(True, causal=True, padding=visible.padding, indexer=dsa)
        dsa = f"its causal part is not understood ({visible.reason or 'a window'})"
    info = _analyse(sdpa, mask, bool(sdpa.kwargs.get("is_causal", sdpa.args[5] if len(sdpa.args) > 5 else False)),
                    input_roles)
    if not info.recognized and isinstance(dsa, str) and info.reason.startswith("sparse attention"):
        return MaskInfo(False, reason=f"{info.reason} (not DeepSeek sparse attention's form: {dsa})")
    return info


def _analyse(sdpa: fx.Node, mask, is_causal: bool, input_roles: dict) -> MaskInfo:
    """`analyse_mask` for the mask node `mask` (the attention's, or the causal part of a DSA mask)."""
    from .mask_inputs import InputRole

    from .sink_attention import visible_of_additive

    if isinstance(mask, fx.Node):  # an eager model's additive mask is read through its boolean form
        mask = visible_of_additive(mask) or mask
    if mask is None:
        if is_causal:
            return MaskInfo(True, causal=True)
        return MaskInfo(False, reason=BIDIRECTIONAL)
    if not isinstance(mask, fx.Node):
        return MaskInfo(False, reason=f"constant attn_mask {type(mask).__name__}")
    nodes = ancestors(mask) | {mask}
    if is_table_mask(mask):  # a table's slice joined to the model's mask (causal_table): that one read as above
        parts = [visible_of_additive(a) or a for a in mask.args[:2] if isinstance(a, fx.Node)]
        nodes = {mask}.union(*(ancestors(a) | {a} for a in parts))
    causal = False
    window = 0
    padding = None
    unknown, unknown_inputs = set(), []
    for node in nodes:
        if node.op == "placeholder":
            role = input_roles.get(node)
            if role is InputRole.PADDING:
                padding = node
            elif role is InputRole.CAUSAL_MASK:  # checked to be causal at run time (mask_inputs)
                causal = True
            elif isinstance(role, TableRole):  # a band of `role.window` keys, checked at run time (causal_table)
                causal = True
                if role.window:
                    window = role.window if window == 0 else min(window, role.window)
            elif role is None and isinstance(node.meta.get("example_value"), torch.Tensor):
                unknown_inputs.append(node)
            continue
        if node.op == "get_attr":
            if is_table_shaped(example_value(node)):  # a table no run-time check sees (causal_table)
                unknown_inputs.append(node)
            continue
        if is_table_mask(node):  # joins a table's slice to the model's mask (causal_table)
            continue
        name = target_name(node).rsplit(".", 1)[-1].strip("_")
        if node.op not in ("call_function", "call_method") or is_selection(node) or not any(
                name == s or name.startswith(s) for s in _MASK_SAFE):
            unknown.add(target_name(node))
            continue
        if node.op == "call_function" and node.target in _COMPARISONS:
            causal = True
        if name in ("sub", "isub") and len(node.args) == 2 and isinstance(node.args[1], int) and node.args[1] > 0:
            if any(u.op == "call_function" and u.target in _COMPARISONS for u in node.users):
                window = node.args[1] if window == 0 else min(window, node.args[1])
    if unknown or unknown_inputs:
        return MaskInfo(False, reason=unknown_mask_reason(sdpa, nodes, unknown, unknown_inputs))
    if not causal:
        return MaskInfo(False, reason="mask has no causal comparison")
    return MaskInfo(True, causal=True, window=window, padding=padding)


def attends_within_token(sdpa: fx.Node) -> bool:
    """Whether an attention call mixes no tokens: its query and key lengths are constants while the
    token length (a symbolic size) sits on another axis of the queries. Inkling2's block attention
    residual is one: each token attends over the outputs of earlier layer blocks. Without a mask it
    is not bidirectional over the tokens; it is not attention over the tokens at all."""
    q, k = (example_value(a) if isinstance(a, fx.Node) else None for a in sdpa.args[:2])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 3 and k.dim() >= 3):
        return False
    fixed = not isinstance(q.shape[-2], torch.SymInt) and not isinstance(k.shape[-2], torch.SymInt)
    return fixed and any(isinstance(d, torch.SymInt) for d in q.shape[:-2])


def sdpa_mask_node(sdpa: fx.Node):
    return sdpa.kwargs.get("attn_mask", sdpa.args[3] if len(sdpa.args) > 3 else None)


def classify_layers(graph: fx.Graph, input_roles: dict) -> tuple[str | None, dict[int, LayerInfo]]:
    """Map each decoder-layer index seen in the graph to its attention kind."""
    sdpa_nodes = [n for n in graph.nodes if is_sdpa(n)]
    container = layer_container(sdpa_nodes) if sdpa_nodes else _container_without_sdpa(graph)
    if container is None:
        return None, {}
    layers: dict[int, LayerInfo] = {}
    classes: dict[int, set[str]] = {}
    mixers: dict[int, set[str]] = {}
    for node in graph.nodes:
        idx = layer_index(node, container)
        if idx is None:
            continue
        info = layers.setdefault(idx, LayerInfo(idx, LayerKind.OTHER))
        classes.setdefault(idx, set()).update(layer_module_classes(node, container))
        name = target_name(node).lower()
        if "conv" in name or "cumsum" in name or "cumprod" in name or "delta_rule" in name or "scan" in name:
            mixers.setdefault(idx, set()).add(target_name(node))
        if is_sdpa(node):
            info.sdpa.append(node)
            info.masks.append(analyse_mask(node, input_roles))
    for idx, info in layers.items():
        if info.sdpa:
            bad = [m for m in info.masks if not m.recognized]
            if bad:
                info.kind, info.detail = LayerKind.OTHER, bad[0].reason
            elif any(m.window for m in info.masks):
                info.kind, info.window = LayerKind.SLIDING, max(m.window for m in info.masks)
                info.detail = f"causal mask with a window of {info.window} tokens"
            elif any(m.indexer is not None for m in info.masks):
                info.kind, info.detail = LayerKind.FULL, ("sparse attention over the top-k keys of this layer's "
                                                          "indexer (DSA), run on the kept tokens after a drop")
            else:
                info.kind, info.detail = LayerKind.FULL, "causal attention over every earlier token"
        else:
            hinted = [c for c in classes.get(idx, ()) if any(h in c.lower() for h in _LINEAR_HINTS)]
            if hinted or mixers.get(idx):
                info.kind = LayerKind.LINEAR
                info.detail = "recurrent/convolutional token mixer: " + ", ".join(sorted(hinted or mixers[idx])[:3])
            else:
                info.detail = "no attention or recurrent token mixer recognised"
    return container, dict(sorted(layers.items()))


def _container_without_sdpa(graph: fx.Graph) -> str | None:
    from .fx_utils import _LAYER_PATH, module_paths

    counts: dict[str, int] = {}
    for node in graph.nodes:
        for path, _ in module_paths(node):
            match = _LAYER_PATH.match(path)
            if match:
                counts[match.group(1)] = counts.get(match.group(1), 0) + 1
                break
    return max(counts, key=counts.get) if counts else None
