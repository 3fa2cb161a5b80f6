import torch, warnings, copy
warnings.simplefilter("ignore")
import transformers, uniprefill
from uniprefill.testing.fuzz import build_model, _first_full_layers
print(transformers.__version__)
for arch in ("tiny-qwen3.5", "tiny-llama", "tiny-qwen3-next"):
  for form in ("causal", "documents"):
    for rows, L in ((2, 37), (1, 37), (2, 120)):
        model = build_model(arch, torch.float32)
        vis = torch.tril(torch.ones(L, L, dtype=torch.bool))
        if form == "documents": vis[20:, :20] = False
        m = vis[None, None].expand(rows, 1, L, L)
        ids = torch.randint(3, 100, (rows, L), generator=torch.Generator().manual_seed(0))
        opts = {"p": 1.0, "drop_layers": _first_full_layers(model), "sink": 4, "last_q": 8, "block_size": 8}
        for door in ("torch.compile", "uniprefill.compile"):
            torch._dynamo.reset()
            twin = copy.deepcopy(model)
            c = torch.compile(twin, backend="uniprefill", options=opts) if door == "torch.compile" else uniprefill.compile(twin, uniprefill.UniPrefillConfig(**opts))
            try:
                with torch.no_grad():
                    ref = model(input_ids=ids, attention_mask=m, use_cache=False).logits
                    out = c(input_ids=ids, attention_mask=m, use_cache=False).logits
                print(arch, form, rows, L, door, "eq", torch.allclose(out, ref, atol=1e-4))
            except Exception as e:
                print(arch, form, rows, L, door, "RAISED", type(e).__name__, str(e)[:160].replace("\n", " "))
