"""A base OPT model with `do_layer_norm_before=False` (no final norm: the base model returns the last layer's output
as it is) and its LM, through `uniprefill.compile`, p = 1 and keep 0.4 after layer 1: the shapes of
`last_hidden_state` / `logits` against the plain model's. Before 2026-12-06 the base model's `last_hidden_state`
came back with the kept rows only at keep 0.4 ((1, 124, 64) against (1, 300, 64)).

    python docs/results/fuzz-cpu-local-2026-12-06/base_model_probe.py
"""
import warnings

import torch
from transformers import AutoModel, AutoModelForCausalLM, OPTConfig

import uniprefill
from uniprefill import UniPrefillConfig

warnings.simplefilter("ignore")
for setting in (dict(p=1.0), dict(keep_ratio=0.4)):
    for cls in (AutoModel, AutoModelForCausalLM):
        cfg = OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
                        max_position_embeddings=1024, do_layer_norm_before=False, word_embed_proj_dim=64)
        torch.manual_seed(0)
        model = cls.from_config(cfg).eval()
        fast = uniprefill.compile(model, UniPrefillConfig(drop_layers=(1,), sink=16, last_q=16, block_size=16, **setting))
        ids = torch.randint(3, 100, (1, 300), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out, ref = fast(input_ids=ids, use_cache=False), model(input_ids=ids, use_cache=False)
        key = "last_hidden_state" if cls is AutoModel else "logits"
        line = (f"{setting} {cls.__name__}: kept {fast.history and [p.kept for p in fast.history.points]}, {key} "
                f"{tuple(out[key].shape)} (plain {tuple(ref[key].shape)})")
        if "p" in setting:
            line += f", equal: {out[key].shape == ref[key].shape and torch.allclose(out[key], ref[key], atol=1e-4)}"
        print(line)
