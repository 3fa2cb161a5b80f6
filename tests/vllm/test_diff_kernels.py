"""scripts/gpu/vllm/diff_kernels.py on archives shaped like Inductor's output: kernels that differ only in
their names and symbols are the same kernel; a different size hint is a different kernel, shown in a diff."""
from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "diff_kernels.py"
spec = importlib.util.spec_from_file_location("diff_kernels", SCRIPT)
diff_kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diff_kernels)

MODULE = """
{name} = async_compile.triton('{name}', '''
import triton

@triton_heuristics.persistent_reduction(
    size_hints={{'x': {hint}, 'r0_': 1024}},
    inductor_meta={{'kernel_name': '{name}', 'backend_hash': '{digest}'}}
)
@triton.jit
def {name}(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    x0 = xindex  # rows {symbol}
    tmp0 = tl.sum(tl.load(in_ptr0 + x0), 1)
''', device_str='cuda')

triton_poi_fused_{pointwise}_1 = async_compile.triton('triton_poi_fused_{pointwise}_1', '''
@triton.jit
def triton_poi_fused_{pointwise}_1(in_ptr0, xnumel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + xindex) * 2
''', device_str='cuda')
"""


def archive(path: Path, **fields) -> Path:
    data = MODULE.format(**fields).encode()
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("./ab/cabc.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_names_and_symbols_do_not_count_a_size_hint_does(tmp_path, capsys):
    a = archive(tmp_path / "a.tar.gz", name="triton_per_fused_add_0", hint=16384, digest="a" * 64, symbol="s72",
                pointwise="mul")
    same = archive(tmp_path / "b.tar.gz", name="triton_per_fused_add_7", hint=16384, digest="b" * 64, symbol="s3",
                   pointwise="mul")
    assert diff_kernels.kernels(a) == diff_kernels.kernels(same) and len(diff_kernels.kernels(a)) == 2
    other = archive(tmp_path / "c.tar.gz", name="triton_per_fused_add_0", hint=8192, digest="a" * 64, symbol="u0",
                    pointwise="mul")
    assert diff_kernels.main([str(a), str(other), "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "shared 1; only in the first 1, only in the second 1" in out
    assert "-    size_hints={'x': 16384, 'r0_': 1024}," in out and "+    size_hints={'x': 8192, 'r0_': 1024}," in out


def test_launch_configs_of_the_same_kernel_are_compared(tmp_path, capsys):
    def with_configs(path: Path, configs: dict) -> Path:
        with tarfile.open(path, "w:gz") as tar:
            for stem, config in configs.items():
                data = json.dumps(config).encode()
                info = tarfile.TarInfo(f"./ab/{stem}.best_config")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path

    base = {"XBLOCK": 8, "R0_BLOCK": 1024, "num_warps": 4, "num_stages": 1}
    a = with_configs(tmp_path / "a.tar.gz", {"cabc": {**base, "time_taken_ms": 3}, "cdef": base, "conly": base})
    b = with_configs(tmp_path / "b.tar.gz", {"cabc": {**base, "time_taken_ms": 9}, "cdef": {**base, "num_warps": 8}})
    diff_kernels.main([str(a), str(b), "--show", "1"])
    out = capsys.readouterr().out
    assert "same source: 2, 1 differ" in out  # the timing is not the config; a kernel on one side only is not compared
    assert "cdef" in out and "'num_warps': 8" in out
