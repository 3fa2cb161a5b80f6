"""`scripts/gpu/vllm/profile_prefill.py`'s trace summary on the saved H200 traces: the figures the docs quote.

docs/results/vllm-gemma-profile-own-h200-2026-12-05 (and docs/vllm.md, docs/benchmarks.md) explain Gemma-3-270M's
miss on vLLM's defaults with one 32K prefill traced in the engine's own process: host-bound steps, and the drop
points' host time. Those numbers come from `trace_summary` over the saved trace files; this recomputes them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
    assert "profiled prefill + decode tokens: 3 of 4 equal" in text
    moved = text.split("moved most")[1].splitlines()[1:]
    assert "_decode_segment_kernel" in moved[0] and "0.000 ->     2.000" in moved[0]
    assert "flash_fwd_kernel" in moved[1] and "10.000 ->     9.000" in moved[1]
    assert "nvjet_gemm" in moved[2]  # unmoved: last
