"""scripts/gpu/vllm/serve_rounds.py, run as a user runs it: `bench_serve.sh` rounds of standard vLLM and
uniprefill read against standard's own spread between rounds, and the decode's gaps after the first."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "serve_rounds.py"


def write(folder: Path, system: str, length: int, concurrency: int, tokens_per_s: float, gap_s: float,
          completed: int = 32) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{system}-{length}-c{concurrency}.json").write_text(json.dumps(
        {"duration": 32 * length / tokens_per_s, "completed": completed, "failed": 32 - completed,
         "total_input_tokens": completed * length,
         # the first gap of each request is slow (one step after the prefill), the second is the decode: the median
         # of every gap would lie between the two, the median of the later ones is the decode's
         "itls": [[0.5, gap_s] for _ in range(completed)]}))


def run(*args):
    return subprocess.run([sys.executable, "-P", str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def rows_of(stdout: str) -> dict[str, list[str]]:
    return {" ".join(cells[:2]): cells for line in stdout.splitlines()
            if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])[0].isdigit()}


def test_a_gain_beyond_standards_spread_is_faster_and_one_inside_it_is_noise(tmp_path):
    # standard spreads 2% between rounds at both points; uniprefill gains 8% at 28K x 1, 1% at 16K x 4
    rounds = [tmp_path / f"round-{i}" for i in (1, 2, 3)]
    for folder, std in zip(rounds, (25000.0, 25500.0, 25250.0)):
        write(folder, "standard", 28672, 1, std, 0.0075)
        write(folder, "uniprefill", 28672, 1, std * 1.08, 0.0077)
        write(folder, "standard", 16384, 4, 33000.0 + (std - 25000.0), 0.0090)
        write(folder, "uniprefill", 16384, 4, (33000.0 + (std - 25000.0)) * 1.01, 0.0090)
    write(rounds[0], "standard", 8192, 16, 1.0, 0.1)  # a point one round holds: named and left out
    write(rounds[0], "uniprefill", 8192, 16, 1.0, 0.1)
    write(rounds[1], "standard", 4096, 1, 1.0, 0.1)  # a point one system has in every round: left out, named
    for folder in rounds:
        write(folder, "standard", 2048, 1, 1.0, 0.1)
        write(folder, "uniprefill", 2048, 1, 1.0, 0.1, completed=0 if folder is rounds[2] else 32)
    done = run(*rounds, "--out", tmp_path / "summary.json", "--plot", tmp_path / "rounds.png")
    assert done.returncode == 0, done.stderr
    assert "no request completed): [(2048, 1), (4096, 1), (8192, 16)]" in done.stdout
    rows = rows_of(done.stdout)
    assert list(rows) == ["16384 4", "28672 1"]
    faster = rows["28672 1"]
    assert faster[2] == "1.080, 1.080, 1.080" and faster[3] == "1.080" and faster[6] == "faster"
    assert faster[5] == "0.980-1.020"  # 25,500 / 25,000: standard's widest ratio between two rounds
    assert faster[4] == f"{25000 * 1.08 / 25500:.3f}-{25500 * 1.08 / 25000:.3f}"
    assert faster[7] == ", ".join(["7.50 -> 7.70 (+2.7%)"] * 3)  # the gaps after the first, not the slow first one
    assert rows["16384 4"][6] == "within noise"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["verdict"] for p in summary["points"]] == ["within noise", "faster"]
    assert summary["points"][1]["tokens_per_s"]["standard"] == [25000, 25500, 25250]
    assert (tmp_path / "rounds.png").stat().st_size > 0


def test_a_loss_beyond_standards_spread_is_slower_and_failed_requests_are_named(tmp_path):
    rounds = [tmp_path / f"round-{i}" for i in (1, 2)]
    for folder, std in zip(rounds, (30000.0, 30300.0)):
        write(folder, "standard", 28672, 16, std, 0.3)
        write(folder, "uniprefill", 28672, 16, std * 0.9, 0.9, completed=31 if folder is rounds[1] else 32)
    done = run(*rounds)
    assert done.returncode == 0, done.stderr
    assert rows_of(done.stdout)["28672 16"][6] == "slower"
    assert "round 2, uniprefill 28672 x 16: 1 request(s) failed" in done.stdout


def test_a_round_without_one_system_is_an_error(tmp_path):
    write(tmp_path / "round-1", "standard", 28672, 1, 25000.0, 0.0075)
    write(tmp_path / "round-1", "uniprefill", 28672, 1, 27000.0, 0.0077)
    write(tmp_path / "round-2", "standard", 28672, 1, 25000.0, 0.0075)
    done = run(tmp_path / "round-1", tmp_path / "round-2")
    assert done.returncode == 2 and "round 2 has no uniprefill result file" in done.stderr
