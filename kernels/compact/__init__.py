"""Compaction: block keep flags -> the packed indices of the kept tokens, in original order.

`reference.py` is the definition in PyTorch; `kernel.py` the Triton kernels (one host sync).
`uniprefill.kernels.api.compact_tokens` validates the inputs and picks one. Importing this
package imports nothing.
"""
