"""Block scoring: the softmax attention each block of keys receives from the last queries.

`reference.py` is the definition in PyTorch; `kernel.py` the Triton kernels (two passes over
the keys, like a flash-attention forward without V). `uniprefill.kernels.api.score_blocks`
validates the inputs and picks one. Importing this package imports nothing (the kernels import
Triton, so `api` imports them only when they run).
"""
