"""Measurement helpers shared by `uniprefill.bench` and `uniprefill.eval` (below both of them).

Modules (import them explicitly; this package imports nothing):
    timing: `measure` (warm-up, repeats, device sync, CUDA events, peak memory).
    environment: versions, device, git commit and date recorded with every result.
    flops: `prefill_flops`, `flop_ratio` (the ideal speedup from retention per drop point).
    sdpa: the SDPA kernels that decode steps use (`for_decode_steps`).
    attention_mass: where the last queries' attention goes per full layer (`benchmarks/attention_mass.py`).
"""
