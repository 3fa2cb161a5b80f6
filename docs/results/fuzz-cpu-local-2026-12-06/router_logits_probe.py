"""`output_router_logits=True` through `uniprefill.compile` on a tiny Qwen3-Next (drop at its one full-attention
layer, the last): which call is rewritten, and do the router logits come back with every row, equal to the plain
model's?  Before 2026-12-06: p = 0.5 returned the last layer's router logits for the 172 kept rows of 300.

    python docs/results/fuzz-cpu-local-2026-12-06/router_logits_probe.py
"""
import warnings

import torch

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.testing.fuzz import build_model

for p in (1.0, 0.5):
    for cache in (True, False):
        model = build_model("tiny-qwen3-next", torch.float32)
        fast = uniprefill.compile(model, UniPrefillConfig(p=p, sink=16, last_q=16, block_size=16, drop_layers=(3,)))
        ids = torch.randint(3, 100, (1, 300), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fast(input_ids=ids, use_cache=cache, output_router_logits=True)
            ref = model(input_ids=ids, use_cache=cache, output_router_logits=True)
        why = fast.backend.last_unaccelerated
        print(f"p={p} use_cache={cache}: unaccelerated: {why and str(why)[:160]}; kept: "
              f"{fast.history and [pt.kept for pt in fast.history.points]}")
        print("   router logits shapes:", [tuple(t.shape) for t in out.router_logits], "plain:",
              [tuple(t.shape) for t in ref.router_logits])
        print("   equal per layer:", [a.shape == b.shape and torch.allclose(a, b, atol=1e-4)
                                      for a, b in zip(out.router_logits, ref.router_logits)])
