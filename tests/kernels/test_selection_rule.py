"""kernels/rule.py: a SelectionRule checks its values when built (the messages the selection
API gave before it took a rule), is frozen and hashable, and reads a config's drop point."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from uniprefill.config import UniPrefillConfig
from uniprefill.kernels import api
from uniprefill.kernels.rule import SelectionRule

GOOD = dict(block_size=16, sink=4, last_q=8, min_tokens=0)


@pytest.mark.parametrize("override,message", [
    (dict(p=1.5), r"p=1.5 must be a number in \(0, 1\]"),
    (dict(p=torch.tensor([0.5, 0.9], dtype=torch.float64)), "host float32 tensor"),
    (dict(keep_ratio=0), "keep_ratio=0 must be None or a number in"),
    (dict(block_size=0), "block_size=0 must be >= 1"),
    (dict(sink=-1), "sink=-1 must be >= 0"),
    (dict(last_q=True), "last_q=True must be an integer >= 1"),
    (dict(selection="cheap"), "selection='cheap' is not one of"),
], ids=lambda x: next(iter(x)) if isinstance(x, dict) else "")
def test_a_bad_value_is_refused_when_the_rule_is_built(override, message):
    with pytest.raises(ValueError, match=message):
        SelectionRule(**{**GOOD, **override})


def test_a_rule_is_frozen_and_hashable():
    rule = SelectionRule(**GOOD, p=0.9)
    assert rule == SelectionRule(**GOOD, p=0.9) and hash(rule) == hash(SelectionRule(**GOOD, p=0.9))
    assert len({rule, SelectionRule(**GOOD, p=0.9), SelectionRule(**GOOD, keep_ratio=0.3)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.p = 0.5
    assert (rule.p, rule.keep_ratio, rule.selection, rule.effective_min_tokens) == (0.9, None, "paper", 12)
    with pytest.raises(ValueError, match="must be >= 1"):  # replace() checks again
        dataclasses.replace(rule, block_size=0)


def test_a_rule_reads_a_drop_point_of_a_config():
    config = UniPrefillConfig(p=0.8, block_size=32, sink=16, last_q=64, keep_ratio=[0.5, 0.3])
    rule = SelectionRule.from_config(config, 1, 2)
    assert rule == SelectionRule(block_size=32, sink=16, last_q=64, min_tokens=config.effective_min_tokens,
                                 p=0.8, keep_ratio=0.3, selection=config.selection)
    assert SelectionRule.from_config(UniPrefillConfig(), 0, 1).selection == "content"  # top-p's default rule


def test_the_api_takes_only_a_rule():
    cu = torch.tensor([0, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match="rule must be a SelectionRule, got dict"):
        api.select_blocks(torch.ones(2), torch.tensor([0, 2], dtype=torch.int32), cu, dict(GOOD), impl="torch")
    assert api.SelectionRule is SelectionRule
