"""Triton kernels that changed since the last GPU run compile for an H100/H200 (sm_90) on this CPU machine: Triton's
own compiler, down to PTX and a cubin, with the argument types the launchers pass (the row-layout and decode-graph
kernels, and the paged window kernels with and without skipped rows or a mixed step's rows). Triton's CPU interpreter (the other kernel
tests) runs Python on NumPy and accepts code the compiler refuses, and refuses some it accepts; this catches the
first kind before a GPU session does. Skipped where the installed Triton has no NVIDIA backend or no `ptxas`."""

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
    from uniprefill.kernels.layout_rows import kernel as rows
    from uniprefill.kernels.paged_window import kernel as window

    def types(fn, pointers, floats=(), constexprs=None):
        signature = {}
        for name in fn.arg_names:
            if constexprs and name in constexprs:
                signature[name] = "constexpr"
            elif name in pointers:
                signature[name] = pointers[name]
            else:
                signature[name] = "fp32" if name in floats else "i32"  # Python ints below 2**31, as launched
        return signature

    def compile_one(fn, pointers, floats=(), constexprs=None):
        source = ASTSource(fn=fn, signature=types(fn, pointers, floats, constexprs), constexprs=constexprs or {})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], fn
        print("compiled", fn.__name__, sorted((constexprs or {}).items()))

    i32 = {n: "*i32" for n in ("QSL", "KV_BASE", "T0", "T1", "T2", "T3", "T4", "T5", "T6", "T7")}  # vLLM's int32
    i64 = {n: "*i64" for n in ("KEPT", "POS_IN", "SRC_IN", "POS_OUT", "SRC_OUT", "REQ_OUT", "LOGICAL_OUT", "SLOTS",
                               "POS", "REQ", "CTX", "DROPPING", "COUNTS", "LOGICAL", "COUNT")}
    compile_one(rows.layout_rows_kernel, {**i32, **i64}, constexprs={"BLOCK_T": 256})
    compile_one(rows.window_counts_kernel, {**i32, **i64}, constexprs={"BLOCK_T": 256})
    decode = {"SEQ_LENS": "*i32", "TABLE": "*i32", "SLOTS_IN": "*i64", "REMOVED": "*i32", "LENS": "*i32",
              "SLOTS": "*i64", "TAIL": "*i64", "PROMPT_END": "*i64", "HAS": "*u8", "ROWS": "*i64", "VLLM_ROWS": "*u8"}
    compile_one(rows.decode_segment_kernel, decode, constexprs={"BLOCK_R": 128})
    for flags in (False, True):
        compile_one(rows.decode_window_kernel, decode, constexprs={"HAS_REMOVED": flags, "BLOCK_W": 128})
    attention = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "TABLE": "*i32", "SKIP": "*u8",
                 "PART_M": "*fp32", "PART_L": "*fp32", "PART_ACC": "*fp32", "ROWS": "*i64", **i64}
    gemma = dict(GROUP=4, BLOCK_G=16, HEAD_DIM=256, BLOCK_D=256)  # Gemma-3-270M's sliding layers
    for splits, skip, taken in ((1, False, False), (1, True, False), (8, False, False), (8, True, False),
                                (1, False, True), (8, False, True)):  # taken: a mixed step's rows (ROWS)
        compile_one(window.paged_window_kernel, attention, ("scale", "softcap"),
                    dict(CACHE_BLOCK=16, **gemma, BLOCK_N=64, USE_SOFTCAP=False, FP32_DOT=False, SPLITS=splits,
                         HAS_SKIP=skip, HAS_ROWS=taken))
    for skip, taken in ((False, False), (True, False), (False, True)):
        compile_one(window.paged_window_combine_kernel, attention, (),
                    dict(**gemma, SPLITS=8, HAS_SKIP=skip, HAS_ROWS=taken))
    for taken in (False, True):  # the launcher's tile at Gemma's head size: 32 rows x 4 heads, 8 warps
        compile_one(window.paged_window_tiled_kernel, attention, ("scale", "softcap"),
                    dict(CACHE_BLOCK=16, GROUP=4, BLOCK_G=4, BLOCK_M=32, HEAD_DIM=256, BLOCK_D=256, BLOCK_N=32,
                         USE_SOFTCAP=False, FP32_DOT=False, HAS_ROWS=taken))
""")


def _has_nvidia_backend() -> bool:
    try:
        import triton
    except ImportError:
        return False
    backend = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia")
    return os.path.isdir(backend) and any(name.startswith("ptxas") for _, _, files in os.walk(backend)
                                          for name in files)


@pytest.mark.skipif(not _has_nvidia_backend(), reason="Triton without its NVIDIA backend or ptxas")
def test_the_changed_kernels_compile_for_sm90(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    # run in tmp_path: the repository root off sys.path, so that `uniprefill` is the installed package (with its
    # `kernels`), not the source tree
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("compiled") == 2 + 3 + 6 + 3 + 2, result.stdout
