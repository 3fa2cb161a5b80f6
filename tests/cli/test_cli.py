"""The command line: argument errors fail at once; tiny end-to-end runs of every command."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from uniprefill.cli import main, parse_length
from uniprefill.eval.haystack import NOISE_SENTENCES, word_pool
from uniprefill.eval.systems import uniprefill_api
from uniprefill.eval.toy import build_toy_llama, train_toy_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with its tokenizer, saved as a local model folder."""
    path = tmp_path_factory.mktemp("toy")
    corpus = [" ".join(NOISE_SENTENCES) * 50, " ".join(word_pool(2000)), "0123456789 " * 50]
    train_toy_tokenizer(corpus, vocab_size=384).save_pretrained(path)
    build_toy_llama(384, max_position_embeddings=4096).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def essay(tmp_path_factory):
    words = word_pool(2000)
    text = " ".join(" ".join(words[i:i + 10]).capitalize() + "." for i in range(0, 2000, 10))
    path = tmp_path_factory.mktemp("hay") / "essays.json"
    path.write_text(json.dumps({"text": text}))
    return str(path)


def _fails(argv, capsys, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.parametrize("argv, message", [
    (["eval", "--tasks", "niah_single_1,nope"], "unknown task 'nope'"),
    (["eval", "--tasks", "qa_2"], "HotpotQA"),
    (["eval", "--tasks", "niah_single_1", "--p", "1.5"], "p=1.5 is outside (0.0, 1.0]"),
    (["eval", "--tasks", "niah_single_1", "--p", "0"], "p=0.0 is outside"),
    (["eval", "--tasks", "niah_single_1", "--policy", "lazy"], "policy='lazy'"),
    (["eval", "--tasks", "niah_single_1", "--window-positions", "kept"], "window_positions='kept'"),
    (["eval", "--tasks", "niah_single_1", "--selection", "top"], "selection='top'"),
    (["eval", "--tasks", "niah_single_1", "--shard", "2/2"], "shard '2/2'"),
    (["eval", "--tasks", "niah_single_1", "--lengths", "4q"], "length '4q'"),
    (["eval", "--tasks", "niah_single_1", "--model", "./no/such/model"], "does not exist"),
    (["eval", "--tasks", "niah_single_2"], "need an essay haystack"),
    (["bench", "--model", "/no/such/model"], "model path '/no/such/model' does not exist"),
    (["bench", "--model", "x", "--drop-layers", "a,b"], "--drop-layers"),
    (["bench", "--model", "x", "--keep-ratio", "0.5,x"], "--keep-ratio"),
    (["bench", "--model", "x", "--keep-ratio", "1.5"], "keep_ratio"),
    (["bench", "--model", "x", "--measured-ideal", "--batch-sizes", "1,2"], "batch 1"),
    (["bench", "--model", "x", "--measured-ideal", "--policy", "suspend"], "cumulative"),
    (["demo", "--p", "0.9,0.95"], "one --p"),
    (["demo", "--haystack", "/no/such/file.json"], "does not exist"),
    (["eval", "--summary-only", "--out", "/no/such/results.jsonl"], "does not exist"),
])
def test_bad_arguments_fail_at_once(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("UNIPREFILL_HAYSTACK", raising=False)
    _fails(argv, capsys, message)


def test_length_above_max_positions(model_dir, capsys):
    _fails(["eval", "--model", model_dir, "--tasks", "niah_single_1", "--lengths", "4k,8k"],
           capsys, "[8192] above the model's max_position_embeddings=4096")
    _fails(["bench", "--model", model_dir, "--lengths", "16k"], capsys,
           "max_position_embeddings=4096")


def test_parse_length():
    assert parse_length("4k") == 4096 and parse_length("128K") == 131072
    assert parse_length("3000") == 3000


def test_eval_end_to_end_with_shards(model_dir, essay, tmp_path, capsys):
    common = ["eval", "--model", model_dir, "--tasks", "niah_single_1,niah_single_2",
              "--lengths", "600", "--samples", "2", "--haystack", essay, "--baseline-only",
              "--quiet", "--n-boot", "200"]
    for i in range(2):
        assert main(common + ["--out", str(tmp_path / f"s{i}.jsonl"), "--shard", f"{i}/2"]) == 0
    merged = tmp_path / "all.jsonl"
    merged.write_text("".join((tmp_path / f"s{i}.jsonl").read_text() for i in range(2)))
    capsys.readouterr()
    assert main(["eval", "--summary-only", "--out", str(merged),
                 "--plot", str(tmp_path / "pareto.png")]) == 0
    table = capsys.readouterr().out
    assert "niah_single_2" in table and "average" in table
    lines = [json.loads(x) for x in merged.read_text().splitlines()]
    assert len(lines) == 4 and {line["settings"]["shard"] for line in lines} == {"0/2", "1/2"}
    summary = json.loads((tmp_path / "all.summary.json").read_text())
    env = summary["environments"][0]
    assert env["versions"]["transformers"] and env["device_name"] and env["date"]
    assert {r["task"] for r in summary["rows"]} == {"niah_single_1", "niah_single_2", "average"}
    assert (tmp_path / "pareto.png").exists()


def test_eval_in_stages_as_the_gpu_script_runs_it(model_dir, essay, tmp_path, capsys):
    """Timed prompts first, untimed ones in shards, two drop sets, a gzip'd merge."""
    import gzip

    common = ["eval", "--model", model_dir, "--tasks", "niah_single_1,niah_single_2",
              "--lengths", "600", "--samples", "3", "--haystack", essay, "--quiet",
              "--n-boot", "200", "--p", "0.5,0.9", "--drop-layers", "all; 1", "--timed-samples", "1",
              "--decode-sdpa", "no-cudnn"]
    assert main(common + ["--part", "timed", "--out", str(tmp_path / "timed.jsonl")]) == 0
    for i in range(2):
        assert main(common + ["--part", "untimed", "--shard", f"{i}/2",
                              "--out", str(tmp_path / f"u{i}.jsonl")]) == 0
    text = "".join((tmp_path / name).read_text() for name in ("timed.jsonl", "u0.jsonl", "u1.jsonl"))
    records = [json.loads(x) for x in text.splitlines()]
    assert len(records) == 2 * 3 * 5  # tasks x samples x (baseline + 2 p x 2 drop sets)
    assert {r["index"] for r in records if r["timed"]} == {0}
    assert {str(r["system_spec"]["config"]["drop_layers"]) for r in records
            if r["role"] == "method"} == {"all", "[1]"}
    merged = tmp_path / "all.jsonl.gz"
    with gzip.open(merged, "wt", encoding="utf-8") as f:
        f.write(text)
    capsys.readouterr()
    assert main(["eval", "--summary-only", "--out", str(merged), "--summary", str(tmp_path / "s.json"),
                 "--plot", str(tmp_path / "pareto.png")]) == 0
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    methods = [r for r in rows if r["role"] == "method" and r["task"] == "average"]
    assert len(methods) == 4 and all(r["n"] == 6 and r["n_timed"] == 2 for r in methods)
    assert all(r["speedup"] and r["ideal_speedup"] for r in methods)
    assert len({r["drop_layers"] for r in methods}) == 2


def test_several_drop_sets_and_bad_ones(capsys):
    _fails(["eval", "--tasks", "niah_single_1", "--drop-layers", "all;x"], capsys, "--drop-layers 'x'")
    _fails(["eval", "--tasks", "niah_single_1", "--drop-layers", " ; "], capsys, "names no drop set")


def test_window_positions_multiply_the_systems():
    from uniprefill.cli import _configs, build_parser

    args = build_parser().parse_args(["eval", "--tasks", "niah_single_1", "--p", "0.8,0.9",
                                      "--window-positions", "original,compacted"])
    configs = _configs(args)
    assert sorted((c.p, c.window_positions) for c in configs) == [
        (0.8, "compacted"), (0.8, "original"), (0.9, "compacted"), (0.9, "original")]


def test_selection_rules_multiply_the_systems_with_their_own_labels():
    """`--selection paper,content --p ...`: one run sweeps both rules (issue: compare them in one
    eval); each system's label names a non-default rule."""
    from uniprefill.cli import _configs, build_parser
    from uniprefill.eval.systems import uniprefill_spec

    args = build_parser().parse_args(["eval", "--tasks", "niah_single_1", "--p", "0.9,0.99",
                                      "--selection", "paper,content"])
    configs = _configs(args)
    assert sorted((c.selection, c.p) for c in configs) == [
        ("content", 0.9), ("content", 0.99), ("paper", 0.9), ("paper", 0.99)]
    labels = {(c.selection, c.p): uniprefill_spec(c).label for c in configs}
    assert labels[("content", 0.9)].endswith("selection=content")
    assert "selection" not in labels[("paper", 0.9)]
    assert len({uniprefill_spec(c).name for c in configs}) == 4


def test_bench_end_to_end(model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", model_dir, "--lengths", "300", "--baseline", "eager",
                 "--baseline-only", "--warmup", "0", "--repeats", "2", "--inputs", "random",
                 "--out", str(out), "--plot", str(tmp_path / "b.png"), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["environment"]["versions"]["torch"] and data["settings"]["lengths"] == "300"
    assert data["plan"]["repeats"] == 2 and len(data["results"]) == 1
    assert len(data["results"][0]["ttft"]["times_s"]) == 2
    assert "TTFT ms" in capsys.readouterr().out and (tmp_path / "b.png").exists()


def test_bench_forced_retention_with_measured_ideal(model_dir, tmp_path, capsys):
    """Issue 5's preset sweep: forced keep ratios, the measured ideal beside the FLOP one."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", model_dir, "--lengths", "2000", "--baseline", "eager",
                 "--keep-ratio", "0.5,0.25", "--drop-layers", "1", "--measured-ideal", "--warmup", "0",
                 "--repeats", "1", "--inputs", "random", "--out", str(out), "--quiet"]) == 0
    results = json.loads(out.read_text())["results"]
    methods = [r for r in results if r["role"] == "method"]
    assert sorted(r["config"]["keep_ratio"][0] for r in methods) == [0.25, 0.5]
    for r in methods:
        kept = r["drop_report"]["drop_points"][0]["kept"][0]
        assert abs(kept - r["config"]["keep_ratio"][0] * 2000) <= r["config"]["block_size"]  # whole blocks
        assert r["ideal_ttft_s"] > 0 and r["ideal_speedup"] == pytest.approx(
            results[0]["ttft"]["median_s"] / r["ideal_ttft_s"])
        assert r["analytic_ideal_speedup"] > 0  # (the toy has 2 layers: a drop at 1 saves little)
    assert "ideal (meas.)" in capsys.readouterr().out


def test_demo_end_to_end(model_dir, essay, tmp_path, capsys, monkeypatch):
    try:
        uniprefill_api()
    except RuntimeError as err:
        pytest.skip(str(err))
    monkeypatch.setenv("UNIPREFILL_HAYSTACK", essay)
    out = tmp_path / "demo.json"
    assert main(["demo", "--model", model_dir, "--length", "700", "--warmup", "0",
                 "--repeats", "1", "--p", "0.9", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "from UNIPREFILL_HAYSTACK" in text and "speedup:" in text
    data = json.loads(out.read_text())
    assert data["sample"]["task"] == "niah_single_2" and data["config"]["p"] == 0.9
    assert set(data["results"]) == {"baseline", "uniprefill"}


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "uniprefill", "--help"], capture_output=True,
                         text=True, cwd=Path(__file__).parent, timeout=120)
    assert out.returncode == 0 and "demo" in out.stdout and "eval" in out.stdout


@pytest.mark.parametrize("command, default", [("bench", "4k,8k,16k,32k"), ("eval", "results.jsonl"),
                                              ("demo", "0.95"), ("fuzz", "200")])
def test_help_shows_every_default(command, default, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert f"(default: {default})" in " ".join(capsys.readouterr().out.split())  # help text wraps


def test_bench_warmup_0_warns_that_compile_time_enters_ttft(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--warmup", "0", "--model", "/no/such/model"])
    assert "includes its compile time" in capsys.readouterr().err


def test_fuzz_command_runs_a_case_and_writes_its_summary(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    assert main(["fuzz", "--cases", "2", "--seed", "5", "--archs", "tiny-llama", "--quiet", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["cases"] == 2 and summary["failures"] == [] and summary["ties"] == []
    assert "2 cases" in capsys.readouterr().out


def test_fuzz_stops_starting_cases_after_its_time_budget(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    assert main(["fuzz", "--cases", "50", "--seconds", "0.001", "--archs", "tiny-llama", "--quiet",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["cases"] == 1, "the case running when the budget passed is finished"
    with pytest.raises(SystemExit):
        main(["fuzz", "--seconds", "0"])


@pytest.mark.parametrize("argv", [["demo", "--length", "40k"], ["bench", "--model", "tiny-llama", "--lengths", "900k"]])
def test_length_above_the_context_fails_before_any_model_is_loaded(argv, capsys, monkeypatch):
    import uniprefill.bench.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit):
        main(argv)
    assert "above the model's max_position_embeddings" in capsys.readouterr().err


def test_eval_without_arguments_runs_the_tasks_that_need_no_essays(capsys, monkeypatch):
    import uniprefill.bench.models as models
    from uniprefill.eval.tasks import TASK_NAMES, needs_essay

    monkeypatch.delenv("UNIPREFILL_HAYSTACK", raising=False)

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(models, "load_model", stop)
    with pytest.raises(Loaded):  # every check passed and it went on to load the model
        main(["eval"])
    err = capsys.readouterr().err
    free = [t for t in TASK_NAMES if not needs_essay(t)]
    assert free and f"tasks: {', '.join(free)}" in err and "--haystack" in err
