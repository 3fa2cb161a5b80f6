"""Record the vLLM APIs uniprefill relies on, as they are on the box (no GPU work).

    python3 scripts/gpu/vllm/probe_api.py --out $OUT/vllm-api.json

(vLLM logs to stdout, hence a file rather than a redirect.)

Each entry says whether the name exists and, where cheap, its shape (fields, members), so a
later session sees at once what changed when the vLLM version moves. The list mirrors
docs/vllm.md ("vLLM APIs relied on").
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata as md
import json
import sys


def probe(path: str, attr: str | None = None):
    try:
        module = importlib.import_module(path)
        obj = getattr(module, attr) if attr else module
    except Exception as exc:  # noqa: BLE001 - a probe records every failure
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out = {"ok": True}
    if dataclasses.is_dataclass(obj):
        out["fields"] = [f.name for f in dataclasses.fields(obj)]
    elif isinstance(obj, type) and hasattr(obj, "__members__"):
        out["members"] = {k: str(v.value) for k, v in obj.__members__.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    report = {"python": sys.version.split()[0], "versions": {}}
    for name in ("vllm", "torch", "transformers", "numpy", "protobuf", "typing_extensions", "cuda-bindings",
                 "flashinfer-python", "uniprefill"):
        try:
            report["versions"][name] = md.version(name)
        except md.PackageNotFoundError:
            report["versions"][name] = None
    report["general_plugins"] = [f"{ep.name} -> {ep.value}" for ep in md.entry_points(group="vllm.general_plugins")]
    names = [
        ("vllm.config", "CompilationConfig"),
        ("vllm.config.compilation", "CompilationMode"),
        ("vllm.config.compilation", "CUDAGraphMode"),
        ("vllm.config", "get_current_vllm_config"),
        ("vllm.config", "set_current_vllm_config"),
        ("vllm.utils.import_utils", "resolve_obj_by_qualname"),
        ("vllm.compilation.wrapper", "TorchCompileWithNoGuardsWrapper"),
        ("vllm.forward_context", "get_forward_context"),
        ("vllm.forward_context", "ForwardContext"),
        ("vllm.v1.attention.backend", "CommonAttentionMetadata"),
        ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadata"),
        ("vllm.model_executor.layers.attention.attention", "unified_attention_with_output"),
        ("vllm.model_executor.layers.attention.attention", "unified_kv_cache_update"),
        ("vllm.plugins", "load_general_plugins"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),  # V1: _model_forward, _update_states
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),  # V2: execute_model, prepare_inputs
        ("vllm.v1.worker.gpu.input_batch", "InputBatch"),  # V2: req_ids, prefill_len_np
    ]
    report["names"] = {f"{m}.{a}": probe(m, a) for m, a in names}
    runner_methods = {"vllm.v1.worker.gpu_model_runner": ("_model_forward", "_update_states"),
                      "vllm.v1.worker.gpu.model_runner": ("execute_model", "prepare_inputs")}
    for module, methods in runner_methods.items():  # what vllm_runner_hook wraps
        key = f"{module}.GPUModelRunner"
        if report["names"][key]["ok"]:
            cls = importlib.import_module(module).GPUModelRunner
            report["names"][key]["methods"] = {m: callable(getattr(cls, m, None)) for m in methods}
    try:
        import torch

        import vllm.model_executor.layers.attention.attention  # noqa: F401  (registers the ops)

        report["ops"] = {op: hasattr(torch.ops.vllm, op) for op in
                         ("unified_attention_with_output", "unified_kv_cache_update", "qwen_gdn_attention_core")}
    except Exception as exc:  # noqa: BLE001
        report["ops"] = {"error": f"{type(exc).__name__}: {exc}"}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    missing = [k for k, v in report["names"].items() if not v["ok"]]
    print(f"probe: vllm {report['versions']['vllm']}; {len(report['names']) - len(missing)}/{len(report['names'])} "
          f"names found; missing {missing}; ops {report['ops']}")


if __name__ == "__main__":
    main()
