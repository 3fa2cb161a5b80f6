"""Find the attention layers of a vLLM backbone graph (the first step of the vLLM adapter).

vLLM 0.26's mode-2 graph of a decoder backbone (dumped on the H200, `docs/vllm.md`) is flat:
`input_ids` and `positions` are `[s]` with a symbolic token count `s`, hidden states are
`[s, hidden]`, and each attention layer is a pair of custom ops,

    dep = torch.ops.vllm.unified_kv_cache_update(key, value, NAME)
    torch.ops.vllm.unified_attention_with_output(query, key, value, output, NAME, kv_cache_dummy_dep=dep)

where NAME identifies the layer ("model.layers.5.self_attn.attn"). On torch >= 2.11 dynamo
hoists NAME out of the graph: it arrives as a placeholder whose example value is vLLM's
`LayerName` object (`.value` holds the string); older graphs pass the string itself. This
module reads those sites, in graph order, with their layer index and operands, so that the
rewrite can put its score-and-select after a drop layer's attention and look up each later
layer's metadata by name. It imports neither vLLM nor anything that needs a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx

from ..passes.fx_utils import target_name

ATTENTION_OP = "unified_attention_with_output"
KV_UPDATE_OP = "unified_kv_cache_update"
GDN_OP = "gdn_attention"  # vLLM 0.26: qwen_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name=NAME)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class VllmAttentionSite:
    """One attention layer of the graph."""

    layer_name: str
    layer: int  # the N of "layers.N." in the name
    attention: fx.Node  # unified_attention_with_output(query, key, value, output, name, ...)
    kv_update: fx.Node | None  # unified_kv_cache_update(key, value, name), if the backend has one

    @property
    def query(self) -> fx.Node:
        return self.attention.args[0]

    @property
    def key(self) -> fx.Node:
        return self.attention.args[1]

    @property
    def output(self) -> fx.Node:
        return self.attention.args[3]


@dataclass(frozen=True)
class VllmLinearSite:
    """One Gated DeltaNet layer of the graph: vLLM runs its conv1d and delta rule inside one op that reads the
    layer's metadata by name (`vllm.gdn_metadata`)."""

    layer_name: str
    layer: int  # the N of "layers.N." in the name
    attention_before: int  # attention sites before it in the graph: it runs after drop points at positions below


@dataclass(frozen=True)
class VllmGraphInfo:
    sites: tuple[VllmAttentionSite, ...]
    positions: fx.Node | None  # the placeholder of the token positions
    gdn_ops: int  # linear-attention (Gated DeltaNet) ops
    linear_sites: tuple[VllmLinearSite, ...] = ()  # the GDN ops whose layer name could be read

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(site.layer for site in self.sites)

    def position(self, layer: int) -> int:
        """The position of attention layer `layer` among the sites (the runtime's layer index; the same number when
        every layer is an attention layer)."""
        self.site(layer)  # KeyError -> not an attention site
        return self.layers.index(layer)

    def site(self, layer: int) -> VllmAttentionSite:
        for site in self.sites:
            if site.layer == layer:
                return site
        raise KeyError(f"no attention layer {layer} in this graph (layers: {list(self.layers)})")


def layer_name_of(value) -> str | None:
    """The layer name a value carries: a string, or vLLM's `LayerName` (its `.value`), also
    inside the `FakeScriptObject` that Dynamo records for it (its `.real_obj`)."""
    if isinstance(value, str):
        return value
    for candidate in (value, getattr(value, "real_obj", None)):
        inner = getattr(candidate, "value", None)
        if type(candidate).__name__ == "LayerName" and isinstance(inner, str):
            return inner
    return None


def attach_example_inputs(gm: fx.GraphModule, example_inputs) -> int:
    """Record each hoisted layer name that only the backend's `example_inputs` carry on its
    placeholder (`meta["example_value"]`), where `analyze_vllm_graph` reads it; the count.

    vLLM (0.26, on the H200) hands the names as placeholders whose meta holds no readable
    `LayerName`; the example input at the placeholder's position does. Inputs that do not
    line up one to one with the placeholders are left alone (the analysis then names the node).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return 0
    attached = 0
    for node, value in zip(placeholders, example_inputs):
        known = layer_name_of(node.meta.get("example_value", node.meta.get("val")))
        if known is None and not isinstance(value, str) and layer_name_of(value) is not None:
            node.meta["example_value"] = value
            attached += 1
    return attached


def _is_op(name: str, op: str) -> bool:
    """`name` is `op`, however it is spelled: a function, `torch.ops.vllm.<op>` or its `.default`."""
    return op in name.split(".")


def _name_argument(node: fx.Node) -> str | None:
    name = target_name(node)
    position = 4 if _is_op(name, ATTENTION_OP) or GDN_OP in name else 2
    name_arg = node.args[position] if len(node.args) > position else node.kwargs.get("layer_name")
    if isinstance(name_arg, fx.Node):
        return layer_name_of(name_arg.meta.get("example_value", name_arg.meta.get("val")))
    return layer_name_of(name_arg)


def analyze_vllm_graph(gm: fx.GraphModule) -> VllmGraphInfo:
    """The attention sites of `gm`; ValueError naming the node when one cannot be read."""
    updates: dict[str, fx.Node] = {}
    sites: list[VllmAttentionSite] = []
    gdn = 0
    linear: list[VllmLinearSite] = []
    positions = None
    for node in gm.graph.nodes:
        if node.op == "placeholder" and positions is None and "positions" in node.name:
            positions = node
        if node.op != "call_function":
            continue
        name = target_name(node)
        if GDN_OP in name:
            gdn += 1
            layer_name = _name_argument(node)
            match = _LAYER_INDEX.search(layer_name or "")
            if match is not None:
                linear.append(VllmLinearSite(layer_name, int(match.group(1)), len(sites)))
            continue
        if not (_is_op(name, ATTENTION_OP) or _is_op(name, KV_UPDATE_OP)):
            continue
        layer_name = _name_argument(node)
        if layer_name is None:
            raise ValueError(f"{node.name} ({name}): its layer name is neither a string nor a hoisted LayerName")
        if _is_op(name, KV_UPDATE_OP):
            updates[layer_name] = node
            continue
        match = _LAYER_INDEX.search(layer_name)
        if match is None:
            raise ValueError(f"{node.name}: layer name {layer_name!r} has no 'layers.<index>.' part")
        if len(node.args) < 4:
            raise ValueError(f"{node.name}: expected (query, key, value, output, name), got {len(node.args)} arguments")
        sites.append(VllmAttentionSite(layer_name, int(match.group(1)), node, updates.pop(layer_name, None)))
    layers = [site.layer for site in sites]
    if len(set(layers)) != len(layers):
        raise ValueError(f"a layer index appears twice among the attention sites: {layers}")
    return VllmGraphInfo(tuple(sites), positions, gdn, tuple(linear))
