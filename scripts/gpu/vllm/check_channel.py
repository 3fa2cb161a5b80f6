"""Check the uniprefill channel against the installed vLLM, without a model or a GPU kernel.

    python3 scripts/gpu/vllm/check_channel.py [--out FILE]

What it runs, with vLLM's own code: the `vllm.general_plugins` loader (does it call
`uniprefill.vllm.plugin.register`?); `CompilationConfig` / `VllmConfig` validation of the
channel's settings; `CompilationConfig.init_backend` inside `set_current_vllm_config` (does
the qualname resolve to a `VllmTokenDropBackend` bound to the settings?); the config hash;
bad settings (each must fail with a ValueError naming it); and the mode-2 decorator path
(`@support_torch_compile` on a tiny module: one dynamo trace with a symbolic token count,
served for several sizes) with and without `VLLM_USE_AOT_COMPILE`.

On a machine without a GPU vLLM cannot infer a device; the script then pins
`DeviceConfig(device="cuda")`, which only names the device (nothing is allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

TINY_MODULE_RUN = r"""
import json, os, warnings, torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm import envs
from uniprefill.vllm import plugin as vllm_plugin
import check_channel

@support_torch_compile
class Tiny(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.lin = nn.Linear(8, 8)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + 1

out = {"VLLM_USE_AOT_COMPILE": bool(envs.VLLM_USE_AOT_COMPILE)}
cc = CompilationConfig(mode=2, backend=vllm_plugin.BACKEND_QUALNAME, inductor_compile_config={"uniprefill": {}})
try:
    vc = VllmConfig(compilation_config=cc, **check_channel.device_kwargs())
    with set_current_vllm_config(vc):
        model = Tiny(vllm_config=vc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shapes = [list(model(torch.randn(n, 8)).shape) for n in (5, 9, 3)]
    out.update(ok=True, shapes=shapes, backend_calls=sum("unaccelerated" in str(w.message) for w in caught))
except Exception as exc:
    out.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
print("RESULT " + json.dumps(out))
"""


def device_kwargs() -> dict:
    from vllm.config import DeviceConfig
    from vllm.platforms import current_platform

    return {} if current_platform.device_type else {"device_config": DeviceConfig(device="cuda")}


def check_config_path() -> dict:
    import torch
    import vllm
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.plugins import load_general_plugins

    from uniprefill.vllm import plugin as vllm_plugin

    out = {"vllm": vllm.__version__, "torch": torch.__version__}
    load_general_plugins()
    out["register_called_by_vllm_plugin_loader"] = vllm_plugin.plugin_loaded()
    dev = device_kwargs()
    out["device_pinned_for_cpu"] = bool(dev)

    def config(**kwargs):
        return VllmConfig(compilation_config=CompilationConfig(**kwargs), **dev)

    settings = {"p": 0.95, "drop_layers": [7, 11]}
    vc = config(mode=2, backend=vllm_plugin.BACKEND_QUALNAME, inductor_compile_config={"uniprefill": settings})
    out["mode_after_post_init"] = int(vc.compilation_config.mode)
    out["settings_kept"] = vc.compilation_config.inductor_compile_config.get("uniprefill") == settings
    out["cudagraph_mode_after_post_init"] = str(vc.compilation_config.cudagraph_mode)
    other = config(mode=2, backend=vllm_plugin.BACKEND_QUALNAME, inductor_compile_config={"uniprefill": {"p": 0.9}})
    out["config_hash_covers_settings"] = vc.compilation_config.compute_hash() != other.compilation_config.compute_hash()
    with set_current_vllm_config(vc):
        try:
            backend = vc.compilation_config.init_backend(vc)
            out["init_backend"] = type(backend).__name__
            out["backend_p"] = backend.config.p
        except ValueError as exc:  # e.g. AOT compile on: reported, the rest still runs
            out["init_backend"] = f"ValueError: {str(exc).splitlines()[-1]}"
    with set_current_vllm_config(vc):
        backend = vllm_plugin.VllmTokenDropBackend.from_vllm_config(vc, vllm.__version__, aot_compile=False)

    def f(x):
        return torch.relu(x) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(f, fullgraph=True, dynamic=False, backend=backend,
                      options={"guard_filter_fn": lambda guards: [False] * len(guards)})(torch.randn(4))
    out["backend_called_by_torch_compile"] = len(backend.graphs)
    errors = {}
    for name, kwargs in {
        "mode3_inductor": dict(mode=3, backend="inductor", inductor_compile_config={"uniprefill": {}}),
        "p_out_of_range": dict(mode=2, backend=vllm_plugin.BACKEND_QUALNAME, inductor_compile_config={"uniprefill": {"p": 2}}),
        "unknown_option": dict(mode=2, backend=vllm_plugin.BACKEND_QUALNAME,
                               inductor_compile_config={"uniprefill": {"top_p": 0.5}}),
        "no_settings": dict(mode=2, backend=vllm_plugin.BACKEND_QUALNAME),
    }.items():
        bad = config(**kwargs)
        try:
            with set_current_vllm_config(bad):
                got = bad.compilation_config.init_backend(bad)
            errors[name] = f"no error: {type(got).__name__}"
        except Exception as exc:  # noqa: BLE001 - recorded
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    out["bad_settings"] = errors
    return out


def run_tiny_module(aot: str) -> dict:
    env = dict(os.environ, VLLM_USE_AOT_COMPILE=aot, VLLM_CACHE_ROOT=tempfile.mkdtemp())
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", TINY_MODULE_RUN], env=env, capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"ok": False, "error": (proc.stderr or proc.stdout)[-1500:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = check_config_path()
    report["mode2_decorator_aot_off"] = run_tiny_module("0")
    report["mode2_decorator_aot_on"] = run_tiny_module("1")
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
