"""Where does an eval record's wall time go on the GPU? (diagnostic, random weights)

A Gemma-3-270M-shaped model with random weights (18 layers, 5:1 sliding/full, head_dim
256, vocab 262144), bf16, prompts of a few lengths near 8K: per system (the plain model
and uniprefill with a forced retention), the wall time of a warm-up prefill, a timed
prefill and a 32-token greedy generation, with dynamo's compile counters after each; then
a cProfile of one uniprefill generation (top functions by own time).

Usage (GPU box): python scripts/gpu/probe_eval_speed.py
"""

import cProfile
import pstats
import time

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from uniprefill import UniPrefillConfig
from uniprefill.eval.systems import System, baseline_spec, uniprefill_spec


def main() -> None:
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                           num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                           head_dim=256, sliding_window=512, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).eval()
    systems = [System(baseline_spec(), model),
               System(uniprefill_spec(UniPrefillConfig(keep_ratio=0.2, drop_layers="all")), model)]

    def wall(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    for length in (8000, 8101, 8213, 16050):
        ids = torch.randint(0, cfg.vocab_size, (1, length), device="cuda")
        mask = torch.ones_like(ids)
        for s in systems:
            with torch.no_grad():
                warm, _ = wall(lambda: s.prefill(ids, mask))
                timed, _ = wall(lambda: s.prefill(ids, mask))
                gen, out = wall(lambda: s.generate(ids, mask, max_new_tokens=32, stopping_criteria=[],
                                                   pad_token_id=0, eos_token_id=None))
            print(f"{length} {s.spec.label:45s} warm {warm:.3f}s timed {timed:.3f}s "
                  f"generate({out.shape[1]}) {gen:.3f}s  dynamo {dict(counters['stats'])}", flush=True)
    s = systems[1]
    ids = torch.randint(0, cfg.vocab_size, (1, 8300), device="cuda")
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        s.generate(ids, torch.ones_like(ids), max_new_tokens=32, stopping_criteria=[], pad_token_id=0,
                   eos_token_id=None)
        torch.cuda.synchronize()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
