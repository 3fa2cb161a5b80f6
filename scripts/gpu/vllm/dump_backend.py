"""A dynamo backend that dumps the graph vLLM hands over, and the forward context of its first calls.

Use it through the channel of docs/vllm.md, with this folder on PYTHONPATH (the EngineCore
subprocess inherits the environment) and VLLM_USE_AOT_COMPILE=0 (mode 2):

    LLM(model, compilation_config={"mode": 2, "backend": "dump_backend.backend"})
    python3 scripts/gpu/vllm/smoke_llm.py --model-dir /tmp/gemma-270m --dump-graph ...   # does both

Files, in $UNIPREFILL_VLLM_DUMP_DIR (default /tmp/vllm-dump):
- graph-N.py: the graph's code (`gm.print_readable`, with shapes where dynamo recorded them).
- graph-N.json: placeholders with their example inputs (shape, dtype; a hoisted `LayerName`
  shows its string), counts of call_function targets, every node (op, target, args in short
  form, output shape) and, for each call whose arguments carry a layer name (vLLM's attention
  and KV-cache-update ops), that name.
- call-M.json: for the first 3 calls of each graph, and its first 3 calls that carry attention
  metadata (warm-up and profile runs come first; $UNIPREFILL_VLLM_DUMP_CALLS changes 3), the
  forward context (`vllm.forward_context.get_forward_context()`): attn_metadata (one entry per distinct
  metadata object: class, the layers sharing it, every field, tensors as shape/dtype/first
  values), slot_mapping (distinct tensors and the layers sharing each), the call's inputs,
  the number of tokens and the positions. M counts calls over all graphs of the process.

Dumping never raises into vLLM: every failure is written into the JSON as "error". The
wrapper returned to dynamo runs the graph unchanged (`gm.forward`).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import os
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

DUMP_DIR_ENV = "UNIPREFILL_VLLM_DUMP_DIR"
DEFAULT_DUMP_DIR = "/tmp/vllm-dump"
CALLS_ENV = "UNIPREFILL_VLLM_DUMP_CALLS"
CALLS_TO_DUMP = 3
FIRST_VALUES = 8
MAX_NODES = 5000

# The only module state: numbering of graphs and calls within one process.
_graph_numbers = itertools.count()
_call_numbers = itertools.count()


def dump_dir() -> Path:
    folder = Path(os.environ.get(DUMP_DIR_ENV) or DEFAULT_DUMP_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_tb(exc.__traceback__)[-4:])


# --- describing values -------------------------------------------------------------------------

def layer_name_of(value: Any) -> str | None:
    """The string inside vLLM's `LayerName` (or its fake-script wrapper), or None."""
    for candidate in (value, getattr(value, "real_obj", None)):
        if type(candidate).__name__ == "LayerName" and isinstance(getattr(candidate, "value", None), str):
            return candidate.value
    return None


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def describe_tensor(t, values: bool) -> dict:
    import torch

    out = {"shape": [str(s) if not isinstance(s, int) else s for s in t.shape], "dtype": str(t.dtype),
           "device": str(t.device)}
    if values and t.numel() and type(t) is torch.Tensor and t.device.type != "meta":
        try:
            capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
            if not capturing:
                flat = t.detach().reshape(-1)
                out["first"] = flat[:FIRST_VALUES].cpu().tolist()
                if flat.numel() > FIRST_VALUES:
                    out["last"] = flat[-FIRST_VALUES:].cpu().tolist()
        except Exception as exc:  # noqa: BLE001 - recorded, never raised
            out["values_error"] = f"{type(exc).__name__}: {exc}"
    return out


def describe(value: Any, values: bool = False, depth: int = 0) -> Any:
    """JSON-able summary of one value: tensors as shape/dtype (and first values), scalars as is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if _is_tensor(value):
        return describe_tensor(value, values)
    if type(value).__module__ == "numpy" and hasattr(value, "shape") and hasattr(value, "dtype"):
        out = {"numpy_shape": list(value.shape), "dtype": str(value.dtype)}
        if values:
            out["first"] = value.reshape(-1)[:FIRST_VALUES].tolist()
        return out
    name = layer_name_of(value)
    if name is not None:
        return {"LayerName": name}
    if type(value).__name__ in ("SymInt", "SymFloat", "SymBool"):
        return {"sym": str(value)}
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (list, tuple)):
        head = [describe(v, values, depth + 1) for v in value[:4]] if depth < 3 else []
        return {"type": type(value).__name__, "len": len(value), "head": head}
    if isinstance(value, dict):
        return {"type": "dict", "len": len(value), "keys": [str(k) for k in list(value)[:8]]}
    if dataclasses.is_dataclass(value) and depth < 2:
        return {"class": type(value).__name__, "fields": fields_of(value, values, depth + 1)}
    return {"type": type(value).__name__, "repr": repr(value)[:200]}


def fields_of(obj: Any, values: bool, depth: int = 0) -> dict:
    names = ([f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj)
             else [k for k in vars(obj) if not k.startswith("__")] if hasattr(obj, "__dict__") else [])
    out = {}
    for name in names:
        try:
            out[name] = describe(getattr(obj, name), values, depth)
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


# --- the graph ---------------------------------------------------------------------------------

def target_name(node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) or str(target)


def _short(arg: Any) -> Any:
    import torch.fx

    if isinstance(arg, torch.fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        return [_short(a) for a in arg[:8]] + (["..."] if len(arg) > 8 else [])
    if isinstance(arg, (bool, int, float, str)) or arg is None:
        return arg
    name = layer_name_of(arg)
    return {"LayerName": name} if name is not None else repr(arg)[:80]


def _layer_names_in(args, placeholder_names: dict[str, str]) -> list[str]:
    """Layer names carried by a call's arguments: plain strings, LayerName constants, or
    placeholders whose example input is a (hoisted) LayerName."""
    import torch.fx

    found = []
    for arg in _flatten(args):
        if isinstance(arg, str):
            found.append(arg)
        elif isinstance(arg, torch.fx.Node):
            if arg.name in placeholder_names:
                found.append(placeholder_names[arg.name])
            else:
                name = layer_name_of(arg.meta.get("example_value", arg.meta.get("val")))
                if name is not None:
                    found.append(name)
        else:
            name = layer_name_of(arg)
            if name is not None:
                found.append(name)
    return found


def _flatten(args):
    for arg in args:
        if isinstance(arg, (list, tuple)):
            yield from _flatten(arg)
        elif isinstance(arg, dict):
            yield from _flatten(list(arg.values()))
        else:
            yield arg


def _node_shape(node) -> Any:
    value = node.meta.get("example_value", node.meta.get("val"))
    if value is None:
        return None
    if _is_tensor(value):
        return describe_tensor(value, values=False)
    if isinstance(value, (list, tuple)) and value and all(_is_tensor(v) for v in value):
        return [describe_tensor(v, values=False) for v in value[:4]]
    return None


def graph_summary(gm, example_inputs) -> dict:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    described, layer_placeholders = [], {}
    for i, node in enumerate(placeholders):
        example = example_inputs[i] if i < len(example_inputs) else node.meta.get("example_value")
        described.append({"index": i, "name": node.name, "target": str(node.target), "example": describe(example)})
        name = layer_name_of(example)
        if name is not None:
            layer_placeholders[node.name] = name
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    nodes, layer_ops = [], []
    for node in list(gm.graph.nodes)[:MAX_NODES]:
        entry = {"name": node.name, "op": node.op, "target": target_name(node)}
        if node.op in ("call_function", "call_method", "call_module"):
            entry["args"] = _short(node.args)
            if node.kwargs:
                entry["kwargs"] = {k: _short(v) for k, v in node.kwargs.items()}
            names = _layer_names_in((node.args, node.kwargs), layer_placeholders)
            if names:
                entry["layer_names"] = names
                layer_ops.append({"node": node.name, "target": entry["target"], "layer_names": names})
        shape = _node_shape(node)
        if shape is not None:
            entry["out"] = shape
        nodes.append(entry)
    return {
        "num_nodes": len(gm.graph.nodes),
        "num_placeholders": len(placeholders),
        "placeholders": described,
        "call_function_counts": dict(Counter(target_name(n) for n in calls).most_common()),
        "layer_name_ops": layer_ops,
        "nodes": nodes,
        "nodes_truncated": len(gm.graph.nodes) > MAX_NODES,
    }


def graph_code(gm) -> str:
    try:
        return gm.print_readable(print_output=False, include_stride=True, include_device=True)
    except Exception:  # noqa: BLE001 - older/newer signatures: the plain code is enough
        return gm.code


# --- the forward context -----------------------------------------------------------------------

def _metadata_summary(attn_metadata: Any) -> Any:
    """One entry per distinct metadata object, with the layers that share it."""
    if attn_metadata is None:
        return None
    if isinstance(attn_metadata, list):  # DBO: one dict per micro-batch
        return {"type": "list", "ubatches": [_metadata_summary(m) for m in attn_metadata]}
    if not isinstance(attn_metadata, dict):
        return {"type": type(attn_metadata).__name__, "fields": fields_of(attn_metadata, values=True)}
    groups: dict[int, dict] = {}
    for layer, meta in attn_metadata.items():
        group = groups.get(id(meta))
        if group is None:
            group = groups[id(meta)] = {"class": f"{type(meta).__module__}.{type(meta).__qualname__}",
                                        "layers": [], "fields": fields_of(meta, values=True)}
        group["layers"].append(layer)
    return {"type": "dict", "num_layers": len(attn_metadata), "distinct": list(groups.values())}


def _slot_mapping_summary(slot_mapping: Any) -> Any:
    if slot_mapping is None:
        return None
    if isinstance(slot_mapping, list):
        return {"type": "list", "ubatches": [_slot_mapping_summary(s) for s in slot_mapping]}
    if not isinstance(slot_mapping, dict):
        return describe(slot_mapping, values=True)
    groups: dict[Any, dict] = {}
    for layer, t in slot_mapping.items():
        key = (t.data_ptr(), tuple(t.shape)) if _is_tensor(t) else id(t)
        group = groups.get(key)
        if group is None:
            group = groups[key] = {"layers": [], "value": describe(t, values=True)}
        group["layers"].append(layer)
    return {"type": "dict", "num_layers": len(slot_mapping), "distinct": list(groups.values())}


def forward_context_summary(args: tuple, placeholder_names: list[str]) -> dict:
    out: dict[str, Any] = {"inputs": []}
    for i, arg in enumerate(args):
        name = placeholder_names[i] if i < len(placeholder_names) else f"arg{i}"
        entry = {"name": name, "value": describe(arg, values=False)}
        if _is_tensor(arg) and ("position" in name or "input_ids" in name):
            entry["value"] = describe(arg, values=True)
        out["inputs"].append(entry)
    named = list(zip(placeholder_names, args))
    positions = [a for n, a in named if _is_tensor(a) and "position" in n]
    if positions:
        out["positions"] = describe(positions[0], values=True)
    ids = [a for n, a in named if _is_tensor(a) and "input_ids" in n and a.dim() >= 1]
    sizes = {n: int(a) for n, a in named if isinstance(a, int) and not isinstance(a, bool)}
    if sizes:
        out["symbolic_sizes"] = sizes  # dynamo's dynamic dimensions (the token count) as passed
    if ids:
        out["num_tokens"] = int(ids[0].shape[0])
    elif positions:
        out["num_tokens"] = int(positions[0].shape[-1])
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            out["forward_context"] = None
            out["forward_context_note"] = "no forward context set for this call"
            return out
        ctx = get_forward_context()
    except Exception as exc:  # noqa: BLE001 - e.g. called outside a vLLM forward
        out["forward_context_error"] = f"{type(exc).__name__}: {exc}"
        return out
    summary: dict[str, Any] = {"class": type(ctx).__name__}
    for key, fn in (("attn_metadata", _metadata_summary), ("slot_mapping", _slot_mapping_summary)):
        try:
            summary[key] = fn(getattr(ctx, key, None))
        except Exception as exc:  # noqa: BLE001
            summary[key] = {"error": _error(exc)}
    layers = getattr(ctx, "no_compile_layers", None)
    if isinstance(layers, dict):
        summary["no_compile_layers"] = {"count": len(layers),
                                        "classes": dict(Counter(type(v).__name__ for v in layers.values()))}
    names = [f.name for f in dataclasses.fields(ctx)] if dataclasses.is_dataclass(ctx) else list(vars(ctx))
    for name in names:
        if name not in summary and name not in ("no_compile_layers",):
            try:
                summary[name] = describe(getattr(ctx, name), values=True)
            except Exception as exc:  # noqa: BLE001
                summary[name] = {"error": f"{type(exc).__name__}: {exc}"}
    out["forward_context"] = summary
    return out


# --- the backend -------------------------------------------------------------------------------

def _has_attn_metadata() -> bool:
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        return is_forward_context_available() and get_forward_context().attn_metadata is not None
    except Exception:  # noqa: BLE001
        return False


class DumpingForward:
    """Runs the graph unchanged. Writes call-M.json for its first `calls_to_dump` calls, and
    for its first `calls_to_dump` calls that carry attention metadata (vLLM's warm-up and
    profile runs come first and usually have none; the requests' prefill and decode steps do)."""

    def __init__(self, gm, graph_index: int, folder: Path, calls_to_dump: int) -> None:
        self.gm = gm
        self.graph_index = graph_index
        self.folder = folder
        self.calls_to_dump = calls_to_dump
        self.calls = 0
        self.dumped_any = 0
        self.dumped_with_metadata = 0
        self.placeholder_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.dumped_with_metadata < self.calls_to_dump:
            with_metadata = _has_attn_metadata()
            if with_metadata or self.dumped_any < self.calls_to_dump:
                self.dumped_any += 1
                self.dumped_with_metadata += with_metadata
                self._dump(args)
        return self.gm.forward(*args, **kwargs)

    def _dump(self, args: tuple) -> None:
        number = next(_call_numbers)
        data: dict[str, Any] = {"graph": self.graph_index, "call_of_graph": self.calls, "pid": os.getpid(),
                                "time": time.time()}
        try:
            data.update(forward_context_summary(args, self.placeholder_names))
        except Exception as exc:  # noqa: BLE001 - never crash the engine
            data["error"] = _error(exc)
        try:
            _write_json(self.folder / f"call-{number}.json", data)
        except Exception:  # noqa: BLE001
            pass


def backend(gm, example_inputs, **options):
    """Dynamo backend: dump the graph, return a wrapper that dumps the first calls' context."""
    index = next(_graph_numbers)
    try:
        folder = dump_dir()
    except Exception:  # noqa: BLE001 - an unwritable folder must not stop the engine
        return gm.forward
    info: dict[str, Any] = {"graph": index, "pid": os.getpid(), "time": time.time(),
                            "options": sorted(options)}
    try:
        (folder / f"graph-{index}.py").write_text(graph_code(gm))
    except Exception as exc:  # noqa: BLE001
        info["code_error"] = _error(exc)
    try:
        info.update(graph_summary(gm, example_inputs))
    except Exception as exc:  # noqa: BLE001
        info["error"] = _error(exc)
    try:
        _write_json(folder / f"graph-{index}.json", info)
    except Exception:  # noqa: BLE001
        pass
    try:
        calls = int(os.environ.get(CALLS_ENV) or CALLS_TO_DUMP)
        return DumpingForward(gm, index, folder, calls)
    except Exception:  # noqa: BLE001
        return gm.forward
