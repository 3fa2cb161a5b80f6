"""drop_layers="auto": the rule of `uniprefill.passes.drop_points` (rule 2)."""

from uniprefill.passes.drop_points import auto_drop_layers


def test_models_whose_every_layer_is_full_attention_start_dropping_at_half_depth():
    # SmolLM2-135M: the layers before 14 do not rank the needle (docs/selection.md)
    assert auto_drop_layers(["full"] * 30) == (14, 18, 22, 26)
    assert auto_drop_layers(["full"] * 32) == (15, 19, 23, 27)  # Llama-3.1-8B
    assert auto_drop_layers(["full"] * 24) == (11, 14, 17, 20)
    assert auto_drop_layers(["full"] * 4) == (1, 2)


def test_hybrids_keep_the_quarter_depth_start():
    gemma3_270m = (["sliding"] * 5 + ["full"]) * 3
    assert auto_drop_layers(gemma3_270m) == (5, 11)
    qwen3_next = (["linear"] * 3 + ["full"]) * 12  # 48 layers, full attention every fourth
    assert auto_drop_layers(qwen3_next) == (11, 19, 27, 35, 43)
    assert auto_drop_layers(["sliding", "full"] * 12) == (5, 9, 13, 17, 21)  # GPT-OSS-like alternation
    assert auto_drop_layers(["sliding"] * 8) == ()
