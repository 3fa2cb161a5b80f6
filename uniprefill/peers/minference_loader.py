"""Load the peers' modules from the installed `minference` package without running its `__init__`.

`import minference` fails on transformers 5.x (its optional-import checks now return tuples,
which are always true, so it imports vLLM and CUDA-only pieces at import time), and its own
model patch expects transformers 4's decoder layers. The kernels we need live in modules
that import nothing of that: `minference.modules.flexprefill`, `minference.modules.xattention`
(+ `ops.xattention_fa`) and `minference.ops.pit_sparse_flash_attention_v2` (MInference's
vertical-and-slash kernel, whose index builder is the package's one CUDA source). This module
loads them under a private package name (`_uniprefill_minference`), so the relative imports
between them resolve and a real `import minference` elsewhere is left alone.

MInference's CUDA index builder (`minference.cuda`) is compiled on first use with
`torch.utils.cpp_extension.load` from the sources the sdist ships (`csrc/`), if present, or
taken from a `minference.cuda` built by the package's own installer.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

PRIVATE = "_uniprefill_minference"
INSTALL_HINT = ("pip install 'uniprefill[peers]' (minference==0.1.6.0, built without its CUDA "
                "extension: MINFERENCE_SKIP_CUDA_BUILD=TRUE)")


class PeerUnavailable(RuntimeError):
    """A peer's code or kernel cannot run here; the message says why and what to install."""


def package_dir() -> str:
    spec = importlib.util.find_spec("minference")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable(f"the peers need the minference package: {INSTALL_HINT}")
    return list(spec.submodule_search_locations)[0]


def _private_package() -> types.ModuleType:
    package = sys.modules.get(PRIVATE)
    if package is None:
        package = types.ModuleType(PRIVATE)
        package.__path__ = [package_dir()]
        package.__package__ = PRIVATE
        sys.modules[PRIVATE] = package
    return package


def load(submodule: str) -> types.ModuleType:
    """`minference.<submodule>` (e.g. "modules.flexprefill"), loaded under the private name."""
    _private_package()
    if submodule == "ops.pit_sparse_flash_attention_v2":
        _ensure_cuda_index_builder()
    try:
        return importlib.import_module(f"{PRIVATE}.{submodule}")
    except ImportError as err:
        raise PeerUnavailable(f"minference.{submodule} does not import here ({err}); {INSTALL_HINT}") from err


def _ensure_cuda_index_builder() -> None:
    """`<private>.cuda`: MInference's vertical/slash index builder, compiled if needed."""
    name = f"{PRIVATE}.cuda"
    if name in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        raise PeerUnavailable("MInference's vertical-and-slash kernel needs CUDA (its index builder "
                              "is a CUDA extension)")
    try:  # built by minference's own installer
        module = importlib.import_module("minference.cuda")
    except ImportError:
        module = _compile_index_builder()
    sys.modules[name] = module


def _compile_index_builder():
    from torch.utils.cpp_extension import load as load_extension

    sources = _csrc_sources()
    from uniprefill.env import cache_dir

    build = str(cache_dir() / "minference_cuda")
    os.makedirs(build, exist_ok=True)
    try:
        return load_extension(name="uniprefill_minference_cuda", sources=sources,
                              build_directory=build, verbose=False)
    except Exception as err:  # noqa: BLE001 - a compiler error is reported, not swallowed
        raise PeerUnavailable(f"compiling MInference's CUDA index builder from {sources} failed: "
                              f"{type(err).__name__}: {err}") from err


def _csrc_sources() -> list[str]:
    """The sdist's `csrc/kernels.cpp` and `csrc/vertical_slash_index.cu`.

    An installed wheel does not carry them; `UNIPREFILL_MINFERENCE_CSRC` (`uniprefill.env`)
    names the unpacked sdist's csrc folder then.
    """
    from uniprefill.env import minference_csrc

    candidates = [minference_csrc(), os.path.join(os.path.dirname(package_dir()), "csrc")]
    for folder in filter(None, candidates):
        files = [os.path.join(folder, f) for f in ("kernels.cpp", "vertical_slash_index.cu")]
        if all(os.path.isfile(f) for f in files):
            return files
    raise PeerUnavailable("MInference's CUDA sources (csrc/kernels.cpp, csrc/vertical_slash_index.cu) "
                          "are not installed with the wheel: unpack the minference sdist and set "
                          "UNIPREFILL_MINFERENCE_CSRC to its csrc folder")
