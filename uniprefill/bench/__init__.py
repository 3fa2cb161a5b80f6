"""Prefill benchmarks: TTFT sweeps, the analytic FLOP model, and the demo.

Modules (import them explicitly; this package imports nothing):
    ttft: `sweep` over lengths, batch sizes and configs; `plot_sweep`; `analytic_speedup`.
    flops: `prefill_flops`, `flop_ratio` (the ideal speedup from retention per drop point).
    timing: `measure` (warm-up, repeats, device sync, CUDA events, peak memory).
    models: `load_model` from the default model, a preset name or a local folder.
    environment: versions, device, git commit and date recorded with every result.
    demo: the `uniprefill demo` run.
"""
