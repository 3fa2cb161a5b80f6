"""The vLLM graph analysis (`uniprefill.vllm.graph`): synthetic graphs shaped like
vLLM 0.26's mode-2 backbone, checked against what the H200 dump of the real one recorded."""

from __future__ import annotations

import json
import operator
import tarfile
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from transformers import Gemma3TextConfig, LlamaConfig

from uniprefill.vllm.graph import (
    analyze_vllm_graph,
    attach_example_inputs,
    layer_name_of,
)
from uniprefill.models.layer_kinds import layer_kinds as layer_kinds_from_hf_config
from uniprefill.unaccelerated import Kind
from uniprefill.vllm.plugin import VllmTokenDropBackend, config_from_compilation_config

DUMP = Path(__file__).resolve().parents[2] / "docs" / "results" / "vllm-dump-gemma-270m-h200.tar.gz"


class LayerName:
    """Stands in for vLLM's LayerName (dynamo hoists it into a placeholder on torch >= 2.11)."""

    def __init__(self, value: str) -> None:
        self.value = value


def unified_kv_cache_update(key, value, layer_name):
    return key.new_empty(0)


def unified_attention_with_output(query, key, value, output, layer_name, kv_cache_dummy_dep=None):
    output.copy_(query + value)


def rotary_embedding(positions, query, key):
    return query, key


def vllm_like_graph(layers: int, hoisted: bool = True, prefix: str = "model.layers",
                    names: list[str] | None = None) -> fx.GraphModule:
    """input_ids, positions (and the hoisted layer names), then per layer: rotary on q/k,
    the KV-cache update, attention writing into a fresh `output`."""
    names = names or [f"{prefix}.{i}.self_attn.attn" for i in range(layers)]
    graph = fx.Graph()
    hidden = graph.placeholder("l_input_ids_")
    positions = graph.placeholder("l_positions_")
    name_args = []
    for i, name in enumerate(names):
        if hoisted:
            name_arg = graph.placeholder(f"synthetic_local_tmp_{i}_")
            name_arg.meta["example_value"] = LayerName(name)
            name_args.append(name_arg)
        else:
            name_args.append(name)
    for name_arg in name_args:
        pair = graph.call_function(rotary_embedding, (positions, hidden, hidden))
        q = graph.call_function(operator.getitem, (pair, 0))
        k = graph.call_function(operator.getitem, (pair, 1))
        out = graph.call_function(torch.empty_like, (hidden,))
        dep = graph.call_function(unified_kv_cache_update, (k, hidden, name_arg))
        graph.call_function(unified_attention_with_output, (q, k, hidden, out, name_arg),
                            {"kv_cache_dummy_dep": dep})
        hidden = out
    graph.output(hidden)
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("hoisted", [True, False], ids=["hoisted-LayerName", "string"])
def test_sites_in_order_with_their_operands(hoisted):
    gm = vllm_like_graph(4, hoisted)
    info = analyze_vllm_graph(gm)
    assert info.layers == (0, 1, 2, 3) and info.gdn_ops == 0
    assert info.positions is not None and info.positions.name == "l_positions_"
    for site in info.sites:
        assert site.layer_name == f"model.layers.{site.layer}.self_attn.attn"
        assert site.kv_update is not None and site.kv_update.args[0] is site.key
        assert site.attention.kwargs["kv_cache_dummy_dep"] is site.kv_update
        assert site.output.target is torch.empty_like
    assert info.site(2).layer == 2
    with pytest.raises(KeyError, match="no attention layer 7"):
        info.site(7)


def test_unreadable_names_are_errors_that_name_the_node():
    with pytest.raises(ValueError, match="no 'layers.<index>.' part"):
        analyze_vllm_graph(vllm_like_graph(1, prefix="model.blocks"))
    gm = vllm_like_graph(1)
    next(n for n in gm.graph.nodes if n.name.startswith("synthetic")).meta["example_value"] = 3
    with pytest.raises(ValueError, match="neither a string nor a hoisted LayerName"):
        analyze_vllm_graph(gm)
    assert layer_name_of("a") == "a" and layer_name_of(LayerName("b")) == "b" and layer_name_of(None) is None


class FakeScriptObject:
    """Stands in for the wrapper Dynamo records in a placeholder's meta for a script object."""

    def __init__(self, real_obj) -> None:
        self.real_obj = real_obj


def test_layer_names_only_the_example_inputs_carry_are_attached_to_their_placeholders():
    """As vLLM 0.26 hands them on the H200: the placeholders' meta hold no readable LayerName,
    the backend's example inputs do (the first GPU run of the rewrite stopped here)."""
    gm = vllm_like_graph(3)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        node.meta.pop("example_value", None)
    with pytest.raises(ValueError, match="neither a string nor a hoisted LayerName"):
        analyze_vllm_graph(gm)
    names = [LayerName(f"model.layers.{i}.self_attn.attn") for i in range(3)]
    assert attach_example_inputs(gm, [torch.zeros(4), torch.arange(4)]) == 0  # not one per placeholder
    assert attach_example_inputs(gm, [torch.zeros(4), torch.arange(4), *names]) == 3
    assert placeholders[0].meta.get("example_value") is None  # tensors are not touched
    assert analyze_vllm_graph(gm).layers == (0, 1, 2)
    assert attach_example_inputs(gm, [torch.zeros(4), torch.arange(4), *names]) == 0  # already known
    wrapped = vllm_like_graph(2)
    for node in wrapped.graph.nodes:
        if node.name.startswith("synthetic"):
            node.meta["example_value"] = FakeScriptObject(node.meta["example_value"])
    assert [s.layer_name for s in analyze_vllm_graph(wrapped).sites] == [
        "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_layer_kinds_from_hf_configs():
    gemma = layer_kinds_from_hf_config(Gemma3TextConfig(num_hidden_layers=18), 18)
    assert [i for i, k in enumerate(gemma) if k == "full"] == [5, 11, 17]
    assert layer_kinds_from_hf_config(LlamaConfig(num_hidden_layers=4), 4) == ["full"] * 4

    class Windowed:
        sliding_window = 4096

    # Mistral-style: one window and no layer types, so every layer slides (as transformers and
    # vLLM run it); the same derivation as the Hugging Face backend's
    assert layer_kinds_from_hf_config(Windowed(), 2) == ["sliding", "sliding"]
    chunked = type("C", (), {"layer_types": ["chunked_attention", "full_attention"]})()
    assert layer_kinds_from_hf_config(chunked, 2) == ["other", "full"]
    Windowed.use_sliding_window = False  # Qwen2-style: the window is switched off
    assert layer_kinds_from_hf_config(Windowed(), 2) == ["full", "full"]
    with pytest.raises(ValueError, match="3 entries for 2 hidden layers"):
        layer_kinds_from_hf_config(type("C", (), {"layer_types": ["full_attention"] * 3})(), 2)


def test_layer_kinds_match_the_kv_cache_groups_vllm_built_on_the_h200():
    """The H200 dump (docs/vllm.md): per KV-cache group, its layers and sliding window."""
    with tarfile.open(DUMP) as tar:
        call = json.load(tar.extractfile("vllm-dump/call-3.json"))
        graph = json.load(tar.extractfile("vllm-dump/graph-0.json"))
    groups = call["forward_context"]["attn_metadata"]["distinct"]
    kinds = layer_kinds_from_hf_config(Gemma3TextConfig(num_hidden_layers=18), 18)
    seen = set()
    for group in groups:
        window = group["fields"]["sliding_window"]
        sliding = isinstance(window, dict) and window.get("head") == [511, 0]
        for name in group["layers"]:
            layer = int(name.split("layers.")[1].split(".")[0])
            assert kinds[layer] == ("sliding" if sliding else "full"), name
            seen.add(layer)
    assert seen == set(range(18))
    # the layer names the real graph's attention ops carried, in its order, read back
    names = [op["layer_names"][0] for op in graph["layer_name_ops"]
             if op["target"].endswith("unified_attention_with_output")]
    assert analyze_vllm_graph(vllm_like_graph(0, names=names)).layers == tuple(range(18))


def test_backend_report_names_layers_and_planned_drop_points():
    gm = vllm_like_graph(18)
    settings = {"inductor_compile_config": {"uniprefill": {"drop_layers": "auto"}}}
    kinds = layer_kinds_from_hf_config(Gemma3TextConfig(num_hidden_layers=18), 18)
    backend = VllmTokenDropBackend(config_from_compilation_config(settings), layer_kinds=kinds)
    with pytest.warns(UserWarning, match="unaccelerated"):
        backend(gm, [])
    report = backend.graphs[0]
    assert report.layers == tuple(range(18)) and report.drop_layers == (5, 11) and not report.plan_error
    assert report.reason.kind is Kind.OPTION_OFF  # the option vllm_drop is off by default
    blind = VllmTokenDropBackend(config_from_compilation_config(settings))
    with pytest.warns(UserWarning, match="unaccelerated"):
        blind(gm, [])
    assert blind.graphs[0].drop_layers is None and "no layer kinds" in blind.graphs[0].plan_error
    bad = VllmTokenDropBackend(config_from_compilation_config(
        {"inductor_compile_config": {"uniprefill": {"drop_layers": [4]}}}), layer_kinds=kinds)
    with pytest.warns(UserWarning, match="unaccelerated"):
        bad(gm, [])
    assert "not full-attention" in bad.graphs[0].plan_error
    dropping = VllmTokenDropBackend(config_from_compilation_config(
        {"inductor_compile_config": {"uniprefill": {"drop_layers": [4], "vllm_drop": True}}}), layer_kinds=kinds)
    with pytest.warns(UserWarning, match="could not be read"):
        dropping(gm, [])
    assert dropping.graphs[0].reason.kind is Kind.GRAPH_NOT_FOLLOWED


def test_models_without_a_drop_point_or_with_other_scans_run_unaccelerated_with_the_reason():
    """A Mistral-style config (one window, every layer sliding) leaves no drop point; Mamba or
    short-convolution layers have no metadata rebuild in vLLM: both refused, named."""
    import types

    settings = config_from_compilation_config({"inductor_compile_config": {"uniprefill": {}}})
    sliding = VllmTokenDropBackend(settings, layer_kinds=["sliding"] * 4, block_size=16)
    info = types.SimpleNamespace(gdn_ops=0, linear_sites=(), layers=(0, 1, 2, 3), sites=())
    report = types.SimpleNamespace(drop_layers=(), reason="")
    assert sliding._rewrite(None, info, report) is None
    assert "selects no layer" in report.reason and "'sliding'" in report.reason
    mamba = VllmTokenDropBackend(settings, layer_kinds=["linear", "full"] * 2, block_size=16)
    report = types.SimpleNamespace(drop_layers=(1,), reason="")
    info = types.SimpleNamespace(gdn_ops=0, linear_sites=(), layers=(1, 3), sites=())
    assert mamba._rewrite(None, info, report) is None
    assert "recurrent or convolutional token mixers other than Gated DeltaNet" in report.reason


@torch.library.custom_op("uniprefill_test::unified_attention_with_output", mutates_args=("output",))
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                  layer_name: str) -> None:
    output.copy_(query)


@pytest.mark.parametrize("overload", [False, True], ids=["packet", "default"])
def test_custom_ops_are_found_as_packets_and_overloads(overload):
    """vLLM's graphs call torch.ops.vllm.<op>; after functionalisation it may be <op>.default."""
    op = torch.ops.uniprefill_test.unified_attention_with_output
    op = op.default if overload else op
    graph = fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_function(torch.empty_like, (x,))
    graph.call_function(op, (x, x, x, out, "model.layers.3.self_attn.attn"))
    graph.output(out)
    info = analyze_vllm_graph(fx.GraphModule(torch.nn.Module(), graph))
    assert info.layers == (3,) and info.sites[0].kv_update is None
