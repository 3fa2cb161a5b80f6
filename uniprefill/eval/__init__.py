"""Accuracy evaluation: RULER-style synthetic tasks, scoring, and a resumable runner.

Modules (import them explicitly; this package imports nothing):
    tasks: task generators (`make_sample`, `generate_samples`, `TASK_NAMES`).
    haystack: noise and essay haystacks, needle keys, word pools.
    scoring: `string_match_all`, `string_match_part`, `TASK_METRICS`, `paired_bootstrap_ci`.
    systems: the baseline and uniprefill systems (`SystemSpec`, `System`).
    runner: `run_eval` over (system, task, length, sample), JSON lines, resume, shards.
    summary: per task/length/system tables, CIs vs baseline, the Pareto plot.
    toy: an offline BPE tokenizer and a tiny random Llama, for smoke tests.
"""
