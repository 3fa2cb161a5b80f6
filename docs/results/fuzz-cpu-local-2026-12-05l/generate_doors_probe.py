import warnings, sys, torch; warnings.filterwarnings("ignore")
import uniprefill
from uniprefill.testing import fuzz
from uniprefill.testing.fuzz_cases import SETTINGS
from uniprefill.models.layer_kinds import LayerKind, layer_kinds
arch = sys.argv[1]
model = fuzz.build_model(arch, torch.float32)
drops = tuple(i for i, k in enumerate(layer_kinds(model.config)) if k == LayerKind.FULL)[:2] or "all"
fast = uniprefill.compile(model, uniprefill.UniPrefillConfig(p=1.0, drop_layers=drops, **SETTINGS))
g = torch.Generator().manual_seed(0)
for rows in (1, 2):
    ids = torch.randint(3, 100, (rows, 90), generator=g); mask = torch.ones_like(ids)
    if rows == 2: mask[1, :20] = 0
    emb = model.get_input_embeddings()(ids).detach()
    cases = {
        "inputs_embeds": dict(inputs_embeds=emb, attention_mask=mask),
        "use_cache False": dict(input_ids=ids, attention_mask=mask, use_cache=False),
        "scores": dict(input_ids=ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, output_logits=True),
        "rep penalty+min_new": dict(input_ids=ids, attention_mask=mask, repetition_penalty=1.3, min_new_tokens=3),
        "max_length": dict(input_ids=ids, attention_mask=mask, max_length=95, max_new_tokens=None),
    }
    for name, kw in cases.items():
        kw = {"max_new_tokens": 5, "pad_token_id": 0, "do_sample": False, **kw}
        with torch.no_grad():
            try:
                ref = model.generate(**kw)
            except Exception as e:
                print(arch, rows, name, "plain raised", type(e).__name__, str(e)[:120]); continue
            try:
                out = fast.generate(**kw)
            except Exception as e:
                print(arch, rows, name, "FAST RAISED", type(e).__name__, str(e)[:300]); continue
        if isinstance(ref, torch.Tensor):
            ok = torch.equal(out, ref)
        else:
            ok = torch.equal(out.sequences, ref.sequences) and all(torch.allclose(a, b, atol=1e-4, rtol=0) for a, b in zip(out.logits, ref.logits)) and len(out.logits) == len(ref.logits)
        h = fast.history
        print(arch, rows, name, "equal" if ok else "MISMATCH", "acc" if (h is not None and h.points) or any(x is not None and x.points for x in (fast.row_histories or [])) else f"unacc: {str(fast.backend.last_unaccelerated)[:80]}", flush=True)
