"""scripts/gpu/vllm/chunked_parity.py: which prompts two runs prefill differently, beside the chunked ones."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "chunked_parity.py"
spec = importlib.util.spec_from_file_location("chunked_parity", SCRIPT)
chunked_parity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chunked_parity)


def test_a_prompt_that_does_not_fit_the_rest_of_a_step_is_split():
    # budget 10: [4] fits, [4] fits (2 left), [5] splits 2 + 3, [7] fits (0 left), [25] splits 10 + 10 + 5
    assert chunked_parity.chunked_prompts([4, 4, 5, 7, 25], 10) == {2, 4}
    assert chunked_parity.chunked_prompts([10, 10, 3], 10) == set()  # exactly full steps split nothing
    with pytest.raises(ValueError, match="budget"):
        chunked_parity.chunked_prompts([1], 0)


def test_prompts_part_by_their_first_logprob_else_by_their_tokens(tmp_path, capsys):
    a = {"prompt_lengths": [4, 4, 5], "output_token_ids": [[1, 2], [3, 4], [5, 6]],
         "output_logprobs": [[-0.5, -1.0], [-0.25, -2.0], [-1.5, -0.1]]}
    b = {"prompt_lengths": [4, 4, 5], "output_token_ids": [[1, 2], [3, 9], [5, 6]],
         "output_logprobs": [[-0.5, -1.5], [-0.25, -2.0], [-1.25, -0.1]]}  # prompt 0 parts after the prefill only
    assert chunked_parity.parted_prompts(a, b) == ({2}, "first-token logprob")
    del a["output_logprobs"]
    assert chunked_parity.parted_prompts(a, b) == ({1}, "tokens")
    with pytest.raises(ValueError, match="other prompts"):
        chunked_parity.parted_prompts(a, {**b, "prompt_lengths": [4, 4, 6]})
    for name, run in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"parity": run}))
    assert chunked_parity.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--budget", "10"]) == 0
    out = capsys.readouterr().out
    assert "parted (1): [1]" in out and "chunked (1): [2]" in out and "parted, one step: [1]" in out


def test_the_sequential_pass_is_compared_with_each_prompt_alone_in_its_steps(tmp_path, capsys):
    assert chunked_parity.chunked_prompts([4, 4, 5, 7, 25], 10, alone=True) == {4}  # only what exceeds a step
    first = {"prompt_lengths": [4, 4, 5, 25], "output_token_ids": [[1], [2], [3], [4]],
             "output_logprobs": [[-0.5], [-0.5], [-0.5], [-0.5]]}
    alone_a = {"output_token_ids": [[1], [2], [3], [4]], "output_logprobs": [[-0.5], [-0.5], [-0.5], [-0.5]]}
    alone_b = {**alone_a, "output_logprobs": [[-0.5], [-0.5], [-0.5], [-0.75]]}
    (tmp_path / "a.json").write_text(json.dumps({"parity": {**first, "sequential_after": alone_a}}))
    (tmp_path / "b.json").write_text(json.dumps({"parity": {**first, "sequential_after": alone_b}}))
    (tmp_path / "c.json").write_text(json.dumps({"parity": first}))
    assert chunked_parity.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--budget", "10",
                                "--pass", "sequential_after"]) == 0
    out = capsys.readouterr().out
    assert "sequential_after pass" in out and "parted (1): [3]" in out and "chunked (1): [3]" in out
    assert chunked_parity.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--budget", "10"]) == 0
    assert "parted (0)" in capsys.readouterr().out  # the first passes are equal
    with pytest.raises(ValueError, match="no 'sequential_after' pass"):
        chunked_parity.main([str(tmp_path / "a.json"), str(tmp_path / "c.json"), "--pass", "sequential_after"])


def test_recorded_schedules_name_the_prompts_whose_prefill_steps_differ(capsys, tmp_path):
    # prompt 2 (5 tokens) is split 2 + 3 in run a and 1 + 4 in run b; prompt 0 shares its step with other counts
    base = {"prompt_lengths": [4, 4, 5], "output_token_ids": [[1], [2], [3]],
            "output_logprobs": [[-0.5], [-0.5], [-0.5]]}
    a = {**base, "steps": [[[0, 4, 0], [1, 4, 0], [2, 2, 0]], [[0, 1, 4], [1, 1, 4], [2, 3, 2]]]}
    b = {**base, "steps": [[[0, 4, 0], [1, 4, 0], [2, 1, 0]], [[0, 1, 4], [1, 1, 4], [2, 4, 1]]],
         "output_logprobs": [[-0.5], [-0.5], [-0.75]]}
    assert chunked_parity.scheduled_apart(a, b) == {0, 1, 2}  # 0 and 1 shared their step with 2 tokens, then 1
    assert chunked_parity.scheduled_apart(a, a) == set()
    assert chunked_parity.scheduled_apart(base, b) is None
    for name, run in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"parity": run}))
    assert chunked_parity.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--budget", "10"]) == 0
    out = capsys.readouterr().out
    assert "scheduled apart, recorded (3): [0, 1, 2]" in out and "scheduled apart, equal: [0, 1]" in out
