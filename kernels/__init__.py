"""Score-and-select kernels (installed as `uniprefill.kernels`). Import the submodules
(`uniprefill.kernels.api`, ...) explicitly.

The top-level name `kernels` belongs to the Hugging Face `kernels` package (a dependency of
transformers >= 5.25, which imports it from its model code). Where the repository root is on
`sys.path` (`python -c` or `python -m pytest` in a checkout) this folder would shadow it, and
transformers would fail with `ImportError: cannot import name ... from 'kernels'`. So when this file
runs under the name `kernels`, it loads the real package from the rest of `sys.path` in its place
(the import system hands out `sys.modules["kernels"]`, which it replaces); with no such package it
stays an empty module, as before. Under `uniprefill.kernels` nothing happens here.
"""

if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
