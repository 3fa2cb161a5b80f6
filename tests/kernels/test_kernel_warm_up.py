"""kernels/warm_up.py: the pre-serving warm-up runs every variant it promises, in each
selection mode, and leaves nothing behind (TRITON_INTERPRET=1 on CPU: no compiles to see
here; the compile counts it removes are measured on the GPU, docs/benchmarks.md)."""
from __future__ import annotations

import pytest
import torch

from uniprefill.kernels import api
from uniprefill.kernels.warm_up import SEQUENCE_COUNTS, selection_modes, warm_up_score_and_select

ON_CPU = pytest.mark.interpreter  # a case that runs Triton on CPU tensors (tests/conftest.py)

TINY = dict(num_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.float32, device="cpu", block_size=16,
            sink=16, last_q=16, min_tokens=64, max_seqlen=256)


def test_selection_modes_follow_the_config():
    assert selection_modes(0.9, None, per_sequence_p=True) == [("one", None), ("per_sequence", None)]
    assert selection_modes(0.9, None, per_sequence_p=False) == [("one", None)]
    assert selection_modes(0.9, 0.3, per_sequence_p=True) == [("one", 0.3)]  # a forced ratio ignores p


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=ON_CPU)])
def test_warm_up_runs_each_sequence_count_length_parity_and_sort_size(impl, monkeypatch):
    seen_scored, seen_selected = [], []
    real_score, real_select = api.score_and_select, api.select_blocks

    def spy_score(q, k, cu_q, cu_k, max_seqlen_k, rule, **kw):
        total = kw["host_cu_seqlens"][1][-1]  # every key of the step
        seen_scored.append((cu_k.shape[0] - 1, total, rule.per_sequence_p, rule.keep_ratio))
        return real_score(q, k, cu_q, cu_k, max_seqlen_k, rule, **kw)

    def spy_select(scores, cu_blocks, cu_k, rule, **kw):
        seen_selected.append((cu_k.shape[0] - 1, kw["max_seqlen_k"], rule.per_sequence_p))
        return real_select(scores, cu_blocks, cu_k, rule, **kw)

    monkeypatch.setattr("uniprefill.kernels.warm_up.score_and_select", spy_score)
    monkeypatch.setattr("uniprefill.kernels.warm_up.select_blocks", spy_select)
    ran = warm_up_score_and_select(**TINY, impl=impl)
    assert ran.score_and_select_calls == len(seen_scored) == 3 * 2 * 2
    assert {(b, n % 16 == 0, per_seq) for b, n, per_seq, _ in seen_scored} == {
        (b, even, per_seq) for b in SEQUENCE_COUNTS for even in (True, False) for per_seq in (True, False)}
    # sort sizes 1..16 blocks (256 tokens / 16), for 1 and 2 sequences, both p kinds
    assert ran.select_calls == len(seen_selected) == 2 * 5 * 2
    assert sorted({n // 16 for _, n, _ in seen_selected}) == [1, 2, 4, 8, 16]

    seen_scored.clear()
    forced = warm_up_score_and_select(**TINY, keep_ratio=0.3, impl=impl)
    assert forced.score_and_select_calls == 6 and {r for *_, r in seen_scored} == {0.3}


def test_warm_up_stops_at_the_select_kernels_limit(monkeypatch):
    monkeypatch.setattr("uniprefill.kernels.select_blocks.kernel.MAX_BLOCKS_PER_SEQUENCE", 4)
    ran = warm_up_score_and_select(**{**TINY, "max_seqlen": 10_000}, per_sequence_p=False, impl="torch")
    assert ran.select_calls == 2 * 3  # 1, 2, 4 blocks: never a size the kernel refuses


def test_warm_up_with_per_sequence_sinks_runs_that_variant_only(monkeypatch):
    """The vLLM runtime passes one sink count per request (a tensor) in every call: its warm-up runs every call with
    a sink tensor of the batch's length holding the config's sink, never the one-number variant it does not use."""
    sinks = []
    real_score, real_select = api.score_and_select, api.select_blocks

    def spy_score(q, k, cu_q, cu_k, max_seqlen_k, rule, **kw):
        sinks.append((rule.per_sequence_sink, rule.sinks(cu_k.shape[0] - 1)))
        return real_score(q, k, cu_q, cu_k, max_seqlen_k, rule, **kw)

    def spy_select(scores, cu_blocks, cu_k, rule, **kw):
        sinks.append((rule.per_sequence_sink, rule.sinks(cu_k.shape[0] - 1)))
        return real_select(scores, cu_blocks, cu_k, rule, **kw)

    monkeypatch.setattr("uniprefill.kernels.warm_up.score_and_select", spy_score)
    monkeypatch.setattr("uniprefill.kernels.warm_up.select_blocks", spy_select)
    ran = warm_up_score_and_select(**TINY, impl="torch", per_sequence_sink=True)
    assert len(sinks) == ran.score_and_select_calls + ran.select_calls == 12 + 20
    assert all(tensor and set(values) == {TINY["sink"]} for tensor, values in sinks)
