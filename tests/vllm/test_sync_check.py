"""`scripts/gpu/vllm/sync_check.py` against a fake `vllm.LLM` (CPU): the sync-debug warnings are counted by site and
phase, the decode's are the prefill + decode run's less the prefill's, and other warnings still show."""

from __future__ import annotations

import importlib.util
import json
import sys
import traceback
import types
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("sync_check", ROOT / "scripts" / "gpu" / "vllm" / "sync_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_site_is_the_innermost_frame_of_vllm_or_uniprefill():
    module = _script()
    frame = lambda path, line, name: traceback.FrameSummary(path, line, name)
    stack = [frame("/x/vllm/v1/worker/gpu_worker.py", 10, "execute_model"),
             frame("/x/uniprefill/vllm/drop.py", 367, "_base_layout"),
             frame("/home/u/uniprefill/.venv/lib/site-packages/torch/_tensor.py", 5, "cpu"),  # an env under uniprefill/
             frame("/usr/lib/python3.12/warnings.py", 109, "_showwarnmsg")]  # what reports the warning
    assert module.site_of(stack) == "uniprefill/vllm/drop.py:367 _base_layout"
    assert module.site_of(stack[:1] + stack[2:]) == "vllm/v1/worker/gpu_worker.py:10 execute_model"
    checkout = [frame("/src/uniprefill/uniprefill/vllm/drop.py", 1, "f")]  # a checkout in a folder of that name
    assert module.site_of(checkout) == "uniprefill/vllm/drop.py:1 f"
    mine = frame("/x/app.py", 3, "main")
    assert module.site_of([mine] + stack[2:]) == "/x/app.py:3 main"  # none of theirs: the innermost not torch's


def test_syncs_are_counted_per_phase_and_the_decode_is_the_difference(tmp_path, monkeypatch):
    module = _script()
    ns = types.SimpleNamespace

    def sync(times: int) -> None:
        for _ in range(times):
            warnings.warn("called a synchronizing CUDA operation")

    class FakeLLM:
        def __init__(self, model, tokenizer, **kwargs):
            self.llm_engine = ns(model_config=ns(get_vocab_size=lambda: 5000))
            sync(7)  # set-up: counted apart

        def generate(self, prompts, params, use_tqdm=False):
            sync(2)  # each step's prefill part
            for _ in range(params.max_tokens - 1):
                sync(3)  # each decode step
            warnings.warn("something else")  # not a sync: shown as before
            return [ns(outputs=[ns(token_ids=list(range(params.max_tokens)))]) for _ in prompts]

        def reset_prefix_cache(self):
            return True

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = FakeLLM, lambda **kwargs: ns(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    shown = []
    fake_show = lambda message, *rest, **kw: shown.append(str(message))  # noqa: E731
    monkeypatch.setattr(warnings, "showwarning", fake_show)
    filters = warnings.filters[:]
    out = tmp_path / "sync.json"
    assert module.main(["--model-dir", str(tmp_path), "--out", str(out), "--length", "64", "--decode-tokens", "5"]) == 0
    result = json.loads(out.read_text())
    total = lambda phase: sum(n for _, n in result["syncs"][phase])
    assert (total("setup"), total("warm-up"), total("prefill"), total("prefill+decode")) == (7, 17, 2, 17)
    assert total("decode_only") == 15 and result["decode_syncs_per_token"] == 3.0
    assert result["decode_token_ids"] == [0, 1, 2, 3, 4, 5]
    assert shown.count("something else") == 3  # warm-up, prefill, prefill + decode
    assert warnings.filters == filters and warnings.showwarning is fake_show  # restored
