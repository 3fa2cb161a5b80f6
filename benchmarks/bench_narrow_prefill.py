"""Prefill overhead on a narrow Gemma-3-shaped model (CPU): what is not matrix work.

A Gemma-3-270M layer pattern (18 layers, 5:1 sliding/full, window 512) at hidden size 64,
random weights, so attention masks, gathers and dispatch dominate instead of matmuls.
Times the plain model and `uniprefill.compile(keep_ratio=KEEP, drop_layers="all")` (KEEP 0.1
unless a third argument gives it)
alternately (median of 4 after a warm-up). To compare two versions of uniprefill, run it
once per checkout: `python -P benchmarks/bench_narrow_prefill.py CHECKOUT LENGTH`, where
CHECKOUT is put first on sys.path (e.g. a `git worktree add /tmp/old <commit>`);
`python -P benchmarks/bench_narrow_prefill.py CHECKOUT LENGTH KEEP` sets the retention.
"""
import sys, time, torch, statistics
sys.path.insert(0, sys.argv[1])
import uniprefill
print(uniprefill.__file__)
from transformers import Gemma3TextConfig, AutoModelForCausalLM
from uniprefill import UniPrefillConfig
torch.manual_seed(0)
cfg = Gemma3TextConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=18,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=512, max_position_embeddings=32768)
cfg._attn_implementation="sdpa"
model = AutoModelForCausalLM.from_config(cfg).eval()
fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=float(sys.argv[3]) if len(sys.argv) > 3 else 0.1, drop_layers="all"))
ids = torch.randint(0,1000,(1,int(sys.argv[2])))
def run(fn):
    with torch.no_grad(): return fn(input_ids=ids, use_cache=False, logits_to_keep=1).logits
run(fast); run(model)
tb, tf = [], []
for _ in range(4):
    t=time.perf_counter(); run(model); tb.append(time.perf_counter()-t)
    t=time.perf_counter(); run(fast); tf.append(time.perf_counter()-t)
print(f"N={ids.shape[1]} keep={fast.backend.config.keep_ratio} baseline {statistics.median(tb)*1000:.0f} ms  uniprefill {statistics.median(tf)*1000:.0f} ms  speedup {statistics.median(tb)/statistics.median(tf):.2f}x")
