"""UniPrefillConfig validation, the lean import, and the `kernels` name hazard."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from uniprefill import UniPrefillConfig

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_stable_hash():
    cfg = UniPrefillConfig()
    assert (cfg.p, cfg.selection, cfg.drop_layers) == (0.95, "content", "auto")
    assert (cfg.block_size, cfg.last_q, cfg.sink, cfg.policy) == (64, 128, 128, "cumulative")
    assert cfg.stable_hash() == UniPrefillConfig().stable_hash()
    assert cfg.stable_hash() != UniPrefillConfig(p=0.9).stable_hash()
    assert UniPrefillConfig(min_tokens=10).effective_min_tokens == 256
    # fields added later enter the digest only when set: eval records keyed by it stay valid
    assert UniPrefillConfig(p=0.9, drop_layers=(5, 11), selection="paper").stable_hash() == "2c5a428df294363f"
    assert UniPrefillConfig(selection="paper").stable_hash() != cfg.stable_hash()
    # "auto" names a rule that changed (AUTO_RULE): its configs must not share a digest with the
    # records of the old rule (the old defaults' digest was 8e637cb7ee37b128)
    assert UniPrefillConfig(p=0.99, selection="paper").stable_hash() != "8e637cb7ee37b128"
    # keep_ratio replaces top-p: an unset selection is then "paper", and the digest is as before
    assert UniPrefillConfig(keep_ratio=0.5).selection == "paper"


@pytest.mark.parametrize("bad, match", [
    ({"p": 0.0}, r"p=0.0 is outside \(0.0, 1.0\]"),
    ({"p": 1.5}, "outside"),
    ({"p": float("nan")}, "must be a number"),
    ({"block_size": 0}, "block_size=0 must be >= 1"),
    ({"last_q": 2.5}, "must be an integer"),
    ({"sink": -1}, ">= 0"),
    ({"policy": "keep"}, "policy='keep'"),
    ({"selection": "topk"}, "selection='topk' is not one of"),
    ({"selection": "content", "keep_ratio": 0.5}, "keep_ratio=.* replaces top-p"),
    ({"impl": "cuda"}, "impl='cuda'"),
    ({"drop_layers": "some"}, "drop_layers"),
    ({"drop_layers": [3, 3]}, "repeats"),
    ({"drop_layers": []}, "names no layer"),
    ({"keep_ratio": 0.0}, "keep_ratio"),
    ({"keep_ratio": [0.5, 2.0]}, "keep_ratio"),
    ({"strict": 1}, "True or False"),
])
def test_bad_values_raise_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        UniPrefillConfig(**bad)


def test_options_reject_unknown_keys():
    assert UniPrefillConfig.from_options({"p": 0.5}).p == 0.5
    with pytest.raises(ValueError, match="unknown uniprefill option"):
        UniPrefillConfig.from_options({"top_p": 0.5})


def test_keep_ratio_per_drop_point():
    cfg = UniPrefillConfig(keep_ratio=[0.5, 0.3])
    assert cfg.keep_ratio_at(1, 2) == 0.3
    with pytest.raises(ValueError, match="one per drop point"):
        cfg.keep_ratio_at(0, 3)
    assert UniPrefillConfig(keep_ratio=0.4).keep_ratio_at(2, 3) == 0.4


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_import_is_lean():
    code = (
        "import sys, uniprefill, torch\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "print('lean')"
    )
    result = _python(code, ROOT)
    assert result.returncode == 0 and "lean" in result.stdout, result.stderr


def test_eval_does_not_import_bench(tmp_path):
    """The measurement helpers sit below both packages: eval never imports bench (no cycle)."""
    code = (
        "import sys, uniprefill.eval.runner, uniprefill.eval.systems, uniprefill.eval.ideal, uniprefill.eval.summary\n"
        "import uniprefill.eval.tasks, uniprefill.measure.flops, uniprefill.measure.sdpa\n"
        "bench = sorted(m for m in sys.modules if m.startswith('uniprefill.bench'))\n"
        "assert not bench, bench\n"
        "print('no cycle')"
    )
    result = _python(code, tmp_path)
    assert result.returncode == 0 and "no cycle" in result.stdout, result.stderr[-2000:]


def _hf_kernels_installed() -> bool:
    import importlib.metadata as md

    try:
        md.version("kernels")
        return True
    except md.PackageNotFoundError:
        return False


def test_kernels_folder_does_not_shadow_the_hub_kernels_package():
    """`python -c` from the repository root puts the root on sys.path, so `kernels/` is importable
    there as a top-level module. transformers (>= 5.25 depends on the Hugging Face `kernels` package
    and imports it from its model code) must get the real package, or none where it is not
    installed; uniprefill's kernels stay `uniprefill.kernels`."""
    code = (
        "import importlib.util, importlib.metadata as md\n"
        "assert importlib.util.find_spec('kernels') is not None\n"
        "from transformers.utils import import_utils\n"
        "try:\n    md.version('kernels'); installed = True\n"
        "except md.PackageNotFoundError:\n    installed = False\n"
        "assert import_utils.is_kernels_available() == installed, 'our folder changed transformers probe'\n"
        "import kernels\n"
        "assert (kernels.__file__ or '').startswith(__import__('os').getcwd()) != installed, kernels.__file__\n"
        "from transformers import LlamaForCausalLM\n"  # imports transformers' hub-kernel integration
        "import uniprefill.kernels.api\n"
        "assert uniprefill.kernels.__name__ == 'uniprefill.kernels'\n"
        "print('ok')"
    )
    result = _python(code, ROOT)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_transformers_kernels_probe_in_this_test_process_follows_the_installed_package():
    """However pytest was started (`pytest` or `python -m pytest`, which puts the root on
    sys.path), transformers sees the hub's `kernels` package exactly when it is installed."""
    from transformers.utils import import_utils

    assert import_utils.is_kernels_available() == _hf_kernels_installed()


def test_import_registers_the_backend_name_without_the_entry_point(tmp_path):
    """A source checkout on PYTHONPATH (no installed entry point): `import uniprefill` is enough
    for torch.compile(..., backend="uniprefill")."""
    code = (
        "import importlib.metadata as md\n"
        "real = md.entry_points\n"
        "md.entry_points = lambda **kw: [] if kw.get('group') == 'torch_dynamo_backends' else real(**kw)\n"
        "import uniprefill\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "assert lookup_backend('uniprefill') is uniprefill.uniprefill_backend\n"
        "print('registered')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "registered" in result.stdout, result.stderr


def test_the_test_folders_do_not_shadow_vllm():
    """tests/vllm must not import as a namespace package named `vllm` (pytest's pythonpath): code that
    asks whether vLLM is installed would then be told yes."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    locations = [str(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    assert spec is None or spec.origin is not None, f"vllm resolves to a namespace package: {locations}"


def test_every_package_directory_is_listed_in_pyproject():
    """setuptools installs the packages `pyproject.toml` lists, nothing else: a new subpackage left out works in an
    editable install (and so in these tests) but is missing from the wheel (the GPU box installs the wheel)."""
    import tomllib

    root = ROOT
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for top, name in (("uniprefill", "uniprefill"), ("kernels", "uniprefill.kernels")):
        assert config["package-dir"].get(name, top) == top
        for init in (root / top).rglob("__init__.py"):
            parts = init.parent.relative_to(root / top).parts
            found.add(".".join((name, *parts)))
    assert found == listed, {"not listed": sorted(found - listed), "listed, no directory": sorted(listed - found)}
