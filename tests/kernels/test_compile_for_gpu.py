"""The row-layout Triton kernels compile for an H100/H200 (sm_90) on this CPU machine: Triton's own compiler, down to
PTX and a cubin, with the argument types the launchers pass. Triton's CPU interpreter (the other kernel tests) runs
Python on NumPy and accepts code the compiler refuses; this catches that before a GPU session does. Skipped where
the installed Triton has no NVIDIA backend or no `ptxas`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from uniprefill.kernels.layout_rows import kernel as k

    INT32_POINTERS = {"QSL", "KV_BASE", "T0", "T1", "T2", "T3", "T4", "T5", "T6", "T7"}  # vLLM's int32 tensors
    INT64_POINTERS = {"KEPT", "POS_IN", "SRC_IN", "POS_OUT", "SRC_OUT", "REQ_OUT", "LOGICAL_OUT", "SLOTS",
                      "POS", "REQ", "CTX", "DROPPING", "COUNTS"}
    for fn in (k.layout_rows_kernel, k.window_counts_kernel):
        signature = {}
        for name in fn.arg_names:
            if name == "BLOCK_T":
                signature[name] = "constexpr"
            elif name in INT32_POINTERS:
                signature[name] = "*i32"
            elif name in INT64_POINTERS:
                signature[name] = "*i64"
            else:
                signature[name] = "i32"  # Python ints below 2**31: what the launcher passes
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs={"BLOCK_T": 256}),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], fn
        print("compiled", fn.__name__, len(compiled.asm["ptx"]))
""")


def _has_nvidia_backend() -> bool:
    try:
        import triton
    except ImportError:
        return False
    backends = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia")
    return os.path.isdir(backends) and any(name.startswith("ptxas") for _, _, files in os.walk(backends)
                                           for name in files)


@pytest.mark.skipif(not _has_nvidia_backend(), reason="Triton without its NVIDIA backend or ptxas")
def test_the_row_layout_kernels_compile_for_sm90(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("compiled") == 2, result.stdout
