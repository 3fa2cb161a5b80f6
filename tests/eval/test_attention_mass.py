"""uniprefill.measure.attention_mass (behind benchmarks/attention_mass.py): the probe leaves the
model's output alone and records what the selection rules would keep; the per-layer record's shares and ranks are right on known scores."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AttentionInterface, LlamaConfig

from uniprefill.measure import attention_mass as am


def test_layer_record_on_known_scores():
    block = 16  # 10 blocks: 0 (sink) and 9 (window) are forced
    per_block = [313.5, 8.0, 1.0, 4.0, 2.0, 16.0, 1.0, 0.5, 0.5, 313.5]
    token = torch.tensor(per_block).repeat_interleave(block) / block  # block means = per_block / 16
    rec = am.layer_record(token, [(5 * block + 3, 5 * block + 6)], block_size=block, sink=1, last_q=1)
    total = sum(per_block)
    assert abs(rec["sink_share"] - 313.5 / total) < 1e-6 and abs(rec["window_share"] - 313.5 / total) < 1e-6
    assert abs(rec["needle_share"] - 16.0 / total) < 1e-6  # block 5 holds the needle
    assert abs(rec["sink_share"] + rec["window_share"] + rec["free_share"] - 1) < 1e-6
    assert rec["needle_rank"] == 0.0 and rec["free_blocks"] == 8
    # the paper's rule at p = 0.9 keeps the forced blocks only (they hold 95%) and loses it
    assert rec["paper@0.9_kept"] == 0.2 and rec["paper@0.9_needle"] is False
    # "content" keeps blocks 5, 1, 3, 4 on top of them (30 of 33 >= 0.9 * 33)
    assert rec["content@0.9_kept"] == 0.6 and rec["content@0.9_needle"] is True
    assert rec["free_top"][:4] == [5, 1, 3, 4]


def test_probe_records_every_full_layer_and_changes_nothing():
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 128, (1, 200))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        probe = am.ScoreProbe(last_q=16)
        AttentionInterface.register("uniprefill_probe_test", probe)
        model.config._attn_implementation = "uniprefill_probe_test"
        probed = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(plain, probed)
    assert sorted(probe.scores) == [0, 1, 2]
    for scores in probe.scores.values():
        assert scores.shape == (200,)
        assert abs(float(scores.sum()) - 4.0) < 1e-4  # one per head
