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


def test_launch_configs_of_the_same_body_are_compared_whatever_the_decorator(tmp_path, capsys):
    """Two engines compile one reduction under other size hints, one of them with a benchmark harness after it
    (its own file): other sources, the same arithmetic; their launch configs are compared (a set per body)."""
    harness = "\n\ndef get_args():\n    return 1,\n\n\ndef call(args):\n    pass\n"

    def engine(path: Path, hint: int, name: str, configs: list[dict], extra: str = "") -> Path:
        kernel = (f"@triton_heuristics.reduction(\n    size_hints={{'x': {hint}, 'r0_': 256}},\n)\n@triton.jit\n"
                  f"def {name}(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):\n"
                  "    tmp4 = tl.sum(_tmp4, 1)[:, None]\n")
        with tarfile.open(path, "w:gz") as tar:
            for index, config in enumerate(configs):
                for member, data in ((f"./f{index}/c{index}.py", kernel + extra),
                                     (f"./f{index}/{index:064x}.best_config", json.dumps(config))):
                    info = tarfile.TarInfo(member)
                    info.size = len(data.encode())
                    tar.addfile(info, io.BytesIO(data.encode()))
        return path

    tuned = {"XBLOCK": 64, "R0_BLOCK": 64, "num_warps": 16, "num_stages": 1}
    a = engine(tmp_path / "a.tar.gz", 65536, "triton_red_fused_1", [tuned], harness)
    b = engine(tmp_path / "b.tar.gz", 32768, "triton_red_fused_3", [{**tuned, "R0_BLOCK": 4, "num_warps": 8},
                                                                     {**tuned, "time_taken_ms": 5}])
    (body_a, (name_a, configs_a)), = diff_kernels.launch_configs_by_body(a).items()
    (body_b, (_, configs_b)), = diff_kernels.launch_configs_by_body(b).items()
    assert body_a == body_b and "get_args" not in body_a and name_a == "triton_red_fused_1"
    assert configs_a == [tuned] and len(configs_b) == 2  # the timing is not the config: one copy of `tuned`
    diff_kernels.main([str(a), str(b), "--show", "1"])
    out = capsys.readouterr().out
    assert "only in the first 1, only in the second 1" in out  # other sources: the decorators differ
    assert "same body: 1, 1 differ" in out and "'R0_BLOCK': 4" in out
    c = engine(tmp_path / "c.tar.gz", 16384, "triton_red_fused_1", [tuned, tuned])
    diff_kernels.main([str(a), str(c)])
    assert "same body: 1, 0 differ" in capsys.readouterr().out  # one config, whatever the pieces compiled
