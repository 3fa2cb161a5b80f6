"""4-D attention masks of the caller's own (causal; two packed documents, bool and float) through uniprefill.compile on tiny
Llama / Gemma-3 / Qwen3-Next, p = 1 and keep 0.4: the causal one drops, the others run unaccelerated with the reason, all
equal to the plain model where nothing is dropped.

    python docs/results/fuzz-cpu-local-2026-12-06/mask4d_probe.py
"""
import torch, warnings
warnings.simplefilter("ignore")
import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.testing.fuzz import build_model
T = 300
causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
docs = causal.clone(); docs[150:, :150] = False  # two packed documents
for arch in ("tiny-llama", "tiny-gemma3", "tiny-qwen3-next"):
  for setting in (dict(p=1.0), dict(keep_ratio=0.4)):
    model = build_model(arch, torch.float32)
    fast = uniprefill.compile(model, UniPrefillConfig(drop_layers="all", sink=16, last_q=16, block_size=16, **setting))
    ids = torch.randint(3, 100, (1, T), generator=torch.Generator().manual_seed(0))
    for name, m in (("bool causal", causal[None, None]), ("bool docs", docs[None, None]),
                    ("float docs", torch.zeros(1, 1, T, T).masked_fill(~docs, float("-inf")))):
        try:
            with torch.no_grad():
                ref = model(input_ids=ids, attention_mask=m, use_cache=False).logits
        except Exception as e:
            print(arch, setting, name, "plain raised", type(e).__name__, str(e)[:80]); continue
        with torch.no_grad():
            out = fast(input_ids=ids, attention_mask=m, use_cache=False).logits
        why = fast.backend.last_unaccelerated
        print(arch, setting, name, "all eq:", torch.allclose(out, ref, atol=1e-4), "last eq:", torch.allclose(out[:, -1], ref[:, -1], atol=1e-4),
              "kept:", fast.history and [p.kept for p in fast.history.points], "why:", why and str(why)[:120])
