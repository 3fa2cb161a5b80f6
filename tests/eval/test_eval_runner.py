"""Runner (resume, shards, records), systems and summaries on a tiny random model."""

import json

import pytest
import torch

from uniprefill.config import UniPrefillConfig
from uniprefill.eval import systems as systems_mod
from uniprefill.eval.haystack import NOISE_SENTENCES, word_pool
from uniprefill.eval.runner import (
    EvalPlan,
    StopAtNewline,
    StopWhenAnswered,
    cut_answer,
    parse_shard,
    read_records,
    run_eval,
    run_one,
)
from uniprefill.eval.summary import AVERAGE, format_table, plot_pareto, summarize
from uniprefill.eval.systems import SystemSpec, baseline_spec, uniprefill_spec
from uniprefill.eval.tasks import make_sample
from uniprefill.eval.toy import build_toy_llama, train_toy_tokenizer

TASKS = ("niah_single_1", "vt")


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [" ".join(NOISE_SENTENCES) * 50, " ".join(word_pool(2000)), "0123456789 VAR = " * 50]
    return train_toy_tokenizer(corpus, vocab_size=384)


@pytest.fixture(scope="module")
def model():
    return build_toy_llama(384)


def _run(model, tokenizer, path, systems=(baseline_spec(),), **kw):
    plan = EvalPlan(TASKS, (600,), num_samples=2, seed=0)
    return run_eval(model, tokenizer, list(systems), plan, path, model_name="toy",
                    progress=False, **kw)


def test_records_and_resume(model, tokenizer, tmp_path):
    out = tmp_path / "r.jsonl"
    first = _run(model, tokenizer, out)
    assert len(first) == 4 and len(read_records(out)) == 4
    rec = first[0]
    for field in ("ttft_s", "prediction", "score", "answers", "num_tokens", "env", "key",
                  "drop_report", "first_token", "depth"):
        assert field in rec
    assert rec["generation"] == "done" and 0.0 <= rec["score"] <= 1.0
    assert rec["env"]["versions"]["torch"] and rec["env"]["date"]
    assert _run(model, tokenizer, out) == []  # everything done: nothing reruns
    # A run killed mid-line leaves a torn line: it is skipped and its item redone.
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])
    with pytest.warns(UserWarning, match="unreadable line"):
        again = _run(model, tokenizer, out)
    assert len(again) == 1 and again[0]["key"] == json.loads(lines[3])["key"]


def test_shards_partition_prompts_and_keep_systems_together(model, tokenizer, tmp_path):
    systems = [baseline_spec(), baseline_spec(compiled=True)]
    parts = [_run(model, tokenizer, tmp_path / f"s{i}.jsonl", systems, shard=(i, 2),
                  compile_backend="eager", generate=False) for i in range(2)]
    prompts = [{(r["task"], r["index"]) for r in part} for part in parts]
    assert prompts[0].isdisjoint(prompts[1])
    assert prompts[0] | prompts[1] == {(t, i) for t in TASKS for i in range(2)}
    for part in parts:
        for prompt in {(r["task"], r["index"]) for r in part}:
            assert {r["system"] for r in part if (r["task"], r["index"]) == prompt} == \
                {"baseline", "baseline-compiled"}
    assert all(r["generation"] == "skipped" for part in parts for r in part)


def test_parse_shard():
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "x", "1/0", "-1/2"):
        with pytest.raises(ValueError):
            parse_shard(bad)


def test_stop_at_newline_and_cut(tokenizer):
    prompt = tokenizer("Q:", return_tensors="pt")["input_ids"]
    n = prompt.shape[1]
    stop = StopAtNewline(tokenizer, n)
    leading = torch.cat([prompt, tokenizer("\n 123", return_tensors="pt",
                                           add_special_tokens=False)["input_ids"]], 1)
    assert not stop(leading, None).item()  # a newline before any text does not stop
    done = torch.cat([leading, tokenizer(" x\n", return_tensors="pt",
                                         add_special_tokens=False)["input_ids"]], 1)
    assert stop(done, None).item()
    assert cut_answer("\n 1234567.\nOne of", True) == "1234567."
    assert cut_answer(" a\nb", False) == "a b"


class _Scripted:
    """A stand-in system whose greedy output is fixed text."""

    def __init__(self, tokenizer, text, spec=baseline_spec()):
        self.spec, self.tokenizer, self.text = spec, tokenizer, text
        self.generation_pending = None

    def prefill(self, ids, mask):
        return torch.zeros(ids.shape[0], 384)

    def drop_report(self):
        return None

    def ideal_speedup(self, report, seq_len):
        return None

    def generate(self, ids, mask, **kw):
        return torch.tensor([self.tokenizer(self.text, add_special_tokens=False)["input_ids"]])


def test_run_one_scores_the_generated_answer(tokenizer):
    sample = make_sample("niah_single_1", tokenizer, 600, 0)
    right = run_one(_Scripted(tokenizer, f" {sample.answers[0]}.\nQuestion"), sample, tokenizer,
                    torch.device("cpu"), warmup=0)
    wrong = run_one(_Scripted(tokenizer, " 42.\n" + sample.answers[0]), sample, tokenizer,
                    torch.device("cpu"), warmup=0)
    assert right["score"] == 1.0 and right["prediction"] == f"{sample.answers[0]}."
    assert wrong["score"] == 0.0  # text after the newline does not count


def test_generation_pending_is_recorded_not_borrowed(tokenizer):
    sample = make_sample("niah_single_1", tokenizer, 600, 0)
    method = _Scripted(tokenizer, "unused", uniprefill_spec(UniPrefillConfig(p=0.9)))
    method.generation_pending = "no generate() yet"
    rec = run_one(method, sample, tokenizer, torch.device("cpu"), warmup=0)
    assert rec["generation"] == "pending" and rec["score"] is None
    assert rec["generation_error"] == "no generate() yet" and rec["role"] == "method"


def test_uniprefill_system_on_the_tiny_model(model, tokenizer, tmp_path):
    try:
        systems_mod.uniprefill_api()
    except RuntimeError as err:
        pytest.skip(str(err))
    spec = uniprefill_spec(UniPrefillConfig(p=0.9, block_size=16, last_q=32, sink=32))
    records = _run(model, tokenizer, tmp_path / "u.jsonl", [baseline_spec(), spec])
    method = [r for r in records if r["role"] == "method"]
    assert len(method) == 4
    for r in method:
        assert r["generation"] == "done", r.get("generation_error")
        assert r["score"] is not None
        points = systems_mod.drop_points(r["drop_report"])
        assert points and 0 < r["overall_retention"] <= 1
        assert all(p["kept"][0] <= p["entering"][0] for p in points)
    rows = summarize(read_records(tmp_path / "u.jsonl"), n_boot=200)
    assert any(r["system"] == spec.name and r["speedup"] is not None for r in rows)


def _record(system, role, task, index, score, ttft, label=None, p=None, selection="paper", **extra):
    spec = SystemSpec(system, label or system,
                      UniPrefillConfig(p=p, selection=selection, **extra) if p is not None else None)
    return {
        "model": "m", "length": 4096, "task": task, "index": index, "seed": 0,
        "haystack": "noise", "system": system, "system_label": spec.label, "role": role,
        "system_spec": spec.as_dict(), "score": score, "ttft_s": ttft,
        "generation": "done" if score is not None else "pending", "overall_retention":
        0.5 if role == "method" else None,
    }


def test_summary_pairs_prompts_and_uses_the_faster_baseline(tmp_path):
    records = []
    for task in ("niah_single_1", "vt"):
        for i in range(40):
            records.append(_record("baseline", "baseline", task, i, float(i % 2), 1.0))
            records.append(_record("baseline-compiled", "baseline", task, i, float(i % 2), 0.8))
            records.append(_record("uniprefill-a", "method", task, i, 1.0, 0.4, p=0.9))
            records.append(_record("uniprefill-b", "method", task, i, None, 0.5, p=0.95))
    rows = summarize(records, n_boot=500)
    by = {(r["task"], r["system"]): r for r in rows}
    a = by[("vt", "uniprefill-a")]
    assert a["score"] == 100.0 and a["delta"] == pytest.approx(50.0)
    assert 0 < a["ci_low"] < 50 < a["ci_high"]
    assert a["speedup"] == pytest.approx(0.8 / 0.4)  # against the faster (compiled) baseline
    assert by[("vt", "baseline-compiled")]["speedup"] == 1.0
    assert by[("vt", "uniprefill-b")]["score"] is None
    assert by[(AVERAGE, "uniprefill-a")]["n"] == 80
    table = format_table(rows)
    assert "pending" in table and "+50.0" in table
    plot_pareto(rows, str(tmp_path / "pareto.png"))
    assert (tmp_path / "pareto.png").stat().st_size > 1000


def test_summary_rows_name_the_selection_rule_one_pareto_curve_each(tmp_path, monkeypatch):
    records = []
    for i in range(10):
        records.append(_record("baseline", "baseline", "vt", i, 1.0, 1.0))
        for rule in ("paper", "content"):
            for p in (0.9, 0.99):
                records.append(_record(f"u-{rule}-{p}", "method", "vt", i, 1.0, 0.5, p=p, selection=rule))
        records.append(_record("u-sparse", "method", "vt", i, 1.0, 0.5, p=0.9, selection="content",
                               early_sparse_keep=0.05))
        records[-1]["drop_report"] = {"sparse_density": {0: 0.2, 1: 0.4}}
    rows = summarize(records, n_boot=100)
    sparse = next(r for r in rows if r["system"] == "u-sparse" and r["task"] == "vt")
    assert sparse["early_sparse"] == "keep=0.05" and sparse["sparse_density"] == pytest.approx(0.3)
    assert {(r["selection"], r["p"]) for r in rows if r["role"] == "method" and r["task"] == "vt"} == {
        ("paper", 0.9), ("paper", 0.99), ("content", 0.9), ("content", 0.99)}
    import matplotlib.axes

    labels = []
    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **k: labels.append(k.get("label")) or real_plot(self, *a, **k))
    plot_pareto(rows, str(tmp_path / "pareto.png"))
    assert sorted(x for x in labels if x and x != "baseline") == [
        "content, cumulative, drop auto", "content, cumulative, drop auto, early sparse keep=0.05",
        "paper, cumulative, drop auto"]


def test_an_untimed_run_is_plotted_against_one_over_retention(tmp_path, monkeypatch):
    records = []
    for i in range(10):
        records.append(_record("baseline", "baseline", "vt", i, 1.0, None))
        records.append(_record("u", "method", "vt", i, 1.0, None, p=0.9))  # retention 0.5
    rows = summarize(records, n_boot=100)
    assert all(r["speedup"] is None for r in rows if r["role"] == "method")
    import matplotlib.axes

    xs, xlabels = [], []
    real_plot, real_xlabel = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.set_xlabel
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **k: xs.append((k.get("label"), list(a[0]))) or real_plot(self, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xlabel",
                        lambda self, text, *a, **k: xlabels.append(text) or real_xlabel(self, text, *a, **k))
    plot_pareto(rows, str(tmp_path / "pareto.png"))
    curve = [x for label, x in xs if label and label != "baseline"]
    assert curve == [[1.0, 2.0]] and xlabels == ["1 / retention (untimed run: no TTFT)"]


def test_stop_when_answered_only_once_every_reference_is_there(tokenizer):
    sample = make_sample("niah_single_1", tokenizer, 600, 0)
    prompt = tokenizer("Q:", return_tensors="pt")["input_ids"]
    stop = StopWhenAnswered(tokenizer, prompt.shape[1], sample)
    answer = sample.answers[0]

    def ids(text):
        new = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        return torch.cat([prompt, new], 1)

    assert not stop(ids(" " + answer[:-1]), None).item()
    assert stop(ids(" " + answer), None).item()
    assert not stop(ids(" 1\n" + answer), None).item()  # after the newline: not the answer
    # the score of any longer text is the same: references are looked up, text only grows
    assert run_one(_Scripted(tokenizer, f" {answer} and more"), sample, tokenizer,
                   torch.device("cpu"), warmup=0)["score"] == 1.0


def test_timed_subset_and_parts(model, tokenizer, tmp_path):
    spec = uniprefill_spec(UniPrefillConfig(p=0.9, block_size=16, last_q=32, sink=32))
    out = tmp_path / "t.jsonl"
    untimed = _run(model, tokenizer, out, [baseline_spec(), spec], timed_samples=1,
                   part="untimed", decode_sdpa="no-cudnn")
    assert {r["index"] for r in untimed} == {1} and len(untimed) == 4
    for r in untimed:
        assert r["timed"] is False and r["ttft_s"] is None and r["score"] is not None
        assert r["new_tokens"] >= 1 and r["generate_wall_s"] > 0
        assert r["decode_sdpa"] == "no-cudnn" and r["generation"] == "done"
    method = [r for r in untimed if r["role"] == "method"]
    # the generation's own prefill reports what was dropped, and its FLOP-model ideal
    assert all(0 < r["overall_retention"] <= 1 and r["ideal_speedup"] > 1 for r in method)
    rows = summarize(read_records(out), n_boot=100)
    assert all(r["speedup"] is None and r["ttft_ms"] is None for r in rows if r["role"] == "method")
    timed = _run(model, tokenizer, out, [baseline_spec(), spec], timed_samples=1, part="timed")
    assert {r["index"] for r in timed} == {0} and all(r["ttft_s"] > 0 for r in timed)
    assert _run(model, tokenizer, out, [baseline_spec(), spec], timed_samples=1) == []
    # a fresh file resumes from the records of another one
    assert _run(model, tokenizer, tmp_path / "fresh.jsonl", [baseline_spec(), spec],
                timed_samples=1, done_elsewhere=[out]) == []
    rows = summarize(read_records(out), n_boot=100)
    row = next(r for r in rows if r["system"] == spec.name and r["task"] == "vt")
    assert row["n"] == 2 and row["n_timed"] == 1 and row["n_paired"] == 2
    timed_method = next(r for r in timed if r["role"] == "method" and r["task"] == "vt")
    assert row["ideal_speedup"] == pytest.approx(timed_method["ideal_speedup"])
    assert row["speedup_vs_ideal"] == pytest.approx(row["speedup"] / row["ideal_speedup"])
    with pytest.raises(ValueError, match="part"):
        _run(model, tokenizer, out, [baseline_spec()], part="some")


def test_ideal_speedup_is_the_flop_ratio_of_the_report(model):
    from uniprefill.measure.flops import flop_ratio

    spec = uniprefill_spec(UniPrefillConfig(p=0.9, drop_layers=(1,), block_size=16, last_q=32))
    system = systems_mod.System(spec, model)
    report = {"overall_retention": 0.25,
              "drop_points": [{"layer": 1, "entering": [600], "kept": [150], "retention": 0.25}]}
    assert system.ideal_speedup(report, 600) == pytest.approx(
        flop_ratio(model.config, 600, [0.25], [1], last_q=32))
    assert system.ideal_speedup({"drop_points": []}, 600) == 1.0
    assert systems_mod.System(baseline_spec(), model).ideal_speedup(report, 600) is None


def test_decode_sdpa_applies_to_one_token_calls_only():
    from uniprefill.measure.sdpa import for_decode_steps

    seen = []

    def forward(input_ids=None):
        seen.append((input_ids.shape[1], torch.backends.cuda.cudnn_sdp_enabled()))

    wrapped = for_decode_steps(forward, "no-cudnn")
    wrapped(input_ids=torch.zeros(1, 5, dtype=torch.long))
    wrapped(input_ids=torch.zeros(1, 1, dtype=torch.long))
    for_decode_steps(forward, "default")(input_ids=torch.zeros(1, 1, dtype=torch.long))
    assert seen == [(5, True), (1, False), (1, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(ValueError, match="decode SDPA"):
        for_decode_steps(forward, "fast")(input_ids=torch.zeros(1, 1, dtype=torch.long))


def test_a_method_prefill_outside_the_compiled_graph_is_refused(model, monkeypatch):
    """If dynamo falls back to eager, the record would score the plain model as the method."""
    spec = uniprefill_spec(UniPrefillConfig(p=0.9, block_size=16, last_q=32, sink=32))
    system = systems_mod.System(spec, model)
    monkeypatch.setattr(system._api, "last_drop_report", lambda fn: None)
    with pytest.raises(RuntimeError, match="did not run through the uniprefill graph"):
        system.drop_report()


def test_layer_segments_weight_token_counts_by_layer_share():
    from uniprefill.eval.ideal import layer_segments

    segments = layer_segments(18, [(11, 2000), (5, 4000)], 16000)  # Gemma-3-270M's "auto"
    assert segments == [(16000, 5.5 / 18), (4000, 6 / 18), (2000, 6.5 / 18)]
    assert sum(share for _, share in segments) == pytest.approx(1.0)
    assert layer_segments(4, [], 100) == [(100, 1.0)]
    with pytest.raises(ValueError, match="distinct"):
        layer_segments(4, [(1, 5), (1, 3)], 10)
    with pytest.raises(ValueError, match="inside"):
        layer_segments(4, [(4, 5)], 10)


def test_measured_ideal_times_each_token_count_once_per_prompt():
    from uniprefill.eval.ideal import measured_ideal

    seen = []

    def prefill(ids, mask):
        seen.append(ids.shape[1])
        assert mask.shape == ids.shape
        return ids

    ids = torch.arange(100)[None]
    times: dict[int, float] = {}
    first = measured_ideal(prefill, ids, torch.ones_like(ids), [(100, 0.5), (40, 0.5)], torch.device("cpu"),
                           warmup=0, repeats=1, times=times)
    assert sorted(seen) == [40, 100] and set(times) == {40, 100}
    second = measured_ideal(prefill, ids, torch.ones_like(ids), [(100, 0.25), (20, 0.75)], torch.device("cpu"),
                            warmup=0, repeats=1, times=times)
    assert sorted(seen) == [20, 40, 100]  # t(100) came from the cache
    assert second["base_s"] == first["base_s"] == times[100]
    assert second["ideal_s"] == pytest.approx(0.25 * times[100] + 0.75 * times[20])
    assert second["speedup"] == pytest.approx(times[100] / second["ideal_s"])


def test_measured_ideal_in_records_and_summary(model, tokenizer, tmp_path):
    spec = uniprefill_spec(UniPrefillConfig(p=0.9, block_size=16, last_q=32, sink=32))
    out = tmp_path / "m.jsonl"
    records = _run(model, tokenizer, out, [baseline_spec(), spec], measured_ideal=True, generate=False)
    method = [r for r in records if r["role"] == "method"]
    assert method and all("ideal_measured" not in r for r in records if r["role"] == "baseline")
    layers = model.config.num_hidden_layers
    for r in method:
        ideal = r["ideal_measured"]
        points = systems_mod.drop_points(r["drop_report"])
        assert [n for n, _, _ in ideal["segments"]] == [r["prompt_tokens"]] + [p["kept"][0] for p in points]
        assert sum(share for _, share, _ in ideal["segments"]) == pytest.approx(1.0)
        assert ideal["segments"][0][1] == pytest.approx((points[0]["layer"] + 0.5) / layers)
        assert ideal["speedup"] == pytest.approx(ideal["base_s"] / ideal["ideal_s"]) and ideal["speedup"] > 0
    rows = summarize(read_records(out), n_boot=100)
    row = next(r for r in rows if r["system"] == spec.name and r["task"] == "vt")
    assert row["ideal_measured_speedup"] is not None
    assert row["speedup_vs_measured_ideal"] == pytest.approx(row["speedup"] / row["ideal_measured_speedup"])
    assert "ideal meas." in format_table(rows)
