"""scripts/gpu/vllm/compare_engines.py: two engines' parity outputs compared token for token and, where
both recorded logprobs, the first position where their numbers part (0: the prefill's output)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "compare_engines.py"
spec = importlib.util.spec_from_file_location("compare_engines", SCRIPT)
compare_engines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_engines)


def run(tokens, logprobs=None) -> dict:
    parity = {"prompt_lengths": [10 * (i + 1) for i in range(len(tokens))], "output_token_ids": tokens}
    if logprobs is not None:
        parity["output_logprobs"] = logprobs
    return {"parity": parity}


def test_tokens_and_the_first_position_where_logprobs_part(tmp_path):
    a = run([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]], [[-.5, -.1, -.2], [-.3, -.3, -.3], [-.1, -.2, -.3], [0., 0., 0.]])
    b = run([[1, 2, 3], [4, 5, 7], [7, 8, 9], [2, 1, 1]], [[-.5, -.1, -.2], [-.3, -.4, -.3], [-.15, -.2, -.3], [0., 0., 0.]])
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert compare_engines.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "c.json")]) == 0
    parity = json.loads((tmp_path / "c.json").read_text())["parity"]
    assert parity["identical"] == 2 and [d["prompt"] for d in parity["differ"]] == [1, 3]
    assert [d["first_different_token"] for d in parity["differ"]] == [2, 0]
    lp = parity["logprobs"]
    # prompt 0 equal everywhere; prompt 1's logprob parts at 1 before its token at 2; prompt 2 at the
    # prefill although its tokens agree; prompt 3's first token differs
    assert lp["first_difference_at"] == {"0": 2, "1": 1, "equal": 1}
    assert lp["prefill_logprob_equal"] == 2  # of the three whose first token agrees
    assert abs(lp["prefill_logprob_abs_diff"]["max"] - 0.05) < 1e-9


def test_without_logprobs_only_tokens_are_compared():
    result = compare_engines.parity(run([[1, 2]]), run([[1, 2]]))
    assert result["identical"] == 1 and "logprobs" not in result


def test_throughput_points_pair_by_length_and_batch_with_the_time_outside_the_engines_span():
    def engine(span, before, after):
        return {"available": True, "span_s": span, "call_to_queued_s": before, "first_token_to_return_s": after}

    standard = {"throughput": {"points": [
        {"length": 8192, "batch": 1, "tokens_per_s": 100.0, "engine": engine(0.05, 0.01, 0.04)},
        {"length": 8192, "batch": 4, "tokens_per_s": 300.0, "engine": {"available": False}}]}}
    other = {"throughput": {"points": [
        {"length": 8192, "batch": 4, "tokens_per_s": 150.0, "engine": {"available": False}},
        {"length": 8192, "batch": 1, "tokens_per_s": 125.0, "engine": engine(0.04, 0.02, 0.06)},
        {"length": 16384, "batch": 1, "tokens_per_s": 90.0}]}}  # no standard point: left out
    rows = compare_engines.throughput(standard, other)
    assert [(r["length"], r["batch"], r["ratio"]) for r in rows] == [(8192, 4, 0.5), (8192, 1, 1.25)]
    assert "engine_span_ratio" not in rows[0]
    assert rows[1]["engine_span_ratio"] == 1.25
    assert rows[1]["call_to_queued_s"] == [0.01, 0.02] and rows[1]["first_token_to_return_s"] == [0.04, 0.06]


def test_throughput_rows_carry_the_fastest_calls_ratio_and_each_engines_spread(tmp_path):
    standard = {"throughput": {"points": [{"length": 8192, "batch": 1, "tokens_per_s": 100.0,
                                           "seconds_each": [0.2, 0.1, 0.15]}]}}
    other = {"throughput": {"points": [{"length": 8192, "batch": 1, "tokens_per_s": 120.0,
                                        "seconds_each": [0.08, 0.16, 0.1]}]}}
    row = compare_engines.throughput(standard, other)[0]
    assert row["ratio_fastest"] == 1.25  # 0.1 s against 0.08 s
    assert row["calls_spread"] == [2.0, 2.0]
    # a gzipped run is read as it is
    import gzip
    (tmp_path / "s.json.gz").write_bytes(gzip.compress(json.dumps(standard).encode()))
    (tmp_path / "o.json").write_text(json.dumps(other))
    assert compare_engines.main([str(tmp_path / "s.json.gz"), str(tmp_path / "o.json"), "--out", str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["throughput"][0]["ratio_fastest"] == 1.25
