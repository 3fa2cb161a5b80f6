"""Score-and-select kernels (installed as `uniprefill.kernels`).

This file must stay import-free: transformers probes for a top-level module named
`kernels` and, when the repository root is on `sys.path`, may import this folder under
that name. Import the submodules (`uniprefill.kernels.api`, ...) explicitly.
"""
