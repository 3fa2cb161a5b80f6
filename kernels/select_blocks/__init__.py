"""Block selection: per sequence, the smallest set of blocks holding a share p of the score
(or a forced keep ratio), plus the sink and window blocks.

`reference.py` is the definition in PyTorch; `kernel.py` the Triton kernel (one sort per
sequence). `uniprefill.kernels.api.select_blocks` validates the inputs and picks one; the
settings are one `uniprefill.kernels.rule.SelectionRule`. Importing this package imports nothing.
"""
