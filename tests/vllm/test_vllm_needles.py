"""The measurement code behind the vLLM GPU scripts, on CPU: needle_parity.py's prompts are
`uniprefill eval`'s (`uniprefill.eval.paired`), its scoring and paired comparison; the engine
settings the scripts print with --dry-run (tensor parallelism, decode graphs, the channel's
environment); and `uniprefill.vllm.measure`, which reads drop totals and times throughput and
decode. The vLLM parts run on the GPU box only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from uniprefill import env
from uniprefill.eval import paired as needles
from uniprefill.eval.haystack import NOISE_SENTENCES
from uniprefill.eval.tasks import make_sample
from uniprefill.eval.toy import train_toy_tokenizer
from uniprefill.vllm import measure

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm"


def dry_run(script: str, *args: str) -> dict:
    """The engine settings a GPU script would give vLLM (its --dry-run, in a fresh process)."""
    done = subprocess.run([sys.executable, "-P", str(SCRIPTS / script), *args, "--dry-run"], capture_output=True,
                          text=True, env={k: v for k, v in os.environ.items() if not k.startswith("VLLM_")})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def tokenizer():
    return train_toy_tokenizer(list(NOISE_SENTENCES) * 4, vocab_size=400)


def test_prompts_are_the_evals_and_scoring_is_rulers(tokenizer):
    samples = needles.make_prompts(tokenizer, ["niah_single_1", "vt"], [900, 1200], 2, haystack=None, seed=3)
    assert [(s.task, s.length, s.index) for s in samples][:3] == [("niah_single_1", 900, 0), ("niah_single_1", 900, 1),
                                                                   ("vt", 900, 0)]
    again = make_sample("vt", tokenizer, 1200, 1, seed=3)
    assert samples[-1].prompt == again.prompt and samples[-1].answers == again.answers
    texts = [" ".join(s.answers) if i % 2 == 0 else "no idea" for i, s in enumerate(samples)]
    records = needles.score_records(samples, texts, "standard", {"engine_init_s": 1.0})
    assert [r["score"] for r in records] == [1.0, 0.0] * 4
    assert json.loads(json.dumps(records[0]))["engine_init_s"] == 1.0
    with pytest.raises(ValueError, match="outputs"):
        needles.score_records(samples, texts[:-1], "standard")


def test_compare_pairs_the_prompts_both_runs_answered():
    def rec(length, index, score, prediction="x"):
        return {"task": "niah_single_1", "length": length, "index": index, "seed": 0, "score": score,
                "prediction": prediction}

    base = [rec(8192, i, 1.0) for i in range(4)] + [rec(16384, 0, 0.0), rec(16384, 9, 1.0)]
    other = [rec(8192, i, 1.0 if i < 3 else 0.0, "x" if i < 3 else "y") for i in range(4)] + [rec(16384, 0, 1.0)]
    rows = {r["length"]: r for r in needles.compare(base, other, n_boot=200)}
    assert rows[8192]["n"] == 4 and rows[8192]["delta"] == pytest.approx(-25.0) and rows[8192]["same_prediction"] == 3
    assert rows[16384]["n"] == 1 and rows[16384]["delta"] == pytest.approx(100.0)  # index 9 is unpaired
    assert rows["all"]["n"] == 5 and rows["all"]["ci"][0] <= rows["all"]["delta"] <= rows["all"]["ci"][1]
    assert needles.compare(base, [], n_boot=10) == []


def test_engine_settings_keep_prompts_whole_and_pick_the_channel():
    run = ["run", "--model-dir", "/models/x", "--haystack", "essays.json", "--out", "o.jsonl"]
    kwargs = dry_run("needle_parity.py", *run, "--system", "uniprefill", "--settings", '{"p": 0.95}')
    assert kwargs["compilation_config"]["mode"] == 2
    assert kwargs["compilation_config"]["inductor_compile_config"] == {"uniprefill": {"p": 0.95}}
    assert not kwargs["enable_prefix_caching"] and not kwargs["enable_chunked_prefill"]
    assert kwargs["max_num_batched_tokens"] >= kwargs["max_model_len"] == 32064
    standard = dry_run("needle_parity.py", *run, "--system", "standard", "--lengths", "8936")
    assert "compilation_config" not in standard and standard["max_model_len"] == 9000  # vLLM's default: mode 3


def test_smoke_script_runs_tensor_parallel_and_checks_that_ranks_agree():
    settings = dry_run("smoke_llm.py", "--uniprefill", "--tensor-parallel-size", "2", "--kv-cache-gib", "8")
    kwargs = settings["engine_kwargs"]
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["compilation_config"]["mode"] == 2
    assert settings["env"] == {"VLLM_USE_AOT_COMPILE": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert "tensor_parallel_size" not in dry_run("smoke_llm.py")["engine_kwargs"]
    rank = [{"requests_dropped": 4, "rows_in": 4000, "rows_kept": 2208}]
    assert measure.ranks_agree([rank, [dict(rank[0])]]) is True
    assert measure.ranks_agree([rank, [dict(rank[0], rows_kept=2209)]]) is False  # ranks kept different rows
    assert measure.ranks_agree([rank]) is None and measure.ranks_agree("unavailable: TimeoutError") is None


def test_smoke_script_asks_for_decode_graphs_behind_their_switch(monkeypatch):
    graphs = dry_run("smoke_llm.py", "--uniprefill", "--decode-graphs")["engine_kwargs"]["compilation_config"]
    assert graphs["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert graphs["inductor_compile_config"]["uniprefill"]["vllm_decode_graphs"] is True
    assert "cudagraph_mode" not in dry_run("smoke_llm.py", "--uniprefill")["engine_kwargs"]["compilation_config"]
    done = subprocess.run([sys.executable, "-P", str(SCRIPTS / "smoke_llm.py"), "--decode-graphs", "--dry-run"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "add --uniprefill" in done.stderr  # not without the channel
    for name in ("VLLM_USE_AOT_COMPILE", "VLLM_ALLOW_INSECURE_SERIALIZATION"):  # restored after the test
        monkeypatch.setenv(name, "1")
    env.prepare_vllm_channel()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0" and os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


def test_smoke_script_reports_the_share_of_prompt_kv_still_written():
    graphs = [{"kv_entries_prompt": 3200, "kv_entries_written": 1520}, {"kv_entries_prompt": 800, "kv_entries_written": 480}]
    assert measure.kv_written_share([graphs, graphs]) == (1520 + 480) / (3200 + 800)  # the first worker's graphs
    assert measure.kv_written_share([[{"kv_entries_prompt": 0, "kv_entries_written": 0}]]) is None  # nothing dropped
    assert measure.kv_written_share("unavailable: TimeoutError") is None and measure.kv_written_share([]) is None


def test_smoke_script_times_decode_per_output_token_from_the_engines_timestamps():

    def output(first: float, last: float, generated: int):
        stats = types.SimpleNamespace(first_token_ts=first, last_token_ts=last)
        return types.SimpleNamespace(metrics=stats, outputs=[types.SimpleNamespace(token_ids=[0] * generated)])

    timed = measure.decode_metrics([output(1.0, 1.64, 65), output(2.0, 2.32, 65), output(3.0, 3.96, 65)], 64)
    assert timed["available"] and timed["all_generated"]
    assert (timed["ms_per_token_median"], timed["ms_per_token_max"]) == (10.0, 15.0)
    assert not measure.decode_metrics([output(1.0, 1.5, 40)], 64)["all_generated"]  # stopped early
    assert measure.decode_metrics([types.SimpleNamespace(metrics=None, outputs=[])], 64) == {"available": False}


def test_throughput_warms_up_every_batch_of_the_grid_before_timing(monkeypatch):
    # A step of several prompts may compile what one of fewer does not: Gemma-3-270M's first two-request drop on the
    # H200 took 2.1 s after a one-prompt warm-up, the Qwen3-Next shape's first 4-prompt step 7.8 s after warm-ups of
    # 1 and 2 (FlashInfer's GDN prefill switches kernels from 3 sequences on). Each length warms every batch size.
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    calls = []

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm=False):
            calls.append(len(prompts))
            return [types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], num_cached_tokens=0, metrics=None)
                    for p in prompts]

    points = []
    measure.run_throughput(FakeLLM(), [64, 128], [1, 4, 16], 32000, points, save=lambda: None)
    assert calls == [1, 4, 16, 1, 4, 16] * 2  # per length: warm 1, 4, 16, then the timed batches
    assert [(p["length"], p["batch"]) for p in points] == [(64, 1), (64, 4), (64, 16), (128, 1), (128, 4), (128, 16)]
    assert all(p["prompt_lengths_ok"] for p in points)
    calls.clear()
    measure.run_throughput(FakeLLM(), [64], [4], 32000, [], save=lambda: None)
    assert calls == [1, 4, 4]  # one prompt first, always


def test_throughput_repeats_time_fresh_prompts_and_keep_the_median_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    durations = iter([0.5, 3.0, 1.0, 2.0])  # the warm-up, then three timed calls
    clock = [0.0]
    seen = []

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm=False):
            seen.append(tuple(prompts[0]["prompt_token_ids"][:8]))
            clock[0] += next(durations)
            return [types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], num_cached_tokens=0, metrics=None)
                    for p in prompts]

    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    points = []
    measure.run_throughput(FakeLLM(), [64], [1], 32000, points, save=lambda: None, repeats=3)
    assert len(set(seen)) == 4  # the warm-up and each repeat on prompts of their own
    assert points[0]["seconds_each"] == [3.0, 1.0, 2.0] and points[0]["seconds"] == 2.0
    assert points[0]["tokens_per_s"] == 32.0


def test_request_metrics_split_a_wall_time_around_the_engines_span():
    """With the caller's monotonic clock around `generate` (one clock for every process on Linux), the time before
    the engine queued the first request and after the last first token, beside the engine's own span."""
    metrics = [types.SimpleNamespace(queued_ts=10.0, scheduled_ts=10.5, first_token_ts=12.0),
               types.SimpleNamespace(queued_ts=10.25, scheduled_ts=11.0, first_token_ts=13.0)]
    outputs = [types.SimpleNamespace(metrics=m) for m in metrics]
    engine = measure.request_metrics(outputs, called=9.5, returned=13.75)
    assert engine["span_s"] == 2.5 and engine["per_request_prefill_s"] == [1.5, 2.0]
    assert engine["queued_to_first_token_s"] == 3.0
    assert engine["call_to_queued_s"] == 0.5 and engine["first_token_to_return_s"] == 0.75
    assert "call_to_queued_s" not in measure.request_metrics(outputs)
