"""TTFT measurement, the sweep, and the analytic FLOP model."""

import json

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Qwen3NextConfig

from uniprefill.measure.flops import flop_ratio, prefill_flops
from uniprefill.measure.timing import TimingStats, measure
from uniprefill.bench.ttft import (
    SweepPlan,
    analytic_speedup,
    format_results,
    make_inputs,
    plot_sweep,
    sweep,
)
from uniprefill.config import UniPrefillConfig
from uniprefill.eval.systems import uniprefill_api
from uniprefill.eval.toy import build_toy_llama


def _tiny_llama(**kw):
    return LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                       intermediate_size=16, num_hidden_layers=2, vocab_size=10, **kw)


def test_prefill_flops_by_hand():
    config = _tiny_llama()
    # per layer: projections 2*N*256, attention 4*(N^2/2)*H*hd, MLP 2*N*3*d*I; LM head 2*d*V
    assert prefill_flops(config, 100) == 2 * (51200 + 160000 + 76800) + 160
    # drop at layer 0 keeping half: scoring 2*last_q*N*H*hd, then MLP and layer 1 on 50 tokens
    dropped = prefill_flops(config, 100, [0.5], [0], last_q=10)
    assert dropped == 16000 + 211200 + 38400 + (25600 + 40000) + 38400 + 160


def test_flop_ratio_behaviour():
    llama = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    layers = [7, 11, 15, 19, 23, 27]
    keep_all = flop_ratio(llama, 131072, 1.0, layers)
    assert 0.99 < keep_all < 1.0  # only the scoring costs extra
    ratios = [flop_ratio(llama, 131072, r, layers) for r in (0.9, 0.5, 0.2)]
    assert ratios == sorted(ratios) and 2.0 < ratios[1] < 6.0
    # Suspend lets every token re-enter each drop layer: less saved than cumulative.
    assert flop_ratio(llama, 131072, 0.5, layers, policy="suspend") < ratios[1]
    # Longer contexts gain more (attention is quadratic).
    assert flop_ratio(llama, 8192, 0.5, layers) < ratios[1]


def test_sliding_window_counts_as_masked_full_attention():
    kw = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
              intermediate_size=16, vocab_size=10, sliding_window=16, num_hidden_layers=1)
    full = Gemma3TextConfig(layer_types=["full_attention"], **kw)
    sliding = Gemma3TextConfig(layer_types=["sliding_attention"], **kw)
    n = 1000
    pair_term = 4 * (n * n / 2) * 2 * 4
    assert prefill_flops(sliding, n) - prefill_flops(full, n) == pytest.approx(pair_term)


def test_linear_attention_and_moe_are_linear_in_length():
    config = Qwen3NextConfig(
        hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention"] * 2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, vocab_size=50)
    head = 2 * 32 * 50
    twice = 2 * (prefill_flops(config, 1000) - head)
    assert prefill_flops(config, 2000) - head == pytest.approx(twice)


def test_flop_model_validates():
    config = _tiny_llama()
    with pytest.raises(ValueError, match="retention values"):
        prefill_flops(config, 100, [0.5, 0.5], [0])
    with pytest.raises(ValueError, match="policy"):
        prefill_flops(config, 100, [0.5], [0], policy="nope")
    gemma = Gemma3TextConfig(num_hidden_layers=6, hidden_size=8, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=4, intermediate_size=16)
    with pytest.raises(ValueError, match="not a full-attention layer"):
        prefill_flops(gemma, 100, [0.5], [0])  # layer 0 of Gemma-3 is sliding


def test_measure_and_stats():
    calls = []
    stats, out = measure(lambda: calls.append(1) or len(calls), torch.device("cpu"),
                         warmup=2, repeats=5)
    assert len(calls) == 7 and out == 7 and len(stats.times_s) == 5
    assert stats.min_s <= stats.q1_s <= stats.median_s <= stats.q3_s <= stats.max_s
    assert stats.peak_memory_bytes is None
    assert TimingStats.of([3.0, 1.0, 2.0], None).median_s == 2.0
    with pytest.raises(ValueError):
        measure(lambda: None, torch.device("cpu"), repeats=0)


def test_analytic_speedup_from_a_report():
    config = _tiny_llama()
    report = {"drop_points": [{"layer": 0, "entering": [100, 100], "kept": [50, 100],
                               "retention": 0.75}]}
    expected = 2 * prefill_flops(config, 100) / (
        prefill_flops(config, 100, [0.5], [0]) + prefill_flops(config, 100, [1.0], [0]))
    assert analytic_speedup(config, report, [100, 100], "cumulative", 128) == expected
    assert analytic_speedup(config, None, [100], "cumulative", 128) is None


def test_sweep_plan_validates():
    with pytest.raises(ValueError, match="baseline"):
        SweepPlan(lengths=(128,), baseline="fast")
    with pytest.raises(ValueError, match="lengths"):
        SweepPlan(lengths=())


def test_sweep_on_a_tiny_model(tmp_path):
    model = build_toy_llama(256)
    configs = ()
    try:
        uniprefill_api()
        configs = (UniPrefillConfig(p=0.9, block_size=16, last_q=32, sink=32),)
    except RuntimeError:
        pass  # uniprefill.compile not there yet: baselines only
    plan = SweepPlan(lengths=(320,), batch_sizes=(1, 2), configs=configs,
                     baseline="both", warmup=1, repeats=2)
    results = sweep(model, plan, model_name="toy", compile_backend="eager", progress=False)
    assert len(results) == 2 * (2 + len(configs))
    for point in {(r["length"], r["batch"]) for r in results}:
        rows = [r for r in results if (r["length"], r["batch"]) == point]
        best = min(r["ttft"]["median_s"] for r in rows if r["role"] == "baseline")
        assert max(r["speedup"] for r in rows if r["role"] == "baseline") == 1.0
        assert all(r["baseline_ms"] == pytest.approx(1000 * best) for r in rows)
    for r in results:
        if r["role"] == "method":
            assert r["analytic_ideal_speedup"] is not None and r["overall_retention"] <= 1
    assert "baseline-compiled" in format_results(results)
    plot_sweep(results, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_random_inputs_are_seeded():
    a = make_inputs("random", 64, 2, vocab_size=100, device="cpu", seed=1)
    b = make_inputs("random", 64, 2, vocab_size=100, device="cpu", seed=1)
    assert torch.equal(a[0], b[0]) and a[0].shape == (2, 64) and bool(a[1].all())


def test_decode_benchmark_on_a_tiny_preset(tmp_path):
    """benchmarks/bench_decode.py end to end, run as a user runs it: the compacted cache is
    smaller, decode runs."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode.py"
    out = tmp_path / "decode.json"
    done = subprocess.run([sys.executable, "-P", str(script), "--model", "tiny-llama", "--device", "cpu", "--length",
                           "600", "--new-tokens", "3", "--keep-ratio", "0.4", "--drop-layers", "all", "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    base, fast = record["results"]
    assert base["system"] == "baseline" and len(base["tokens"]) == 4 == len(fast["tokens"])
    assert fast["history"]["drop_points"] and fast["kv_cache_bytes"] < base["kv_cache_bytes"]
    assert fast["kv_cache_ratio"] == fast["kv_cache_bytes"] / base["kv_cache_bytes"]
    assert record["prompt_tokens"] == 600 and fast["decode_tokens_per_s"] > 0


def test_git_commit_falls_back_to_the_environment(monkeypatch, tmp_path):
    """A copy without .git (the GPU box) names its commit through UNIPREFILL_GIT_COMMIT."""
    import subprocess

    from uniprefill.measure import environment

    def no_repo(*args, **kwargs):
        return subprocess.CompletedProcess(args, 128, "", "not a git repository")

    monkeypatch.setattr(environment.subprocess, "run", no_repo)
    monkeypatch.delenv("UNIPREFILL_GIT_COMMIT", raising=False)
    assert environment.git_commit() is None
    monkeypatch.setenv("UNIPREFILL_GIT_COMMIT", "abc123")
    assert environment.git_commit() == "abc123"


def test_compare_systems_pairs_prompts_both_ran(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    rows = [("A", 0, 1.0), ("A", 1, 1.0), ("A", 2, 0.0), ("B", 0, 0.0), ("B", 1, 1.0), ("B", 3, 1.0)]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"system_label": s, "length": 4096, "task": "vt", "index": i, "score": v}) + "\n"
                            for s, i, v in rows))
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_systems.py"
    out = subprocess.run([sys.executable, "-P", str(script), str(path), "A", "B"], capture_output=True, text=True,
                         check=True).stdout
    # prompts 0 and 1 are paired (2 only A, 3 only B): A 100, B 50, B - A = -50
    assert "n=  2  A 100.0  B  50.0  B-A  -50.0" in out, out


def test_presets_table_reads_what_bench_writes(tmp_path):
    """benchmarks/presets_table.py, run as a user runs it, on a real (tiny, CPU) `uniprefill bench
    --keep-ratio` run."""
    import subprocess
    import sys
    from pathlib import Path

    from uniprefill.cli import main as cli

    out = tmp_path / "bench-tiny-llama-512.json"
    assert cli(["bench", "--model", "tiny-llama", "--device", "cpu", "--lengths", "512", "--keep-ratio", "0.5,0.25",
                "--drop-layers", "0", "--measured-ideal", "--warmup", "0", "--repeats", "1", "--inputs", "random",
                "--quiet", "--out", str(out)]) == 0
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "presets_table.py"

    def table(*args):
        return subprocess.run([sys.executable, "-P", str(script), *map(str, args)], capture_output=True, text=True)

    done = table(tmp_path, "--plot", tmp_path / "p.png")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny-llama |")]
    assert len(rows) == 2 and rows[0].startswith("| tiny-llama | 0K | 0.5 |") and "| 0.25 |" in rows[1]
    methods = [r for r in json.loads(out.read_text())["results"] if r["role"] == "method"]
    for row, keep in zip(rows, (0.5, 0.25)):  # each row shows its own run's speedup and measured ideal
        result = next(r for r in methods if r["config"]["keep_ratio"][0] == keep)
        assert f"**{result['speedup']:.2f}x**" in row and result["ideal_speedup"] > 0, (row, result)
    assert (tmp_path / "p.png").stat().st_size > 1000
    done = table(tmp_path / "empty")
    assert done.returncode != 0 and "no bench" in done.stderr