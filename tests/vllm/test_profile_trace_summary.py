"""`scripts/gpu/vllm/profile_prefill.py`'s trace summary on the saved H200 traces: the figures the docs quote.

docs/results/vllm-gemma-profile-own-h200-2026-12-05 (and docs/vllm.md, docs/benchmarks.md) explain Gemma-3-270M's
miss on vLLM's defaults with one 32K prefill traced in the engine's own process: host-bound steps, and the drop
points' host time. Those numbers come from `trace_summary` over the saved trace files; this recomputes them.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "vllm-gemma-profile-own-h200-2026-12-05"


def _summarise(name: str) -> list[dict]:
    script = ROOT / "scripts" / "gpu" / "vllm" / "profile_prefill.py"
    spec = importlib.util.spec_from_file_location("profile_prefill", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summary = module.trace_summary(RESULTS / f"trace-{name}.pt.trace.json.gz")
    return [step for step in summary["annotations"] if "outer_ops_ms" in step]  # the steps that ran the prompt


def test_the_saved_traces_give_the_figures_the_docs_quote():
    standard = _summarise("standard")
    assert [round(s["host_ms"], 1) for s in standard] == [29.0, 23.2]  # two chunks of vLLM's 16,384-token budget
    assert round(sum(s["device_busy_ms"] for s in standard), 1) == 24.5
    (step,) = _summarise("p095")  # one step: uniprefill's one-step budget
    assert (round(step["host_ms"], 1), round(step["device_busy_ms"], 1)) == (63.2, 21.1)
    calls, ms = {name: (n, t) for name, n, t in step["outer_ops_ms"]}["uniprefill::vllm_drop"]
    assert (calls, round(ms, 1)) == (2, 22.8)


def test_compare_names_the_decode_kernels_that_moved_most():
    script = ROOT / "scripts" / "gpu" / "vllm" / "profile_prefill.py"
    spec = importlib.util.spec_from_file_location("profile_prefill", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def side(decode_kernels: dict, per_token: float) -> dict:
        part = module.summary({name: 1e3 * ms for name, ms in decode_kernels.items()})
        return {"prefill_wall_ms_median": 100.0, "prefill": part, "decode_part": part,
                "decode_wall_ms_per_token": per_token}

    standard = side({"flash_fwd_kernel": 10.0, "nvjet_gemm": 50.0}, 5.5)
    ours = side({"flash_fwd_kernel": 9.0, "nvjet_gemm": 50.0, "_decode_segment_kernel": 2.0}, 5.8)
    standard["decode_token_ids"], ours["decode_token_ids"] = [[5, 6, 7, 8]], [[5, 6, 9, 8]]
    text = module.compare(standard, ours)
    assert "decode wall ms per token: 5.5 -> 5.8" in text
    assert "first" not in text.split("moved most")[0]  # no early-token walls recorded: no such line
    standard["decode_wall_ms_per_token_first"], ours["decode_wall_ms_per_token_first"] = 5.6, 6.1
    assert "decode wall ms per token, first: 5.6 -> 6.1" in module.compare(standard, ours)
    assert "profiled prefill + decode tokens: 3 of 4 equal" in text
    moved = text.split("moved most")[1].splitlines()[1:]
    assert "_decode_segment_kernel" in moved[0] and "0.000 ->     2.000" in moved[0]
    assert "flash_fwd_kernel" in moved[1] and "10.000 ->     9.000" in moved[1]
    assert "nvjet_gemm" in moved[2]  # unmoved: last
    ours["decode_part"]["top_kernels_ms"].append(["flash_fwd_kernel", 0.5])  # another kernel of the same cut name
    assert "10.000 ->     9.500  flash_fwd_kernel" in module.compare(standard, ours)  # summed, not replaced


def test_the_decode_is_timed_and_profiled_on_the_prompts_of_the_prefills_from_an_empty_cache(tmp_path, monkeypatch):
    """`profile_prefill.py` against a fake `vllm.LLM` (CPU): each prefill + decode run takes the prompt of a
    prefill-only run, and every timed or profiled run starts from an emptied prefix cache (a p-driven drop keeps
    another share of each prompt, so two prompts would count one prefill's work against the other's; run ab)."""
    import sys
    import types

    import torch

    script = ROOT / "scripts" / "gpu" / "vllm" / "profile_prefill.py"
    spec = importlib.util.spec_from_file_location("profile_prefill", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ns = types.SimpleNamespace
    runs = []

    class FakeLLM:
        def __init__(self, model, tokenizer, **kwargs):
            self.cached = set()
            self.llm_engine = ns(model_config=ns(get_vocab_size=lambda: 5000))

        def generate(self, prompts, params, use_tqdm=False):
            for prompt in prompts:
                ids = tuple(prompt["prompt_token_ids"])
                runs.append((ids, params.max_tokens, ids in self.cached))
                self.cached.add(ids)
            return [ns(outputs=[ns(token_ids=list(range(params.max_tokens)))]) for _ in prompts]

        def reset_prefix_cache(self):
            self.cached.clear()
            return True

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = FakeLLM, lambda **kwargs: ns(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    out = tmp_path / "p.json"
    assert module.main(["--model-dir", str(tmp_path), "--out", str(out), "--length", "80", "--decode-tokens", "4",
                        "--decode-walls", "--repeats", "2"]) == 0
    result = json.loads(out.read_text())
    assert result["decode_token_ids"] == [[0, 1, 2, 3, 4]] and "decode_wall_ms_per_token" in result
    timed = runs[3:]  # after three warm-ups: 2 prefills, 2 prefill + decode, the two profiled runs
    assert [n for _, n, _ in timed] == [1, 1, 5, 5, 1, 5]
    assert [ids for ids, _, _ in timed[2:4]] == [ids for ids, _, _ in timed[:2]]  # the prefills' prompts again
    assert timed[4][0] == timed[5][0] and timed[4][0] not in {ids for ids, _, _ in timed[:2]}
    assert not any(hit for _, _, hit in timed)  # none read from the prefix cache
    with pytest.raises(SystemExit):
        module.main(["--model-dir", str(tmp_path), "--out", str(out), "--decode-walls", "--decode-tokens", "0"])

    runs.clear()  # --early-tokens: the same prompts once more with only the first K tokens
    assert module.main(["--model-dir", str(tmp_path), "--out", str(out), "--length", "80", "--decode-tokens", "4",
                        "--decode-walls", "--early-tokens", "1", "--repeats", "2"]) == 0
    result = json.loads(out.read_text())
    timed = runs[3:9]
    assert [n for _, n, _ in timed] == [1, 1, 5, 5, 2, 2] and not any(hit for _, _, hit in timed)
    assert len({ids for ids, _, _ in timed}) == 2  # the two prefills' prompts, three times each
    assert {"decode_wall_ms_per_token_first", "decode_wall_ms_per_token_after_first"} <= set(result)
    for bad in (["--early-tokens", "4"], ["--early-tokens", "0", "--early-tokens", "-1"]):  # K < decode tokens, K > 0
        with pytest.raises(SystemExit):
            module.main(["--model-dir", str(tmp_path), "--out", str(out), "--decode-walls", "--decode-tokens", "4", *bad])


def test_decode_steps_are_periods_against_the_device_time_in_them(tmp_path):
    """A synthetic trace: three decode steps 10 ms apart (the last one closes the second period), kernels busy 5 ms
    of the first period (two overlapping) and 9 ms of the second (one runs past its end: clipped); a prefill step, a
    mixed step and an empty step (no request: `generation_0(0)`) are not decode steps."""
    import gzip

    script = ROOT / "scripts" / "gpu" / "vllm" / "profile_prefill.py"
    spec = importlib.util.spec_from_file_location("profile_prefill", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ms = 1000.0
    step = lambda name, t, host: {"ph": "X", "cat": "user_annotation", "name": name, "ts": t * ms, "dur": host * ms}
    kernel = lambda t, dur: {"ph": "X", "cat": "kernel", "name": "k", "ts": t * ms, "dur": dur * ms}
    events = [step("execute_context_1(28672)_generation_0(0)", -50, 40),
              step("execute_context_0(0)_generation_0(0)", -8, 0.4),  # an empty step (vLLM's traces hold two)
              step("execute_context_1(8)_generation_1(1)", -5, 1),
              step("execute_context_0(0)_generation_1(1)", 0, 1.0), step("execute_context_0(0)_generation_1(1)", 10, 2.0),
              step("execute_context_0(0)_generation_1(1)", 20, 1.5),
              kernel(1, 4), kernel(4, 2), kernel(11, 5), kernel(16, 6)]  # 1-6: 5 ms; 11-20 of 11-22: 9 ms
    path = tmp_path / "t.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    decode = module.trace_summary(path)["decode_steps"]
    assert decode == {"steps": 3, "period_ms_median": 10.0, "host_ms_median": 1.5, "device_busy_ms_median": 7.0,
                      "device_idle_share": 0.3, "first_periods_ms": [10.0, 10.0], "first_busy_ms": [5.0, 9.0]}
    assert module.decode_steps([e for e in events if e["cat"] == "user_annotation"][:4], []) == {}  # one decode step
