"""Print what the uniprefill backend makes of a tiny Llama graph on this machine's versions (diagnostics)."""
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

import uniprefill

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
print("torch", torch.__version__, "transformers", transformers.__version__, "device", device)
cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
cfg._attn_implementation = "sdpa"
model = AutoModelForCausalLM.from_config(cfg).to(device).eval()
compiled = uniprefill.compile(model, uniprefill.UniPrefillConfig(p=0.9, drop_layers=(1, 2), sink=16, last_q=16, block_size=16))
with torch.no_grad():
    compiled(input_ids=torch.randint(0, 128, (1, 300), device=device), use_cache=False, logits_to_keep=1)
for report in uniprefill.graph_reports(compiled):
    print(report)
print(uniprefill.last_drop_report(compiled))
