"""Prefill benchmarks: TTFT sweeps, the analytic FLOP model, and the demo.

Modules (import them explicitly; this package imports nothing):
    ttft: `sweep` over lengths, batch sizes and configs; `plot_sweep`; `analytic_speedup`.
    models: `load_model` from the default model, a preset name or a local folder.
    demo: the `uniprefill demo` run.

Timing, environment records, the FLOP model and the decode SDPA choice live in
`uniprefill.measure`, which this package and `uniprefill.eval` both import (eval never imports
bench; bench imports eval's tasks, systems and runner).
"""
