"""scripts/gpu/vllm/serve_lib.sh's `system_args`: what each serve system adds to `vllm serve` (the GPU box's time is
too scarce to find a wrong flag there)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "serve_lib.sh"
SETTINGS = '{"p": 0.95, "vllm_drop": true}'


def system_args(system: str, tmp_path: Path, settings: str = SETTINGS) -> subprocess.CompletedProcess:
    """`system_args SYSTEM` in bash with serve_lib.sh sourced; `python3` is this interpreter (uniprefill importable)."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if not (bin_dir / "python3").exists():
        (bin_dir / "python3").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "SETTINGS": settings}
    script = f'source "{LIB}"; export PYTHONPATH="{os.environ.get("PYTHONPATH", "")}"; system_args "$1"'
    return subprocess.run(["bash", "-c", script, "bash", system], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("system, expected", [
    ("standard", []),
    ("standard-onestep", ["--max-num-batched-tokens", "33791"]),
    ("standard-onestep-split", ["--max-num-batched-tokens", "33791", "-cc", {"compile_ranges_endpoints": [8192]}]),
    ("uniprefill", ["-cc", {"inductor_compile_config": {"uniprefill": json.loads(SETTINGS)}}]),
    ("uniprefill-split", ["-cc", {"inductor_compile_config": {"uniprefill": json.loads(SETTINGS)},
                                  "compile_ranges_endpoints": [8192]}]),
    ("uniprefill-chunked", ["-cc", {"inductor_compile_config": {
        "uniprefill": {**json.loads(SETTINGS), "vllm_one_step_prefill": False}}}]),
])
def test_each_system_adds_its_flags(system, expected, tmp_path):
    done = system_args(system, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [json.loads(x) if x.startswith("{") else x for x in lines] == expected


def test_an_unknown_system_fails(tmp_path):
    done = system_args("standard-onestpe", tmp_path)
    assert done.returncode != 0 and "unknown system 'standard-onestpe'" in done.stderr and not done.stdout


def test_settings_over_several_lines_become_one_argument_and_bad_settings_fail(tmp_path):
    done = system_args("uniprefill", tmp_path, settings='{\n  "p": 0.95,\n  "vllm_drop": true\n}')
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["-cc", '{"inductor_compile_config": {"uniprefill": {"p": 0.95, "vllm_drop": true}}}']
    for bad in ('{"p": 0.95,', "[0.95]"):
        done = system_args("uniprefill-chunked", tmp_path, settings=bad)
        assert done.returncode != 0 and not done.stdout
    assert system_args("standard-onestep", tmp_path, settings="not json").returncode == 0  # no settings read
